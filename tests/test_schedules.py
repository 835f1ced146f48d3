"""fzero.optim.schedules: hand-derived tables, properties, DeepSpeed's counting, errors.

Every expected value below was worked out by hand from the formulas (DeepSpeed's
``get_lr()`` at ``last_batch_iteration = count - 1``; optax's formulas at ``count``), not by
calling the code under test.

Cross-check against real DeepSpeed, done once while writing this file (not run here: the
test suite does not import deepspeed). Both compared values bit for bit (``==``):

    # scheduler classes of DeepSpeed 0.19.8, driven as the engine drives them
    # (read param_groups[0]["lr"] for update k, then scheduler.step()),
    # over 400 random parameter sets of every schedule plus the defaults:
    .venv/bin/pip download deepspeed --no-deps --no-binary :all: -d /tmp/dsdl
    tar xzf /tmp/dsdl/deepspeed-0.19.8.tar.gz -C /tmp/dsdl
    .venv/bin/python /tmp/dscheck/crosscheck.py   # loads lr_schedules.py with a stub logger
    -> 2403/2403 traces bit-identical to DeepSpeed 0.19.8

    # the real engine: deepspeed.initialize on CPU (gloo, world of 1) with a JSON
    # "scheduler" section, recording the lr each optimizer.step() saw over 16 updates:
    python3 -m venv /tmp/dsvenv   # + a .pth to the project venv for torch
    /tmp/dsvenv/bin/pip install --no-deps hjson ninja py-cpuinfo msgpack psutil
    PYTHONPATH=/tmp/dsdl/deepspeed-0.19.8 /tmp/dsvenv/bin/python /tmp/dscheck/engine_check.py
    -> 6/6 engine traces identical (WarmupLR x2, WarmupDecayLR, WarmupCosineLR,
       OneCycle with stairs and decay, LRRangeTest)
"""

import doctest
import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fzero.optim import schedules
from fzero.optim.schedules import (
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    constant,
    cosine_decay,
    join_schedules,
    linear,
    linear_warmup,
    warmup_cosine,
)

REL = 1e-12  # hand values are exact decimals or written to 16 digits
COS_PI_8 = 0.9238795325112867  # cos(pi/8)
COS_PI_6 = 0.8660254037844387  # cos(pi/6) = sqrt(3)/2
COS_PI_12 = 0.9659258262890683  # cos(pi/12)
LOG8_3 = 0.5283208335737187  # ln 3 / ln 8


def one_cycle(**params):
    params.setdefault("cycle_momentum", False)
    return OneCycle(**params)


def check_table(fn, table):
    for count, expected in table:
        assert fn(count) == pytest.approx(expected, rel=REL, abs=1e-15), (count, expected)


# ----------------------------------------------------------------- optax's schedules


def test_constant():
    check_table(constant(0.25), [(0, 0.25), (1, 0.25), (10**9, 0.25)])


def test_linear_warmup_table():
    f = linear_warmup(2.0, warmup=4)  # 2.0 * min(k, 4) / 4
    check_table(f, [(0, 0.0), (1, 0.5), (3, 1.5), (4, 2.0), (5, 2.0), (1000, 2.0)])
    check_table(linear_warmup(2.0, warmup=0), [(0, 2.0), (7, 2.0)])


def test_linear_and_cosine_decay_tables():
    check_table(linear(1.0, 0.2, 4), [(0, 1.0), (1, 0.8), (2, 0.6), (4, 0.2), (9, 0.2)])
    check_table(linear(0.3, 0.7, 0), [(0, 0.7), (5, 0.7)])
    # 0.5 * (1 + cos(pi * k / 8)), floored by alpha = 0.25: 0.75 * c + 0.25
    f = cosine_decay(1.0, 8, alpha=0.25)
    check_table(f, [(0, 1.0), (1, 0.75 * 0.5 * (1 + COS_PI_8) + 0.25), (4, 0.625),
                    (8, 0.25), (20, 0.25)])


