"""fzero_kernels' compiled path (not the interpreter).

- ``test_kernels_compile_for_sm90``: on any machine with triton, every kernel compiles for
  an H100 (sm_90) and its PTX is what the design assumes: IEEE division and square root
  (as torch), no FP contraction, 16-byte vector loads on aligned shards (the multi-tensor
  kernel too, its pointers read from its program table).
- ``test_cuda_kernels_match_reference``: on a machine with a CUDA GPU, the compiled kernels
  against the references run on the same GPU, and the multi-tensor AdamW against the
  per-tensor kernel bit for bit (skipped without one, as in CI).

Each runs in a subprocess: triton fixes interpreted-or-compiled at its first import, and
test_kernels.py imports it interpreted.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import fzero.testing as ft  # the one tolerance table

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed"),
]

_SCRIPT = textwrap.dedent("""
    import inspect, json, sys
    import torch
    import fzero_kernels as fk
    from fzero_kernels import _common
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        assert "nvidia" in triton.backends.backends
    except Exception as e:
        print(json.dumps({"skip": f"triton's NVIDIA backend is unavailable: {e!r}"})); sys.exit(0)

    launches = []
    def record(kernel, programs, *args, num_warps, **constexprs):
        _common.ensure_triton()
        if isinstance(kernel, _common._LazyKernel):
            kernel = kernel.fn.__globals__[kernel.fn.__name__]
        launches.append((kernel, args, num_warps, constexprs))
    _common.choose = lambda fn, device: "triton"  # record launches on CPU tensors, run nothing
    _common.launch = record

    n = 4096
    p, m, v = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    g16, lowp = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=2)
    fk.adamw_(p, g16, m, v, **hyper, grad_scale=torch.tensor(2.0), lowp_param=lowp, found_inf=torch.tensor(0.0),
              grad_sumsq=torch.tensor(4.0, dtype=torch.float64), max_norm=1.0)
    # Two separate tensors (aligned addresses and lengths, as the caching allocator gives):
    # the multi-tensor kernel, whose pointers come from its program table.
    ps, ms, vs = [[torch.zeros(k) for k in (n, 1024)] for _ in range(3)]
    fk.adamw_multi_(ps, [torch.zeros(k, dtype=torch.bfloat16) for k in (n, 1024)], ms, vs, **hyper,
                    grad_scale=torch.tensor(2.0), lowp_params=[torch.zeros(k, dtype=torch.bfloat16) for k in (n, 1024)],
                    found_inf=torch.tensor(0.0), grad_sumsq=torch.tensor(4.0, dtype=torch.float64), max_norm=1.0)
    fk.lamb_(p, torch.zeros(n), m, v, segments=(0, 1024, n), **hyper, lowp_param=lowp.half(),
             grad_sumsq=torch.tensor(4.0, dtype=torch.float64), max_norm=1.0)
    fk.lion_(p, g16, m, lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.1, lowp_param=lowp)
    fk.sgd_(p, g16, m, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.1, step=2)
    fk.unscale_and_check_(g16, 1024.0)
    fk.l2_norm(p)

    TY = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int16: "i16",
          torch.int64: "i64", torch.float64: "fp64"}
    report = {}
    for kernel, args, warps, constexprs in launches:
        names = list(inspect.signature(kernel.fn).parameters)
        sig, attrs = {}, {}
        for i, (name, a) in enumerate(zip(names, args)):
            if isinstance(a, torch.Tensor):
                sig[name] = "*" + TY[a.dtype]
                attrs[(i,)] = [["tt.divisibility", 16]]  # what a real launch specializes on
            elif isinstance(a, int):
                sig[name] = "i32"
                if a % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
            else:
                sig[name] = "fp32"
        sig.update({k: "constexpr" for k in constexprs})
        src = ASTSource(fn=kernel, signature=sig, constexprs=dict(constexprs), attrs=attrs)
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                             options={"num_warps": warps, "enable_fp_fusion": False}).asm["ptx"]
        report[kernel.fn.__name__] = {
            "approx_div": ("div.full.f32" in ptx) or ("div.approx.f32" in ptx),
            "approx_sqrt": "sqrt.approx" in ptx,
            "v4_loads": ptx.count("ld.global.v4"),
            "fma": ptx.count("fma.rn.f32"),
        }
    print(json.dumps(report))
