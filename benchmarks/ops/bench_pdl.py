"""Programmatic dependent launch on a batch-1 decode layer's chain of our kernels, GPU time per layer.

A stand-in for the decode layer at the bench shapes (hidden 5120, 4 mHC streams, 32 MXFP4 experts, top-6), one
token, our ops only (no vLLM needed, so it runs on the bare image): the attention boundary's quantising collapse,
``[wq_a; wkv]`` and ``wq_b`` as GEMVs, the grouped ``wo_a`` and ``wo_b`` (the attention itself left out), the FFN
boundary's collapse, the shared expert (``w1 + w3``, ``swiglu_quant``, ``w2``), the router and ``moe_gemv``; ~15
launches a layer.  ``--layers`` layers of their own dense weights (more bytes than the L2 holds; the experts are
shared by two sets), all in one CUDA graph, replayed (median of ``do_bench``), under each setting:
``off`` (``VLLM_DSV41_PDL=0``), ``pdl`` (``=1``) and ``pdl+prefetch`` (with ``VLLM_DSV41_PDL_PREFETCH=1``).  Each
setting's outputs must equal the ``off`` run's bit for bit (PDL changes when kernels start, not what they compute).

    python3 benchmarks/ops/bench_pdl.py [--layers 16] [--per-op] [--settings off rows router1 ...]
"""

from __future__ import annotations

import argparse
import os
from unittest import mock

import torch

from _common import open_gpu

H, C, Q_LORA, KV, HEADS_OUT, GROUPS, O_LORA, I, E, K_SLOTS, LIMIT = 5120, 4, 1280, 512, 32768, 8, 8192, 2304, 32, 6, 10.0
SETTINGS = {"off": {"VLLM_DSV41_PDL": "0", "VLLM_DSV41_PDL_PREFETCH": "0"},
            "pdl": {"VLLM_DSV41_PDL": "1", "VLLM_DSV41_PDL_PREFETCH": "0"},
            "pdl+prefetch": {"VLLM_DSV41_PDL": "1", "VLLM_DSV41_PDL_PREFETCH": "1"},
            # session 32's latency changes on the same chain (not bitwise: the one-launch collapse sums x's squares
            # in another order, and everything after the first boundary follows x)
            "router1": {"VLLM_DSV41_PDL": "0", "VLLM_DSV41_ROUTER_ONE_PASS": "1"},
            "rows": {"VLLM_DSV41_PDL": "0", "VLLM_DSV41_MHC_COLLAPSE_ROWS": "16"},
            "rows+pdl": {"VLLM_DSV41_PDL": "1", "VLLM_DSV41_MHC_COLLAPSE_ROWS": "16"}}