def test_join_schedules_counts_from_each_boundary():
    f = join_schedules([constant(3.0), linear(1.0, 0.0, 4), constant(9.0)], [2, 6])
    check_table(f, [(0, 3.0), (1, 3.0), (2, 1.0), (3, 0.75), (5, 0.25), (6, 9.0), (99, 9.0)])


def test_warmup_cosine_table():
    # peak 1, warmup 4, total 12: linear to k=4, then 0.5 * (1 + cos(pi * (k - 4) / 8)).
    f = warmup_cosine(1.0, warmup=4, total=12)
    check_table(f, [
        (0, 0.0), (1, 0.25), (3, 0.75), (4, 1.0),
        (5, 0.5 * (1 + COS_PI_8)),            # 0.9619397662556434
        (8, 0.5),                             # mid-decay
        (11, 0.5 * (1 - COS_PI_8)),           # total - 1: 0.0380602337443566
        (12, 0.0), (13, 0.0), (10**6, 0.0),
    ])
    # end = 0.2: a = 0.2, value = 0.8 * c + 0.2 after warmup.
    g = warmup_cosine(1.0, warmup=4, total=12, end=0.2)
    check_table(g, [(2, 0.5), (4, 1.0), (5, 0.8 * 0.5 * (1 + COS_PI_8) + 0.2), (8, 0.6),
                    (12, 0.2), (500, 0.2)])
    # The spec's example: 3e-4, warmup 100, total 10_000 (decay over 9_900 updates).
    h = warmup_cosine(3e-4, warmup=100, total=10_000)
    check_table(h, [(0, 0.0), (50, 1.5e-4), (100, 3e-4), (100 + 4950, 1.5e-4), (10_000, 0.0)])


def optax_warmup_cosine(peak, warmup, total, end, k):
    """optax's warmup_cosine_decay_schedule(0, peak, warmup, total, end), written out."""
    if k < warmup:
        return peak * k / warmup
    d = total - warmup
    a = 0.0 if peak == 0 else end / peak
    return peak * ((1 - a) * 0.5 * (1 + math.cos(math.pi * min(k - warmup, d) / d)) + a)


@settings(max_examples=60, deadline=None)
@given(peak=st.floats(0.0, 10.0), frac=st.floats(0.0, 1.0), warmup=st.integers(0, 300),
       decay=st.integers(1, 3000), k=st.integers(0, 5000))
def test_warmup_cosine_is_optax_formula(peak, frac, warmup, decay, k):
    end = peak * frac
    f = warmup_cosine(peak, warmup, warmup + decay, end)
    expected = optax_warmup_cosine(peak, warmup, warmup + decay, end, k)
    assert f(k) == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert min(0.0, end) - 1e-12 <= f(k) <= peak * (1 + 1e-12)


@settings(max_examples=40, deadline=None)
@given(peak=st.floats(1e-6, 10.0), frac=st.floats(0.0, 1.0), warmup=st.integers(1, 200),
       decay=st.integers(1, 400))
def test_warmup_cosine_shape_and_continuity(peak, frac, warmup, decay):
    end = peak * frac
    total = warmup + decay
    f = warmup_cosine(peak, warmup, total, end)
    v = [f(k) for k in range(total + 3)]
    eps = 1e-12 * peak
    assert all(a <= b + eps for a, b in zip(v[:warmup], v[1:warmup + 1]))  # up in warmup
    assert all(a + eps >= b for a, b in zip(v[warmup:], v[warmup + 1:]))  # down after
    assert v[warmup] == pytest.approx(peak, rel=1e-12)
    assert v[total] == pytest.approx(end, rel=1e-9, abs=1e-15)
    # No jump at the phase boundary (or anywhere) beyond the steepest slope of either phase.
    slope = max(peak / warmup, math.pi / 2 * (peak - end) / decay)
    assert all(abs(b - a) <= slope + eps for a, b in zip(v, v[1:]))


# --------------------------------------------------------------- DeepSpeed: WarmupLR