""")


def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    if "skip" in report:
        pytest.skip(report["skip"])
    assert set(report) == {"_adam_kernel", "_adam_multi_kernel", "_lamb_norms_kernel", "_lamb_apply_kernel", "_lion_kernel",
                           "_sgd_kernel", "_unscale_kernel", "_sumsq_kernel"}, report
    for name, r in report.items():
        assert not r["approx_div"] and not r["approx_sqrt"], (name, r)  # IEEE, as torch
        assert r["v4_loads"] > 0, (name, r)  # aligned shards load 16 bytes per access
        assert r["fma"] == 0, (name, r)  # no contraction: rounds as the interpreter and torch


_CUDA_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    import fzero_kernels as fk
    TOL = json.loads(sys.argv[1])
    dev = torch.device("cuda")
    assert fk.backend_for(torch.empty(0, device=dev)) == "triton"
    fails, checked = [], [0]
    gen = torch.Generator(device=dev).manual_seed(0)

    def close(what, got, want, kind="state"):
        checked[0] += 1
        rtol, atol = TOL["kernel " + kind]
        try:
            torch.testing.assert_close(got, want, rtol=rtol, atol=atol, equal_nan=True)
        except AssertionError as e:
            fails.append(f"{what}: {str(e).splitlines()[0:3]}")

    def same_bits(what, a, b):
        checked[0] += 1
        ia = a.view(torch.int16 if a.element_size() == 2 else torch.int32)
        ib = b.view(torch.int16 if b.element_size() == 2 else torch.int32)
        if not torch.equal(ia, ib):
            fails.append(f"{what}: {(ia != ib).sum().item()} elements differ in bits")

    def flat(n, offset=0):  # offset 1: a shard that is not 16-byte aligned
        return torch.empty(n + offset, device=dev)[offset:]

    def state(n, k, offset):  # param, exp_avg (or momentum), exp_avg_sq
        values = [torch.randn(n, device=dev, generator=gen), torch.randn(n, device=dev, generator=gen) * 0.1,
                  torch.rand(n, device=dev, generator=gen) * 0.01][:k]
        out = [flat(n, offset) for _ in values]
        for t, val in zip(out, values):
            t.copy_(val)
        return out

    def both(what, kernel, ref, ts, lowp=None, **kw):
        a, b = [t.clone() for t in ts], [t.clone() for t in ts]
        la = lowp.clone() if lowp is not None else None
        lb = lowp.clone() if lowp is not None else None
        fa = kernel(*a, lowp_param=la, **kw)
        fb = ref(*b, lowp_param=lb, **kw)
        torch.cuda.synchronize()
        for i, (x, y) in enumerate(zip(a, b)):
            if x.dtype == torch.float32 and i != 1:
                close(f"{what} tensor {i}", x, y)
        if fa.item() != fb.item() or fa.shape != ():
            fails.append(f"{what}: flags {fa} vs {fb}")
        if la is not None:
            same_bits(f"{what} lowp", la, a[0].to(la.dtype))
        return a

    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
    # n = 1 and 1 << 22 (aligned, the big-block config) and 1000, 4097 (unaligned lengths)
    # are the specializations triton compiles; offset 1 makes the pointers unaligned too.
    for n in (1, 1000, 4097, 1 << 22):
        for offset in ((0, 1) if n == 4097 else (0,)):
            for gd in (torch.float32, torch.bfloat16, torch.float16):
                for scale in (1.0, 1024.0, torch.tensor(1024.0, device=dev)):
                    sv = float(scale)
                    g = (torch.randn(n, device=dev, generator=gen) * sv).to(gd)
                    lowp = torch.empty(n, device=dev, dtype=torch.float16 if gd == torch.float16 else torch.bfloat16)
                    what = f"n={n} offset={offset} grad={gd} scale={scale}"
                    p, m, v = state(n, 3, offset)
                    both("adamw_ " + what, fk.adamw_, fk.adamw_reference, [p, g, m, v], lowp, **hyper, step=3,
                         grad_scale=scale)
                    both("adam_ " + what, fk.adam_, fk.adam_reference, [p, g, m, v], lowp, **hyper, step=1,
                         grad_scale=scale)
                    segs = (0, n // 3, n // 3, n)
                    both("lamb_ " + what, fk.lamb_, fk.lamb_reference, [p, g, m, v], lowp, segments=segs, lr=1e-2,
                         beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01, step=2, grad_scale=scale)
                    both("lion_ " + what, fk.lion_, fk.lion_reference, [p, g, m], lowp, lr=1e-3, beta1=0.9,
                         beta2=0.99, weight_decay=0.01, grad_scale=scale)
                    both("sgd_ " + what, fk.sgd_, fk.sgd_reference, [p, g, m], lowp, lr=0.1, momentum=0.9,
                         nesterov=True, weight_decay=0.01, step=2, grad_scale=scale)
                    if gd != torch.float16 and not isinstance(scale, float):  # fused clip, one dtype pair
                        clip = dict(grad_scale=scale, grad_sumsq=fk.sum_of_squares(g, grad_scale=scale), max_norm=0.5)
                        both("adamw_ clip " + what, fk.adamw_, fk.adamw_reference, [p, g, m, v], lowp, **hyper,
                             step=3, **clip)
                        both("lion_ clip " + what, fk.lion_, fk.lion_reference, [p, g, m], lowp, lr=1e-3, beta1=0.9,
                             beta2=0.99, weight_decay=0.01, **clip)
                    close("l2_norm " + what, fk.l2_norm(g, grad_scale=scale), fk.l2_norm_reference(g, grad_scale=scale),
                          "norm")
                    close("segment_sum_of_squares " + what, fk.segment_sum_of_squares(g, segments=segs),
                          fk.segment_sum_of_squares_reference(g, segments=segs), "sumsq")
                    ga, gb = g.clone(), g.clone()
                    fk.unscale_and_check_(ga, scale)
                    fk.unscale_and_check_reference(gb, scale)
                    same_bits("unscale_and_check_ " + what, ga, gb)
        # non-finite gradient: flag set; found_inf = flag skips with every bit kept
        g = torch.randn(n, device=dev, generator=gen).to(torch.bfloat16)
        g[n // 2] = float("nan")
        p, m, v = state(n, 3, 0)
        lowp = torch.zeros(n, device=dev, dtype=torch.bfloat16)
        keep = [t.clone() for t in (p, m, v, lowp)]
        flag = fk.nonfinite_check(g)
        out = fk.adamw_(p, g, m, v, **hyper, step=2, lowp_param=lowp, found_inf=flag)
        out2 = fk.lamb_(p, g, m, v, segments=(0, n), lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6,
                        weight_decay=0.0, step=2, lowp_param=lowp, found_inf=flag)
        out3 = fk.lion_(p, g, m, lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.0, lowp_param=lowp, found_inf=flag)
        out4 = fk.sgd_(p, g, m, lr=0.1, momentum=0.9, step=2, lowp_param=lowp, found_inf=flag)
        if not (flag.item() == out.item() == out2.item() == out3.item() == out4.item() == 1.0):
            fails.append(f"n={n}: non-finite flags {flag} {out} {out2} {out3} {out4}")
        for t, k in zip((p, m, v, lowp), keep):
            same_bits(f"n={n} skipped step keeps state", t, k)
        if torch.isfinite(fk.l2_norm(g)).item():
            fails.append(f"n={n}: l2_norm of a nan gradient is finite")
        out5 = fk.adamw_(p, g, m, v, **hyper, step=2, lowp_param=lowp, grad_sumsq=fk.sum_of_squares(g), max_norm=1.0)
        if out5.item() != 1.0:
            fails.append(f"n={n}: clip with a nan sum of squares: flag {out5}")
        for t, k in zip((p, m, v, lowp), keep):
            same_bits(f"n={n} clip-skipped step keeps state", t, k)
    # The multi-tensor kernel: separate tensors (one past a program's chunk, one unaligned),
    # each bit for bit what the per-tensor kernel gives it; clip, tensor scale, skip.
    from fzero_kernels import adamw_multi
    for gd in (torch.float32, torch.bfloat16, torch.float16):
        for kw in (dict(grad_scale=1.0), dict(grad_scale=torch.tensor(1024.0, device=dev), max_norm=0.5),
                   dict(grad_scale=1.0, found_inf=torch.ones((), device=dev))):
            sizes, offsets = (1, 17, 1000, (1 << 16) + 4465, 4096), (0, 0, 0, 0, 1)
            ts = [state(n, 3, o) for n, o in zip(sizes, offsets)]
            gs = [(torch.randn(n, device=dev, generator=gen) * 1024).to(gd) for n in sizes]
            ls = [torch.zeros(n, device=dev, dtype=torch.float16 if gd == torch.float16 else torch.bfloat16)
                  for n in sizes]
            if "max_norm" in kw:
                kw = dict(kw, grad_sumsq=fk.sum_of_squares(gs, grad_scale=kw["grad_scale"]))
            a, b = [[t.clone() for t in x] for x in ts], [[t.clone() for t in x] for x in ts]
            la, lb = [t.clone() for t in ls], [t.clone() for t in ls]
            fa = fk.adamw_multi_([x[0] for x in a], gs, [x[1] for x in a], [x[2] for x in a], lowp_params=la,
                                 **hyper, step=3, **kw)
            fb = [fk.adamw_(x[0], g, x[1], x[2], lowp_param=lp, **hyper, step=3, **kw) for x, g, lp in zip(b, gs, lb)]
            torch.cuda.synchronize()
            what = f"adamw_multi_ grad={gd} {sorted(kw)}"
            for i, (x, y) in enumerate(zip(a, b)):
                for j, (u, w) in enumerate(zip([*x, la[i]], [*y, lb[i]])):
                    same_bits(f"{what} tensor {i} operand {j}", u, w)
            if fa.item() != max(f.item() for f in fb):
                fails.append(f"{what}: flag {fa} vs {fb}")
    if adamw_multi.BROKEN:
        fails.append(f"the multi-tensor kernel fell back to per-tensor launches: {adamw_multi.BROKEN}")
    print(json.dumps({"fails": fails[:20], "n_fails": len(fails), "checked": checked[0]}))
""")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (CI has none; run on a GPU machine)")
def test_cuda_kernels_match_reference():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    tol = {k: [row.rtol, row.atol] for k, row in ft.TOLERANCES.items()}
    proc = subprocess.run([sys.executable, "-c", _CUDA_SCRIPT, json.dumps(tol)], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["n_fails"] == 0, report
    assert report["checked"] > 900, report
