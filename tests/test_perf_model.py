"""``fzero.perf_model``'s arithmetic against hand-derived cases, ``fzero estimate --time`` on a
fixed machine, and the elementwise coefficients against a count of a real step's ops."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest

from fzero.cli.main import main
from fzero.perf_model import (ELEMENTWISE, PRESETS, Layout, Link, Machine, Workload, dp_collectives, gpt_workload,
                              load_machine, ring_seconds, save_machine, step_time)

ROOT = Path(__file__).resolve().parents[1]


def _workload(params=8000, layers=4, hidden=64, seq=128, flops=1e6, unit_params=None):
    return Workload(params=params, leaves=10, layers=layers, hidden=hidden, seq=seq, matmul_flops_per_token=flops,
                    elementwise_bytes_per_token=0.0, unit_params=params if unit_params is None else unit_params)


# A machine of round numbers: 1 TFLOP/s, 1 GB/s links without latency, nothing else costs.
ROUND = Machine(name="round", source="test", matmul_flops={"fp32": 1e12, "bf16": 2e12, "fp16": 2e12},
                peak_flops={"fp32": 1e12, "bf16": 2e12, "fp16": 2e12}, elementwise_bandwidth=1e30,
                optimizer_bandwidth=1e30, intra=Link(bandwidth=1e9, latency=0.0),
                inter=Link(bandwidth=1e8, latency=0.0), ranks_per_node=8, overlap=0.0)


def _sent(layout, **kw):
    return sum({"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_gather": n - 1}[kind] * payload
               for kind, payload, _ in dp_collectives(_workload(**kw), layout) for n in [layout.dp])


def test_zero2_at_8_ranks_sends_the_ring_volume_and_takes_its_time():
    # Ψ = 8000 fp32: reduce-scatter the 32,000 B gradient (7/8 of it sent), all-gather this
    # rank's 1000 parameters (7 × 4000 B): 2Ψ(N-1)/N × 4 B = 56,000 B.
    lay = Layout(world_size=8, stage=2, bucket_bytes=32000)
    assert dp_collectives(_workload(), lay) == [("reduce_scatter", 32000.0, "backward"), ("all_gather", 4000.0, "after")]
    assert _sent(lay) == pytest.approx(56000)
    t = step_time(_workload(), lay, ROUND, global_batch=8)
    assert t.sent_bytes["dp"] == pytest.approx(56000)
    assert t.comm == pytest.approx(56000 / 1e9)  # 1 GB/s, no latency: within a node of 8
    link = Link(bandwidth=1e9, latency=1e-5)
    assert ring_seconds("reduce_scatter", 32000, 8, link) == pytest.approx(28000 / 1e9 + 7e-5)
    assert ring_seconds("all_reduce", 32000, 8, link) == pytest.approx(56000 / 1e9 + 14e-5)


def test_stage3_sends_one_and_a_half_times_stage2():
    """Each block gathered twice (``max_reuse_distance=0``: no block kept), whatever the
    bucket; with the default window (25 MiB of parameters, more than this small model)
    every block stays gathered from its forward to its backward and stage 3 sends what stage
    2 does."""
    for n in (2, 4, 8):
        s2 = step_time(_workload(), Layout(world_size=n, stage=2), ROUND, global_batch=8).sent_bytes["dp"]
        s3 = [step_time(_workload(), Layout(world_size=n, stage=3, bucket_bytes=b, max_reuse_distance=0), ROUND,
                        global_batch=8).sent_bytes["dp"] for b in (4, None)]
        kept = [step_time(_workload(), Layout(world_size=n, stage=3, bucket_bytes=b), ROUND,
                          global_batch=8).sent_bytes["dp"] for b in (4, None)]
        assert s2 == pytest.approx(2 * 8000 * 4 * (n - 1) / n)
        assert s3 == pytest.approx([1.5 * s2] * 2)
        assert kept == pytest.approx([s2] * 2)


def test_stage3_gathers_blocks_in_runs_within_the_reuse_window():
    """Six blocks of 1000 fp32 parameters and a window of 3000: shard_state's units are two
    runs of three blocks (``_checks.unit_runs``, cut from the last block back, each within
    the window), the last of them kept from its forward to its backward. So at N = 2 the
    step gathers each run once for its forward (this rank's 1500 parameters, 6000 B each)
    and the first again for its backward, and reduce-scatters each run's 12,000 B
    gradient once, in backward's order: three all-gathers, not nine."""
    w = _workload(params=6000, layers=6, unit_params=6000)
    got = dp_collectives(w, Layout(world_size=2, stage=3, max_reuse_distance=3000))
    assert got == [("all_gather", 6000.0, "forward")] * 3 + [("reduce_scatter", 12000.0, "backward")] * 2
    # A window under one block: every block its own unit, none kept: twelve gathers of 2000 B.
    per_block = dp_collectives(w, Layout(world_size=2, stage=3, max_reuse_distance=999))
    assert per_block == [("all_gather", 2000.0, "forward")] * 12 + [("reduce_scatter", 4000.0, "backward")] * 6


def test_accumulation_reduces_once_at_stages_0_1_and_every_micro_batch_at_2_3():
    one = {s: _sent(Layout(world_size=4, stage=s)) for s in range(4)}
    four = {s: _sent(Layout(world_size=4, stage=s, micro_batches=4)) for s in range(4)}
    grad = 8000 * 4 * 3 / 4  # one reduce-scatter of the fp32 gradient
    assert four[0] == one[0] and four[1] == one[1]
    assert four[2] == pytest.approx(one[2] + 3 * grad)
    assert four[3] == pytest.approx(4 * one[3])  # units gathered twice and reduced, per micro-batch


def test_pipeline_bubble_at_p4_m8():
    w = _workload(flops=1e9)
    t = step_time(w, Layout(world_size=4, stage=0, pp=4, micro_batches=8), ROUND, global_batch=8)
    assert t.bubble == pytest.approx(t.compute * 3 / 8)
    assert t.bubble / (t.compute + t.bubble) == pytest.approx(3 / 11)  # (p-1)/(m+p-1)


def test_tensor_parallel_sends_megatrons_four_all_reduces_per_block():
    # 2 blocks, tp = 2, one micro-batch of 8 × 128 = 1024 tokens of width 64 in fp32: an
    # all-reduce of 1024·64·4 = 262,144 B sends 2(T-1)/T of it = 262,144 B; 4 per block.
    t = step_time(_workload(layers=2), Layout(world_size=2, stage=0, tp=2), ROUND, global_batch=8)
    assert t.sent_bytes["tp"] == pytest.approx(4 * 2 * 262144)
    assert t.exposed_comm == pytest.approx(t.comm)  # on the critical path, none hidden
    assert t.comm == pytest.approx(8 * 262144 / 1e9)


def test_more_ranks_less_compute_per_rank_and_more_tokens_per_second():
    w = gpt_workload(layers=24, hidden=2048, seq=2048)
    worlds = (8, 64, 256, 1024)
    strong = [step_time(w, Layout(world_size=n, stage=2, precision="bf16"), PRESETS["h100"], global_batch=1024)
              for n in worlds]
    assert all(a.compute > b.compute for a, b in zip(strong, strong[1:]))
    # weak scaling (8 sequences per rank): more ranks, more tokens per second
    weak = [step_time(w, Layout(world_size=n, stage=2, precision="bf16"), PRESETS["h100"], global_batch=8 * n)
            for n in worlds]
    assert all(a.tokens_per_s < b.tokens_per_s for a, b in zip(weak, weak[1:]))
    assert all(0 < t.mfu < 1 for t in strong + weak)


def test_overlap_hides_gradient_reduction_behind_backward():
    w = _workload(flops=1e9)
    lay = Layout(world_size=2, stage=0, bucket_bytes=4000)
    none = step_time(w, lay, ROUND, global_batch=8)
    full = step_time(w, lay, dataclasses.replace(ROUND, overlap=1.0), global_batch=8)
    assert none.exposed_comm == pytest.approx(none.comm)
    assert full.exposed_comm == pytest.approx(none.comm / 8)  # the last of 8 buckets is never hidden
    assert full.total < none.total


def test_shared_cores_slow_every_rate():
    w = _workload(flops=1e9)
    quiet = step_time(w, Layout(world_size=4, stage=0), dataclasses.replace(ROUND, cores=4), global_batch=8)
    shared = step_time(w, Layout(world_size=4, stage=0), dataclasses.replace(ROUND, cores=2), global_batch=8)
    assert shared.compute == pytest.approx(2 * quiet.compute)
    assert shared.comm == pytest.approx(2 * quiet.comm)


def test_attention_runs_at_the_machines_attention_rate_and_the_rest_at_the_dense_one():
    """1e9 FLOPs per token of which 2.5e8 attention's, 8 sequences of 128 tokens on one rank at
    1 TFLOP/s dense: 1024 × 7.5e8 / 1e12 s plus, at an attention rate of 0.25 TFLOP/s, 1024 ×
    2.5e8 / 2.5e11 s; a machine without one (the datasheet presets) runs it all at the dense rate,
    and tensor parallelism splits attention's share as the rest."""
    w = dataclasses.replace(_workload(flops=1e9), attention_flops_per_token=2.5e8)
    slow = dataclasses.replace(ROUND, attention_flops={"fp32": 2.5e11})
    one = Layout(world_size=1, stage=0)
    assert step_time(w, one, slow, global_batch=8).compute == pytest.approx(1024 * (7.5e8 / 1e12 + 2.5e8 / 2.5e11))
    assert step_time(w, one, ROUND, global_batch=8).compute == pytest.approx(1024 * 1e9 / 1e12)
    tp2 = Layout(world_size=2, stage=0, tp=2)
    assert step_time(w, tp2, slow, global_batch=8).compute == pytest.approx(
        step_time(w, one, slow, global_batch=8).compute / 2)
    g = gpt_workload(layers=4, hidden=256, seq=128, vocab=256)
    assert g.attention_flops_per_token == 12 * 4 * 128 * 256  # Kaplan's 12·L·s·d, inside the 6Ψ + 12·L·s·d
    assert g.matmul_flops_per_token == 6 * g.params + g.attention_flops_per_token
    with pytest.raises(ValueError, match="attention_flops_per_token=2000000000.0 must lie between 0 and "
                                         "matmul_flops_per_token=1000000000.0"):
        dataclasses.replace(w, attention_flops_per_token=2e9)


def test_measured_collective_costs_replace_the_rings_by_kind():
    # Gloo-like: a reduce-scatter that costs what an all-reduce of the same tensor does (half
    # the ring's bandwidth for the bytes it sends) and 1 ms per step for a collective alone.
    w = _workload()
    lay = Layout(world_size=2, stage=2, bucket_bytes=32000)
    ring = step_time(w, lay, ROUND, global_batch=8)
    gloo = dataclasses.replace(ROUND, collectives={"reduce_scatter": {"bandwidth": 0.5e9, "latency": 0.0}},
                               serial_latency=1e-3)
    measured = step_time(w, lay, gloo, global_batch=8)
    # the 16,000 B the reduce-scatter sends take 32 µs, not 16; the all-gather is the ring's
    assert measured.comm - ring.comm == pytest.approx(16000 / 0.5e9 - 16000 / 1e9)
    assert measured.sent_bytes == ring.sent_bytes  # what is sent does not change
    # the serial latency is tensor parallelism's (one all-reduce at a time), not ZeRO's buckets
    tp = Layout(world_size=2, stage=0, tp=2)
    assert step_time(_workload(layers=2), tp, gloo, global_batch=8).comm == pytest.approx(
        step_time(_workload(layers=2), tp, ROUND, global_batch=8).comm + 8 * 2 * 1e-3)


def test_a_group_of_two_takes_the_pairs_costs_and_a_larger_group_the_collectives():
    # fzero's collectives on a gloo pair are exchanges (fzero/distributed/_pair.py), measured
    # apart: a reduce-scatter at 2 GB/s over two ranks, where gloo's own takes 0.5 GB/s.
    w = _workload()
    m = dataclasses.replace(ROUND, collectives={"reduce_scatter": {"bandwidth": 0.5e9, "latency": 0.0}},
                            pair_collectives={"reduce_scatter": {"bandwidth": 2e9, "latency": 0.0}})
    ring = dataclasses.replace(ROUND, collectives={"reduce_scatter": {"bandwidth": 1e9, "latency": 0.0}})
    two, four = Layout(world_size=2, stage=2, bucket_bytes=32000), Layout(world_size=4, stage=2, bucket_bytes=32000)
    # 2 ranks: the 16,000 B the reduce-scatter sends take 8 µs at the pair's 2 GB/s, not 16 at 1 GB/s
    assert step_time(w, two, m, global_batch=8).comm - step_time(w, two, ring, global_batch=8).comm == \
        pytest.approx(16000 / 2e9 - 16000 / 1e9)
    # 4 ranks: gloo's 0.5 GB/s for the 24,000 B it sends
    assert step_time(w, four, m, global_batch=8).comm - step_time(w, four, ring, global_batch=8).comm == \
        pytest.approx(24000 / 0.5e9 - 24000 / 1e9)


def test_a_data_parallel_reduction_pays_its_measured_cost_per_gradient_byte():
    # 1 ns per byte of the fp32 gradient (Ψ = 8000: 32,000 B), once per reduction: stages
    # 0-1 reduce once per update, 2-3 every micro-batch; a world of one reduces nothing.
    m = dataclasses.replace(ROUND, reduce_byte_overhead=1e-9)
    w = _workload()
    for stage, k, reductions in ((0, 4, 1), (1, 4, 1), (2, 4, 4), (3, 1, 1)):
        lay = Layout(world_size=4, stage=stage, micro_batches=k)
        plain, paid = step_time(w, lay, ROUND, global_batch=16), step_time(w, lay, m, global_batch=16)
        assert paid.exposed_comm - plain.exposed_comm == pytest.approx(reductions * 32000e-9)
        assert paid.total - plain.total == pytest.approx(reductions * 32000e-9)
    alone = Layout(world_size=1, stage=2)
    assert step_time(w, alone, m, global_batch=8).total == step_time(w, alone, ROUND, global_batch=8).total
    # under tp a rank reduces its tp share of the gradient
    tp = Layout(world_size=4, stage=0, tp=2)
    assert (step_time(w, tp, m, global_batch=8).total - step_time(w, tp, ROUND, global_batch=8).total
            == pytest.approx(16000e-9))


def test_layout_errors_name_the_argument():
    with pytest.raises(ValueError, match="stage"):
        Layout(world_size=2, stage=4)
    with pytest.raises(ValueError, match="world_size=6 is not a multiple of tp=4"):
        Layout(world_size=6, stage=0, tp=4)
    with pytest.raises(ValueError, match="global_batch=3"):
        step_time(_workload(), Layout(world_size=2, stage=0), ROUND, global_batch=3)


def test_machine_round_trips_through_json(tmp_path):
    path = tmp_path / "m.json"
    save_machine(ROUND, str(path), loadavg=1.0)
    assert load_machine(str(path)) == ROUND
    data = json.loads(path.read_text())
    data["bogus"] = 1
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="unknown field.*bogus"):
        load_machine(str(path))
    measured = dataclasses.replace(ROUND, collectives={"all_gather": {"bandwidth": 2e9, "latency": 1e-4}})
    save_machine(measured, str(path))
    assert load_machine(str(path)) == measured
    data = json.loads(path.read_text())
    data["collectives"] = {"all_gather": {"bandwidth": 2e9}, "broadcast": {"bandwidth": 1.0, "latency": 0.0}}
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="collectives: all_gather, broadcast"):
        load_machine(str(path))
    data["collectives"], data["pair_collectives"] = {}, {"all_to_all": {"bandwidth": 1.0, "latency": 0.0}}
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="pair_collectives: all_to_all"):
        load_machine(str(path))