def test_warmup_lr_linear_table():
    # lo 0.1, hi 0.5, W 4, linear: count 0 -> lo (constructor); j = count-1 -> lo + 0.4 * j/4
    f = WarmupLR(warmup_min_lr=0.1, warmup_max_lr=0.5, warmup_num_steps=4, warmup_type="linear")
    check_table(f, [(0, 0.1), (1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4), (5, 0.5), (6, 0.5),
                    (10**6, 0.5)])


def test_warmup_lr_log_table():
    # lo 0.1, hi 0.4, W 8, log: lo + 0.3 * ln(j+1)/ln 8 with j = count-1; ln2/ln8 = 1/3.
    f = WarmupLR(warmup_min_lr=0.1, warmup_max_lr=0.4, warmup_num_steps=8)
    check_table(f, [(0, 0.1), (1, 0.1), (2, 0.2), (3, 0.1 + 0.3 * LOG8_3), (4, 0.3),
                    (7, 0.1 + 0.3 * math.log(7) / math.log(8)), (8, 0.4), (9, 0.4)])


def test_warmup_lr_one_step_is_two():
    # DeepSpeed warms up over max(2, warmup_num_steps) steps.
    lin = WarmupLR(warmup_max_lr=1.0, warmup_num_steps=1, warmup_type="linear")
    check_table(lin, [(0, 0.0), (1, 0.0), (2, 0.5), (3, 1.0)])
    log = WarmupLR(warmup_max_lr=1.0, warmup_num_steps=1, warmup_type="log")
    check_table(log, [(0, 0.0), (1, 0.0), (2, 1.0), (3, 1.0)])


def test_warmup_lr_defaults_and_base_lr():
    f = WarmupLR()  # lo 0, hi 0.001, W 1000, log: ln 10 / ln 1000 = 1/3
    check_table(f, [(0, 0.0), (1, 0.0), (10, 0.001 / 3), (100, 0.002 / 3), (1000, 0.001),
                    (1001, 0.001)])
    g = WarmupLR(0.5, warmup_num_steps=4, warmup_type="linear")  # hi = optimizer's lr
    check_table(g, [(3, 0.25), (5, 0.5)])
    h = WarmupLR(0.5, warmup_max_lr=0.2, warmup_num_steps=4, warmup_type="linear")
    check_table(h, [(5, 0.2)])


# ---------------------------------------------------------- DeepSpeed: WarmupDecayLR


def test_warmup_decay_lr_linear_table():
    # T 10, W 4, lo 0, hi 1: warmup j/4; then max(0, (10 - j) / 6); j = count - 1.
    f = WarmupDecayLR(total_num_steps=10, warmup_max_lr=1.0, warmup_num_steps=4,
                      warmup_type="linear")
    check_table(f, [(0, 0.0), (1, 0.0), (2, 0.25), (3, 0.5), (4, 0.75), (5, 1.0),
                    (6, 5 / 6), (8, 0.5), (9, 2 / 6), (10, 1 / 6), (11, 0.0), (50, 0.0)])


def test_warmup_decay_lr_log_table():
    # T 20, W 8, lo 0.1, hi 0.7, log: warmup lo + 0.6*ln(j+1)/ln 8; decay (20 - j)/12.
    f = WarmupDecayLR(total_num_steps=20, warmup_min_lr=0.1, warmup_max_lr=0.7,
                      warmup_num_steps=8)
    check_table(f, [(0, 0.1), (1, 0.1), (2, 0.3), (4, 0.5), (8, 0.7), (9, 0.7),
                    (15, 0.4), (20, 0.15), (21, 0.1), (100, 0.1)])


def test_warmup_decay_lr_total_equal_to_warmup():
    # No decay window: max(1, T - W) = 1, so the lr drops to lo right after the warmup.
    f = WarmupDecayLR(total_num_steps=4, warmup_max_lr=1.0, warmup_num_steps=4,
                      warmup_type="linear")
    check_table(f, [(4, 0.75), (5, 0.0), (6, 0.0)])