def fp8_weight(n: int, k: int):
    w = torch.randn(n, k, device="cuda").mul(0.5).to(torch.float8_e4m3fn)
    return w, torch.rand(n, 1, device="cuda") * 2e-2 / k ** 0.5 + 1e-4


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--per-op", action="store_true", help="also each op alone: its layers' calls in one graph")
    ap.add_argument("--overlap", action="store_true",
                    help="only the chain as the model runs it at batch 1: the shared expert and mhc_coeffs on side "
                         "streams, captured on a stream of default or high priority, serial for comparison")
    ap.add_argument("--settings", nargs="+", default=["off", "pdl", "pdl+prefetch"], choices=list(SETTINGS),
                    help="the settings to time (off always first)")
    args = ap.parse_args()
    triton = open_gpu("bench_pdl")
    if triton is None:
        return
    from vllm_dsv41 import formats
    from vllm_dsv41.ops import fp8_gemv, l2_prefetch, mhc, moe_gemv, router, swiglu_quant  # noqa: F401  (the ops)
    from vllm_dsv41.reference.model import sinkhorn

    ops = torch.ops.dsv41
    layers = []
    for _ in range(args.layers):
        layers.append(dict(qa=fp8_weight(Q_LORA + KV, H), qb=fp8_weight(HEADS_OUT, Q_LORA),
                           oa=fp8_weight(O_LORA, HEADS_OUT // GROUPS), ob=fp8_weight(H, O_LORA),
                           w13=fp8_weight(2 * I, H), w2=fp8_weight(H, I),
                           gate=torch.randn(E, H, device="cuda").bfloat16() * H ** -0.5,
                           bias=torch.randn(E, device="cuda") * 0.1))
    experts = []
    for _ in range(2):
        w13, s13 = formats.quant_mxfp4(torch.randn(E, 2 * I, H, device="cuda") * 0.05)
        w2, s2 = formats.quant_mxfp4(torch.randn(E, H, I, device="cuda") * 0.05)
        experts.append((w13.view(torch.uint8), formats.as_uint8(s13), w2.view(torch.uint8), formats.as_uint8(s2)))
    g = torch.Generator().manual_seed(0)
    stream0 = torch.randn(1, C, H, generator=g).bfloat16().cuda()
    y0 = (torch.randn(1, H, generator=g) * 0.1).bfloat16().cuda()
    post = (2.0 * torch.sigmoid(torch.randn(1, C, generator=g))).cuda()
    comb = sinkhorn(torch.randn(1, C, C, generator=g) * 2.0, 1e-6, 20).cuda()
    pre = (torch.sigmoid(torch.randn(1, C, generator=g)) + 1e-6).cuda()
    norm_w = (torch.randn(H, generator=g) * 0.2 + 1.0).bfloat16().cuda()

    calls: dict[str, list] = {}  # op label -> (op, args) of every layer, recorded by an eager run for --per-op

    def call(label, op, *a):
        calls.setdefault(label, []).append((op, a))
        return op(*a)

    def chain():
        s, y, y2 = stream0, y0, None
        for li, p in enumerate(layers):
            s, x, q, qs = call("attn collapse_quant (+post-mix, y2)", ops.mhc_post_collapse_quant, s, y, post, comb,
                               pre, norm_w, 1e-6, y2)
            a = call("wq_a+wkv gemv_q", ops.fp8_gemv_q, q, qs, *p["qa"])
            b = call("wq_b gemv", ops.fp8_gemv, a[:, :Q_LORA].contiguous(), *p["qb"])
            o = call("wo_a gemv (8 groups)", ops.fp8_gemv, b, *p["oa"], GROUPS)
            y = call("wo_b gemv", ops.fp8_gemv, o, *p["ob"])
            s, x, q, qs = call("ffn collapse_quant (+post-mix)", ops.mhc_post_collapse_quant, s, y, post, comb, pre,
                               norm_w, 1e-6)
            h, hq, hs = call("swiglu_quant", ops.swiglu_quant, call("w1+w3 gemv_q", ops.fp8_gemv_q, q, qs, *p["w13"]),
                             LIMIT)
            y2 = call("w2 gemv_q", ops.fp8_gemv_q, hq, hs, *p["w2"])
            ids, wts = call("router", ops.router, x, p["gate"], p["bias"], K_SLOTS, 1.0)
            y = call("moe_gemv", ops.moe_gemv, x, *experts[li % 2], ids, wts, LIMIT)
        return s, y, y2

    if args.overlap:
        overlap(args, triton, layers, experts, stream0, y0, post, comb, pre, norm_w)
        return
    results, times = {}, {}
    for name in ["off", *(n for n in args.settings if n != "off")]:
        with mock.patch.dict(os.environ, SETTINGS[name]):
            results[name] = chain()  # compiles this setting's kernel variants outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = chain()
        graph.replay()
        torch.cuda.synchronize()
        same = all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(results["off"], out))
        ms = triton.testing.do_bench(graph.replay, warmup=10, rep=300, return_mode="median")
        times[name] = ms * 1e3 / len(layers)
        print(f"{name:13s} {times[name]:7.1f} µs a layer ({ms:.3f} ms for {len(layers)} layers); outputs bitwise "
              f"the eager off run's: {same}", flush=True)
    base = times["off"]
    for name, us in times.items():
        print(f"{name}: {us:.1f} µs a layer, {100 * (base - us) / base:+.1f}% against off")
    if args.per_op:  # PDL off: each op's calls over the layers (inputs of the recorded eager run) in one graph
        calls.clear()
        chain()
        nmix = (2 + C) * C  # the boundary's coefficients: the model computes them on a side stream
        fn = torch.randn(nmix, C * H, device="cuda") * (C * H) ** -0.5
        coeff_args = (stream0, fn, torch.randn(nmix, device="cuda") * 0.5, torch.tensor([0.8, 1.2, 3.0], device="cuda"),
                      1e-6, 1e-6, 20)
        calls["mhc_coeffs (a side stream in the model)"] = [(ops.mhc_coeffs, coeff_args)] * len(layers)
        def per_call(recorded) -> float:
            for op, a in recorded[:1]:
                op(*a)  # compiles this setting's variant outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for op, a in recorded:
                    op(*a)
            return triton.testing.do_bench(graph.replay, warmup=10, rep=200, return_mode="median") * 1e3 / len(recorded)

        total = 0.0
        # the ops that session 32 gave a second form: each also under that setting
        other = {"collapse": {"VLLM_DSV41_MHC_COLLAPSE_ROWS": "16"}, "router": {"VLLM_DSV41_ROUTER_ONE_PASS": "1"}}
        for label, recorded in calls.items():
            us = per_call(recorded)
            total += us if "side stream" not in label else 0.0
            alt = ""
            for key, env in other.items():
                if key in label:
                    with mock.patch.dict(os.environ, env):
                        alt = f"   ({' '.join(f'{k}={v}' for k, v in env.items())}: {per_call(recorded):6.1f})"
            print(f"  {label:36s} {us:6.1f} µs a call{alt}")
        print(f"  {'sum of the chain ops alone':36s} {total:6.1f} µs a layer (the chain: {base:.1f})")