def test_estimate_time_prints_the_hand_derived_step(tmp_path, capsys):
    path = tmp_path / "round.json"
    save_machine(ROUND, str(path))
    # Ψ = 1M given, 2 layers × 64, seq 128: 6Ψ + 12·L·s·d = 6,196,608 FLOPs per token; 8 × 128
    # tokens on one rank at 1 TFLOP/s = 6.345 ms. On 2 ranks at stage 0 half of that, plus the
    # all-reduce of 4 MB fp32 gradients (sends 4 MB at 1 GB/s, none hidden): 3.173 + 4 ms.
    argv = ["estimate", "--params", "1M", "--stage", "0", "--time", "--machine", str(path), "--layers", "2",
            "--hidden", "64", "--seq", "128", "--vocab", "256", "--batch", "8"]
    assert main([*argv, "--world-size", "1"]) == 0
    row = capsys.readouterr().out.splitlines()[-6].split()
    assert row[0] == "0" and float(row[7]) == pytest.approx(6.345e-3, rel=1e-3)
    assert main([*argv, "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    row = out.splitlines()[-6].split()
    assert float(row[3]) == pytest.approx(4e-3, rel=1e-3) and float(row[7]) == pytest.approx(7.173e-3, rel=1e-3)
    assert "step time on round (test)" in out


def test_estimate_without_time_prints_no_step_time(capsys):
    assert main(["estimate", "--params", "1.3B", "--world-size", "8", "--stage", "2"]) == 0
    assert "step time" not in capsys.readouterr().out


def test_estimate_time_default_shape_is_gpt3s(capsys):
    assert main(["estimate", "--params", "6.7B", "--world-size", "64", "--stage", "3", "--precision", "bf16",
                 "--time", "--machine", "h200", "--batch", "512"]) == 0
    assert "32 layers × 4096 wide (GPT-3 6.7B's shape)" in capsys.readouterr().out


def test_elementwise_coefficients_match_a_count_of_a_real_step():
    """The reference: the bytes of every non-matmul op a CPU step of examples/gpt.py dispatches,
    per token (batch 2 minus batch 1), against gpt_workload's coefficients."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    sys.path.insert(0, str(ROOT / "examples"))
    from gpt import GPT, GPTConfig

    matmuls = {"mm", "addmm", "bmm", "baddbmm"}
    views = {"view", "t", "transpose", "expand", "_unsafe_view", "detach", "split", "alias", "unsqueeze", "squeeze",
             "permute", "slice", "select", "as_strided", "unbind"}

    class Bytes(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func._schema.name.split("::")[-1] not in matmuls | views:
                self.total += sum(t.numel() * t.element_size() for t in tree_leaves((args, kwargs, out))
                                  if isinstance(t, torch.Tensor))
            return out

    def count(cfg, batch):
        torch.manual_seed(0)
        model = GPT(cfg)
        idx = torch.zeros(batch, cfg.block_size, dtype=torch.long)
        with Bytes() as mode:
            out = model(idx)
            torch.nn.functional.cross_entropy(out.flatten(0, 1), idx.flatten()).backward()
        return mode.total

    for d, layers, vocab, seq in [(64, 1, 256, 32), (128, 2, 512, 64)]:
        cfg = GPTConfig(n_layer=layers, n_head=4, n_embd=d, vocab_size=vocab, block_size=seq)
        per_token = (count(cfg, 2) - count(cfg, 1)) / seq
        w = gpt_workload(layers=layers, hidden=d, seq=seq, vocab=vocab)
        assert w.elementwise_bytes_per_token == pytest.approx(per_token, rel=0.01), (d, layers, vocab, seq)
    assert sum(ELEMENTWISE[k] for k in ("block_split", "block_replicated")) == 69


def test_free_cores_come_from_a_steps_mix_on_both_ranks_at_once():
    """The calibration's cores for 2 ranks: 2 × (one rank alone / both at once) of the MLP
    blocks' pass when it was measured -- the median of paired measurements' ratios where the
    calibration took pairs, else the ratio of the medians -- else of the matmul; never more
    than the host's cores nor less than a quarter."""
    from fzero.perf_calibrate import free_cores

    coll = {"matmul_flops_2_ranks_at_once": 9e10, "block_pass_alone_s": 0.010, "block_pass_2_ranks_at_once_s": 0.016}
    assert free_cores(coll, 1e11, 2) == pytest.approx(1.25)
    assert free_cores({"matmul_flops_2_ranks_at_once": 9e10}, 1e11, 2) == pytest.approx(1.8)
    assert free_cores({**coll, "block_pass_2_ranks_at_once_s": 0.009}, 1e11, 2) == 2.0
    assert free_cores({**coll, "block_pass_2_ranks_at_once_s": 1.0}, 1e11, 2) == 0.25
    assert free_cores({**coll, "block_pass_alone_over_at_once": 0.9}, 1e11, 2) == pytest.approx(1.8)  # the pairs win


def test_the_achieved_matmul_rate_comes_from_a_steps_mix():
    """The calibration's achieved matmul rate: the MLP blocks' pass FLOPs (torch's flop
    counter, here against the dense count 3 · 2 · rows · (2 · d · h) per block, forward and
    backward) over its time less its elementwise bytes at the elementwise bandwidth; never
    above the lone matmul's peak."""
    from fzero.perf_calibrate import block_pass_work, mix_matmul_flops

    flops, nbytes = block_pass_work()
    rows, d, h, blocks = 1024, 256, 1024, 2
    assert flops == 3 * 2 * rows * (2 * d * h) * blocks
    assert nbytes == 4 * blocks * rows * (5 * d + 5 * h)
    assert mix_matmul_flops(0.05, 1e10, 1e12, (4e9, 1e8)) == pytest.approx(4e9 / 0.04)
    assert mix_matmul_flops(0.05, 1e10, 5e10, (4e9, 1e8)) == 5e10  # capped at the peak
    assert mix_matmul_flops(0.005, 1e10, 5e10, (4e9, 1e8)) == 5e10  # elementwise alone over the time: the peak


def test_the_reductions_cost_is_a_two_rank_step_less_its_modelled_parts():
    """The calibration's cost per gradient byte of a data-parallel step: the 2-rank step less
    the one-rank step and the all-reduce at the pair's cost, per byte; on shared cores every
    part at the rank's share, the result at a whole core's rate; never negative."""
    from fzero.perf_calibrate import reduce_overhead

    link = Link(bandwidth=1e9, latency=1e-4)
    # 8 MB all-reduced by 2 ranks: 8 ms + 2 steps × 0.1 ms; 30 ms alone; 48.2 ms on 2 ranks
    assert reduce_overhead(0.0482, 0.030, 8e6, link, 2.0) == pytest.approx(0.010 / 8e6)
    # a rank gets half a core: the parts take 60 + 16.2 ms, the 100 ms step leaves 23.8 ms
    assert reduce_overhead(0.100, 0.030, 8e6, link, 1.0) == pytest.approx(0.0238 * 0.5 / 8e6)
    assert reduce_overhead(0.030, 0.030, 8e6, link, 2.0) == 0.0


def test_a_tensor_parallel_all_reduce_pays_its_measured_overhead():
    # 2 layers: 8 all-reduces per micro-batch (4 per block), each 1 ms more; on shared cores
    # (2 cores, 4 ranks) each at half a core's rate: 2 ms more.
    w = _workload(layers=2)
    m = dataclasses.replace(ROUND, tp_overhead=1e-3)
    tp = Layout(world_size=2, stage=0, tp=2)
    assert step_time(w, tp, m, global_batch=8).comm - step_time(w, tp, ROUND, global_batch=8).comm == \
        pytest.approx(8e-3)
    shared = Layout(world_size=4, stage=0, tp=2)
    assert (step_time(w, shared, dataclasses.replace(m, cores=2), global_batch=8).comm
            - step_time(w, shared, dataclasses.replace(ROUND, cores=2), global_batch=8).comm) == pytest.approx(16e-3)
    assert step_time(w, Layout(world_size=2, stage=0), m, global_batch=8).total == \
        step_time(w, Layout(world_size=2, stage=0), ROUND, global_batch=8).total  # no tp: nothing


def test_the_tp_overhead_is_a_tp_step_less_its_modelled_parts_per_all_reduce():
    """The calibration's cost per tensor-parallel all-reduce: the 2-rank tp step of the MLP
    blocks less a rank's matmuls, elementwise bytes, optimizer pass, host and 4 all-reduces,
    over the 4; never negative."""
    from fzero.perf_calibrate import tp_overhead, tp_work

    flops, split, replicated = tp_work()
    assert flops == 3 * 2 * 1024 * (2 * 256 * 1024) * 2 / 2  # half the blocks' FLOPs per rank
    assert (split, replicated) == (4 * 2 * 1024 * 5 * 1024 / 2, 4 * 2 * 1024 * 5 * 256)
    free = dict(mix=1e11, elementwise=1e10, optimizer=1e10, step=1e-3, leaf=1e-5, serial_latency=1e-4,
                pair_all_reduce=Link(bandwidth=1e9, latency=1e-5))
    params = 2 * (2 * 256 + (256 * 1024 + 1024) // 2 + 1024 * 256 // 2 + 256)
    parts = (flops / 1e11 + (split + replicated) / 1e10 + params * 28 / 1e10 + 1e-3 + 12 * 1e-5
             + 4 * (1024 * 256 * 4 / 1e9 + 2 * 1e-4))
    assert tp_overhead(parts + 0.008, free=2.0, **free) == pytest.approx(0.002)
    assert tp_overhead(parts / 2, free=2.0, **free) == 0.0