@settings(max_examples=50, deadline=None)
@given(lo=st.floats(0.0, 1.0), span=st.floats(0.0, 1.0), w=st.integers(1, 60),
       extra=st.integers(1, 80), kind=st.sampled_from(["log", "linear"]))
def test_warmup_decay_lr_properties(lo, span, w, extra, kind):
    hi = lo + span
    W = max(2, w)
    total = W + extra
    f = WarmupDecayLR(total_num_steps=total, warmup_min_lr=lo, warmup_max_lr=hi,
                      warmup_num_steps=w, warmup_type=kind)
    g = WarmupLR(warmup_min_lr=lo, warmup_max_lr=hi, warmup_num_steps=w, warmup_type=kind)
    v = [f(k) for k in range(total + 4)]
    eps = 1e-12 * max(hi, 1e-300)
    top = W if kind == "log" else W + 1  # the count that first applies the peak
    assert all(lo - eps <= x <= hi + eps for x in v)                              # bounded
    assert all(a <= b + eps for a, b in zip(v[:top], v[1:top + 1]))               # warmup up
    assert all(a + eps >= b for a, b in zip(v[top:], v[top + 1:]))               # decay down
    assert v[top] == pytest.approx(hi, rel=1e-12)                                 # reaches peak
    assert v[top + 1] == pytest.approx(hi if kind == "log" else hi - span / max(1, total - W),
                                       rel=1e-12, abs=1e-15)                     # no jump
    assert v[-1] == pytest.approx(lo, rel=1e-12, abs=1e-15)                       # ends at lo
    assert [g(k) for k in range(top + 1)] == v[:top + 1]                          # same warmup
    assert all(g(k) == pytest.approx(hi, rel=1e-12) for k in range(top, top + 5))


# --------------------------------------------------------- DeepSpeed: WarmupCosineLR


def test_warmup_cosine_lr_linear_table():
    # base 2, T 10, W 4, linear, ratios 0: warmup j/4; then (1 + cos(pi * (j-3)/6)) / 2.
    f = WarmupCosineLR(2.0, total_num_steps=10, warmup_num_steps=4, cos_min_ratio=0.0,
                       warmup_type="linear")
    check_table(f, [(0, 0.0), (1, 0.0), (2, 0.5), (3, 1.0), (4, 1.5),
                    (5, 1 + COS_PI_6),          # j=4: p=1/6
                    (7, 1.0),                   # j=6: p=1/2
                    (9, 1 - COS_PI_6),          # j=8: p=5/6 (total - 1)
                    (10, 0.0), (11, 0.0), (100, 0.0)])


def test_warmup_cosine_lr_log_table_with_ratios():
    # base 1, T 20, W 8, log, warmup_min_ratio 0.2, cos_min_ratio 0.1.
    f = WarmupCosineLR(1.0, total_num_steps=20, warmup_num_steps=8, warmup_min_ratio=0.2,
                       cos_min_ratio=0.1)
    check_table(f, [
        (0, 0.0),                              # before DeepSpeed's first step(): 0, not 0.2
        (1, 0.2), (2, 0.2 + 0.8 / 3), (4, 0.2 + 0.8 * 2 / 3), (8, 1.0),
        (9, 0.1 + 0.9 * (1 + COS_PI_12) / 2),  # j=8: p = 1/12
        (14, 0.55),                            # j=13: p = 1/2
        (20, 0.1), (21, 0.1), (1000, 0.1),
    ])


def test_warmup_cosine_lr_defaults():
    f = WarmupCosineLR(1.0, total_num_steps=2000)  # W 1000 log, cos_min_ratio 1e-4
    check_table(f, [(0, 0.0), (1, 0.0), (10, 1 / 3), (1000, 1.0), (1500, 0.5 + 0.5e-4),
                    (2000, 1e-4), (3000, 1e-4)])


@settings(max_examples=50, deadline=None)
@given(base=st.floats(1e-6, 5.0), wmin=st.floats(0.0, 1.0), cmin=st.floats(0.0, 1.0),
       w=st.integers(1, 60), extra=st.integers(0, 80), kind=st.sampled_from(["log", "linear"]))