def overlap(args, triton, layers, experts, stream0, y0, post, comb, pre, norm_w) -> None:
    """The layer chain with the model's side streams (``overlap.beside``: the shared expert on lane 0, the boundary's
    ``mhc_coeffs`` on lane 1), each setting captured on a stream of priority 0 or -1 (the side streams keep 0), and
    the same chain serial on one stream; µs a layer, outputs against the serial run.  The prefetch settings ask the L2
    for ``[wq_a; wkv]`` and the shared ``[w1; w3]`` on lane 2 beside the boundary collapse before each
    (``VLLM_DSV41_L2_PREFETCH=qkv_a,w13`` in the model); the chain has no attention, so ``wo_a``'s is not here."""
    ops = torch.ops.dsv41
    nmix = (2 + C) * C
    fn = torch.randn(nmix, C * H, device="cuda") * (C * H) ** -0.5
    cbase, cscale = torch.randn(nmix, device="cuda") * 0.5, torch.tensor([0.8, 1.2, 3.0], device="cuda")
    lanes = [torch.cuda.Stream(), torch.cuda.Stream()]

    def side(lane, work):
        """``work()`` on side stream ``lane`` after what the current stream has queued; -> (its result, its event)."""
        st = lanes[lane]
        st.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(st):
            out = work()
        return out, st

    lanes.append(torch.cuda.Stream())  # lane 2: the L2 prefetches (overlap.prefetching)

    def prefetched(weight, work, on: bool):
        """``work()``, with ``weight`` asked of the L2 on lane 2 beside it when ``on`` (joined after it)."""
        if not on:
            return work()
        out, st = side(2, lambda: ops.l2_prefetch(weight, 16, False))
        out = work()
        torch.cuda.current_stream().wait_stream(st)
        return out

    def chain(split: bool, prefetch: bool = False):
        s, y, y2 = stream0, y0, None
        for li, p in enumerate(layers):
            s, x, q, qs = prefetched(p["qa"][0], lambda s=s, y=y, y2=y2: ops.mhc_post_collapse_quant(
                s, y, post, comb, pre, norm_w, 1e-6, y2), prefetch)
            coeffs = lambda s=s: ops.mhc_coeffs(s, fn, cbase, cscale, 1e-6, 1e-6, 20)  # noqa: E731
            c1, st1 = side(1, coeffs) if split else (coeffs(), None)
            a = ops.fp8_gemv_q(q, qs, *p["qa"])
            b = ops.fp8_gemv(a[:, :Q_LORA].contiguous(), *p["qb"])
            y = ops.fp8_gemv(ops.fp8_gemv(b, *p["oa"], GROUPS), *p["ob"])
            if st1 is not None:
                torch.cuda.current_stream().wait_stream(st1)
            s, x, q, qs = prefetched(p["w13"][0], lambda s=s, y=y: ops.mhc_post_collapse_quant(
                s, y, post, comb, pre, norm_w, 1e-6), prefetch)
            shared = lambda q=q, qs=qs, p=p: ops.fp8_gemv_q(  # noqa: E731
                *ops.swiglu_quant(ops.fp8_gemv_q(q, qs, *p["w13"]), LIMIT)[1:], *p["w2"])
            coeffs = lambda s=s: ops.mhc_coeffs(s, fn, cbase, cscale, 1e-6, 1e-6, 20)  # noqa: E731
            (y2, st0), (c2, st1) = (side(0, shared), side(1, coeffs)) if split else ((shared(), None), (coeffs(), None))
            ids, wts = ops.router(x, p["gate"], p["bias"], K_SLOTS, 1.0)
            y = ops.moe_gemv(x, *experts[li % 2], ids, wts, LIMIT)
            for st in (st0, st1):
                if st is not None:
                    torch.cuda.current_stream().wait_stream(st)
        return s, y, y2

    want = None
    rows = {"VLLM_DSV41_MHC_COLLAPSE_ROWS": "16"}
    for label, split, prio, env, pf in (("serial", False, 0, {}, False), ("side streams", True, 0, {}, False),
                                        ("side streams, high-priority capture", True, -1, {}, False),
                                        ("side streams + one-launch collapse", True, 0, rows, False),
                                        ("side streams, high priority + one-launch collapse", True, -1, rows, False),
                                        ("side streams + L2 prefetch (qkv_a, w13)", True, 0, {}, True),
                                        ("side streams, high priority + L2 prefetch", True, -1, {}, True)):
        cap = torch.cuda.Stream(priority=prio)
        with mock.patch.dict(os.environ, env):
            cap.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(cap):  # eagerly on the capture stream first: its counters exist before capture
                out = chain(split, pf)
            torch.cuda.current_stream().wait_stream(cap)
            torch.cuda.synchronize()
            want = want if want is not None else out
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=cap):
                got = chain(split, pf)
        graph.replay()
        torch.cuda.synchronize()
        same = all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(want, got))
        ms = triton.testing.do_bench(graph.replay, warmup=10, rep=300, return_mode="median")
        print(f"  {label:50s} {ms * 1e3 / len(layers):7.1f} µs a layer (capture priority {cap.priority}); "
              f"outputs bitwise the serial eager run's: {same}", flush=True)


if __name__ == "__main__":
    main()