def test_warmup_cosine_lr_properties(base, wmin, cmin, w, extra, kind):
    W = max(2, w)
    total = W + extra
    f = WarmupCosineLR(base, total_num_steps=total, warmup_min_ratio=wmin, warmup_num_steps=w,
                       cos_min_ratio=cmin, warmup_type=kind)
    v = [f(k) for k in range(total + 4)]
    eps = 1e-12 * base
    assert all(0.0 <= x <= base + eps for x in v)
    assert all(a <= b + eps for a, b in zip(v[:W], v[1:W + 1]))          # up in warmup
    assert v[1] == pytest.approx(base * wmin, rel=1e-12, abs=1e-300)
    # The floor from count T on (from W + 1 when T == W: count W still ends the warmup).
    assert all(x == pytest.approx(base * cmin, rel=1e-12, abs=1e-300)
               for x in v[max(total, W + 1):])
    assert all(a + eps >= b for a, b in zip(v[W + 1:], v[W + 2:]))      # down after


# ---------------------------------------------------------------- DeepSpeed: OneCycle


def test_one_cycle_symmetric_table():
    # lo .1, hi .5, S1 = S2 = 4: up .1 per count to k=4, down to k=8, then lo.
    f = one_cycle(cycle_min_lr=0.1, cycle_max_lr=0.5, cycle_first_step_size=4)
    check_table(f, [(0, 0.1), (1, 0.2), (2, 0.3), (3, 0.4), (4, 0.5), (5, 0.4), (6, 0.3),
                    (7, 0.2), (8, 0.1), (9, 0.1), (100, 0.1)])


def test_one_cycle_asymmetric_and_decay_tables():
    f = one_cycle(cycle_min_lr=0.1, cycle_max_lr=0.5, cycle_first_step_size=2,
                  cycle_second_step_size=6)
    check_table(f, [(1, 0.3), (2, 0.5), (5, 0.3), (8, 0.1)])
    # decay: lo / (1 + 0.5 * (k - 8) / 2)
    g = one_cycle(cycle_min_lr=0.1, cycle_max_lr=0.5, cycle_first_step_size=4,
                  decay_lr_rate=0.5, decay_step_size=2)
    check_table(g, [(8, 0.1), (9, 0.08), (10, 0.1 / 1.5), (12, 0.05), (28, 0.1 / 6)])
    for off in ({"decay_lr_rate": 0.0, "decay_step_size": 2},
                {"decay_lr_rate": 0.5, "decay_step_size": 0}):
        h = one_cycle(cycle_min_lr=0.1, cycle_max_lr=0.5, cycle_first_step_size=4, **off)
        check_table(h, [(9, 0.1), (50, 0.1)])


def test_one_cycle_stairs_table():
    # 2 stairs per half of 4 counts: the fraction is floor(2 * k / 4) / 2 going up,
    # floor(2 * (8 - k) / 4) / 2 going down.
    f = one_cycle(cycle_min_lr=0.1, cycle_max_lr=0.5, cycle_first_step_size=4,
                  cycle_first_stair_count=2)
    check_table(f, [(0, 0.1), (1, 0.1), (2, 0.3), (3, 0.3), (4, 0.5), (5, 0.3), (6, 0.3),
                    (7, 0.1), (8, 0.1)])
    g = one_cycle(cycle_min_lr=0.1, cycle_max_lr=0.5, cycle_first_step_size=4,
                  cycle_first_stair_count=2, cycle_second_stair_count=4)
    check_table(g, [(3, 0.3), (5, 0.4), (6, 0.3), (7, 0.2)])


@settings(max_examples=50, deadline=None)
@given(lo=st.floats(0.0, 1.0), span=st.floats(0.0, 1.0), s1=st.integers(1, 50),
       s2=st.integers(1, 50), rate=st.floats(0.0, 2.0), size=st.integers(0, 10))
def test_one_cycle_properties(lo, span, s1, s2, rate, size):
    hi = lo + span
    f = one_cycle(cycle_min_lr=lo, cycle_max_lr=hi, cycle_first_step_size=s1,
                  cycle_second_step_size=s2, decay_lr_rate=rate, decay_step_size=size)
    c = s1 + s2
    v = [f(k) for k in range(c + 10)]
    eps = 1e-12 * max(hi, 1e-300)
    assert all(0.0 <= x <= hi + eps for x in v) and all(x >= lo - eps for x in v[:c + 1])
    assert all(a <= b + eps for a, b in zip(v[:s1], v[1:s1 + 1]))             # up
    assert all(a + eps >= b for a, b in zip(v[s1:], v[s1 + 1:]))              # then down
    assert v[0] == lo and v[c] == pytest.approx(lo, rel=1e-12, abs=1e-15)
    assert v[s1] == pytest.approx(hi, rel=1e-12)                             # the peak
    slope = span * max(1 / s1, 1 / s2)                                       # no jumps
    assert all(abs(b - a) <= slope + eps for a, b in zip(v[:c + 1], v[1:c + 1]))


def test_one_cycle_momentum_is_not_cycled():
    with pytest.warns(UserWarning, match="does not cycle momentum"):
        f = OneCycle(cycle_min_lr=0.1, cycle_max_lr=0.5, cycle_first_step_size=4)
    assert f(4) == pytest.approx(0.5, rel=REL)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        OneCycle(cycle_min_lr=0.1, cycle_max_lr=0.5, cycle_momentum=False, cycle_min_mom=0.85,
                 cycle_max_mom=0.99, decay_mom_rate=0.0)


# ------------------------------------------------------------- DeepSpeed: LRRangeTest


def test_lr_range_test_tables():
    f = LRRangeTest(lr_range_test_min_lr=0.01, lr_range_test_step_size=10,
                    lr_range_test_step_rate=2.0)  # 0.01 * (1 + 2 * k / 10)
    check_table(f, [(0, 0.01), (1, 0.012), (5, 0.02), (10, 0.03), (25, 0.06)])
    g = LRRangeTest(lr_range_test_min_lr=0.01, lr_range_test_step_size=10,
                    lr_range_test_step_rate=2.0, lr_range_test_staircase=True)
    check_table(g, [(0, 0.01), (9, 0.01), (10, 0.03), (19, 0.03), (25, 0.05)])
    check_table(LRRangeTest(), [(0, 1e-3), (1000, 1.5e-3), (2000, 2e-3)])


@settings(max_examples=40, deadline=None)
@given(lo=st.floats(1e-6, 1.0), size=st.integers(1, 100), rate=st.floats(0.0, 10.0),
       k=st.integers(0, 2000))
def test_lr_range_test_properties(lo, size, rate, k):
    cont = LRRangeTest(lr_range_test_min_lr=lo, lr_range_test_step_size=size,
                       lr_range_test_step_rate=rate)
    stair = LRRangeTest(lr_range_test_min_lr=lo, lr_range_test_step_size=size,
                        lr_range_test_step_rate=rate, lr_range_test_staircase=True)
    assert lo <= stair(k) <= cont(k) * (1 + 1e-12) and cont(k) <= cont(k + 1)
    assert stair(k * size) == pytest.approx(cont(k * size), rel=1e-12)


# ---------------------------------------------------------------------- every schedule


def all_schedules():
    return [
        constant(0.3), linear(1.0, 0.0, 50), cosine_decay(1.0, 50),
        linear_warmup(1.0, 30), warmup_cosine(1.0, 30, 300, 0.1),
        join_schedules([constant(1.0), cosine_decay(1.0, 10)], [5]),
        WarmupLR(warmup_num_steps=30), WarmupLR(warmup_num_steps=30, warmup_type="linear"),
        WarmupDecayLR(total_num_steps=300, warmup_num_steps=30),
        WarmupCosineLR(0.5, total_num_steps=300, warmup_num_steps=30),
        one_cycle(cycle_min_lr=0.1, cycle_max_lr=0.5, cycle_first_step_size=40,
                  cycle_first_stair_count=3, decay_lr_rate=0.1, decay_step_size=7),
        LRRangeTest(lr_range_test_step_size=13, lr_range_test_staircase=True),
    ]


@settings(max_examples=40, deadline=None)
@given(k=st.integers(0, 1000))
def test_tensor_count_equals_int_count(k):
    for f in all_schedules():
        expected = f(k)
        assert type(expected) is float
        for count in (torch.tensor(k), torch.tensor(k, dtype=torch.int32), float(k)):
            got = f(count)
            assert type(got) is float and got == expected, (f, count)


@pytest.mark.parametrize("bad, exc, match", [
    (-1, ValueError, "count must be >= 0"),
    (2.5, ValueError, "whole number"),
    ("3", TypeError, "count must be an int"),
    (torch.tensor([1, 2]), TypeError, "count must be an int"),
    (torch.tensor(-3), ValueError, "count must be >= 0"),
])
def test_bad_count(bad, exc, match):
    for f in all_schedules():
        with pytest.raises(exc, match=match):
            f(bad)


def test_schedules_doctests_run():
    result = doctest.testmod(schedules, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 10 and result.failed == 0


# ------------------------------------------------------------------------------ errors


PREFIX = "fzero.optim.schedules."


@pytest.mark.parametrize("make, exc, pieces", [
    (lambda: WarmupLR(warmup_max_lrr=1.0), TypeError,
     ["WarmupLR: unknown parameter 'warmup_max_lrr' (did you mean 'warmup_max_lr'?)",
      "valid parameters: warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, "
      "last_batch_iteration"]),
    (lambda: WarmupCosineLR(0.1, total_num_steps=10, cos_min_ration=0.1), TypeError,
     ["WarmupCosineLR: unknown parameter 'cos_min_ration' (did you mean 'cos_min_ratio'?)"]),
    (lambda: one_cycle(cycle_min_lr=0.1, cycle_max_lr=0.2, zzz=1), TypeError,
     ["OneCycle: unknown parameter 'zzz'; valid parameters: cycle_min_lr,"]),
    (lambda: LRRangeTest(lr_range_test_step=5), TypeError,
     ["LRRangeTest: unknown parameter 'lr_range_test_step' (did you mean"]),
    (lambda: WarmupDecayLR(warmup_num_steps=4), TypeError,
     ["WarmupDecayLR: missing required parameter 'total_num_steps'"]),
    (lambda: WarmupCosineLR(0.1), TypeError,
     ["WarmupCosineLR: missing required parameter 'total_num_steps'"]),
    (lambda: OneCycle(cycle_max_lr=0.1), TypeError,
     ["OneCycle: missing required parameter 'cycle_min_lr'"]),
    (lambda: WarmupLR(warmup_num_steps=0), ValueError,
     ["WarmupLR: warmup_num_steps must be >= 1, got 0"]),
    (lambda: WarmupLR(warmup_num_steps=-5), ValueError, ["warmup_num_steps must be >= 1"]),
    (lambda: WarmupLR(warmup_num_steps=10.5), ValueError, ["warmup_num_steps must be a whole"]),
    (lambda: WarmupLR(warmup_num_steps="100"), TypeError, ["warmup_num_steps must be an integer"]),
    (lambda: WarmupLR(warmup_type="cosine"), ValueError,
     ["WarmupLR: warmup_type must be one of ['log', 'linear'], got 'cosine'"]),
    (lambda: WarmupLR(warmup_min_lr=-1e-3), ValueError,
     ["warmup_min_lr must be a finite number >= 0"]),
    (lambda: WarmupLR(warmup_max_lr=float("nan")), ValueError, ["warmup_max_lr must be a finite"]),
    (lambda: WarmupLR(warmup_max_lr=[0.1, 0.2]), TypeError,
     ["warmup_max_lr must be one number; per-parameter-group lists are not supported"]),
    (lambda: WarmupLR(last_batch_iteration=5), ValueError, ["last_batch_iteration must be -1"]),
    (lambda: WarmupDecayLR(total_num_steps=5, warmup_num_steps=10), ValueError,
     ["WarmupDecayLR: total_num_steps=5 is less than the warmup length 10"]),
    (lambda: WarmupDecayLR(total_num_steps=1, warmup_num_steps=1), ValueError,
     ["total_num_steps=1 is less than the warmup length 2", "max(2, warmup_num_steps)"]),
    (lambda: WarmupDecayLR(total_num_steps=-1, warmup_num_steps=1), ValueError,
     ["total_num_steps must be >= 0"]),
    (lambda: WarmupCosineLR(0.1, total_num_steps=50, warmup_num_steps=100), ValueError,
     ["WarmupCosineLR: total_num_steps=50 is less than the warmup length 100"]),
    (lambda: WarmupCosineLR(-0.1, total_num_steps=50), ValueError, ["base_lr must be a finite"]),
    (lambda: one_cycle(cycle_min_lr=0.1, cycle_max_lr=0.2, cycle_first_step_size=0), ValueError,
     ["OneCycle: cycle_first_step_size must be >= 1"]),
    (lambda: one_cycle(cycle_min_lr=0.1, cycle_max_lr=0.2, cycle_second_step_size=-2), ValueError,
     ["cycle_second_step_size must be >= 0"]),
    (lambda: one_cycle(cycle_min_lr=0.1, cycle_max_lr=0.2, decay_step_size=-1), ValueError,
     ["decay_step_size must be >= 0"]),
    (lambda: one_cycle(cycle_min_lr=0.1, cycle_max_lr=0.2, cycle_first_stair_count=-1), ValueError,
     ["cycle_first_stair_count must be >= 0"]),
    (lambda: OneCycle(cycle_min_lr=0.1, cycle_max_lr=0.2, cycle_momentum="yes"), TypeError,
     ["cycle_momentum must be true or false"]),
    (lambda: LRRangeTest(lr_range_test_step_size=0), ValueError,
     ["LRRangeTest: lr_range_test_step_size must be >= 1"]),
    (lambda: LRRangeTest(lr_range_test_staircase=1), TypeError,
     ["lr_range_test_staircase must be true or false"]),
    (lambda: warmup_cosine(1e-3, warmup=100, total=100), ValueError,
     ["warmup_cosine: total must be greater than warmup", "total=100, warmup=100"]),
    (lambda: warmup_cosine(1e-3, warmup=-1, total=100), ValueError, ["warmup must be >= 0"]),
    (lambda: linear_warmup(float("inf"), 10), ValueError, ["linear_warmup: peak must be a finite"]),
    (lambda: cosine_decay(1.0, 0), ValueError, ["cosine_decay: decay_steps must be >= 1"]),
    (lambda: constant("0.1"), TypeError, ["constant: value must be a number"]),
    (lambda: join_schedules([constant(1.0)], [3]), ValueError,
     ["join_schedules: expected 0 boundaries for 1 schedules, got 1"]),
    (lambda: join_schedules([constant(1.0)] * 3, [5, 2]), ValueError,
     ["boundaries must be non-decreasing"]),
])
def test_errors_name_the_schedule_and_parameter(make, exc, pieces):
    with pytest.raises(exc) as info:
        make()
    msg = str(info.value)
    assert msg.startswith(PREFIX), msg
    for piece in pieces:
        assert piece in msg, (piece, msg)


def test_step_counts_accept_whole_floats_from_json():
    # json.loads("1e3") is a float; DeepSpeed's configs are JSON.
    a = WarmupDecayLR(total_num_steps=2e3, warmup_num_steps=1e2, warmup_type="linear")
    b = WarmupDecayLR(total_num_steps=2000, warmup_num_steps=100, warmup_type="linear")
    assert [a(k) for k in (0, 50, 101, 1500)] == [b(k) for k in (0, 50, 101, 1500)]
