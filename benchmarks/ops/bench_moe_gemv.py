"""``dsv41::moe_gemv`` (the few-token MXFP4 experts) against the routed-expert paths the model has, GPU time per call.

The bench shapes (hidden 5120, intermediate 2304, 32 experts, top-6), random MXFP4 experts; each route runs 8 times
inside one CUDA graph on fresh routing per call (the figure is the replay time / 8, median of ``do_bench``).  Routes:
``gemv`` (this op at :func:`moe_gemv.plan` and the configs of ``VARIANTS``), ``ogs`` (``linear.ogs_moe``: vLLM's
routing data + two ``matmul_ogs``, the default decode path; needs vLLM) and ``mxfp4`` (``dsv41::moe_mxfp4``, swap-AB).
TB/s counts the bytes of the distinct experts each call reads (codes and scales).  Errors: relative to the fp32
reference of each route's own arithmetic (:func:`moe_gemv.moe_gemv_ref`, :func:`moe_mxfp4.moe_mxfp4_ref`).

    python3 benchmarks/ops/bench_moe_gemv.py [--rows 1 2 4]
"""

from __future__ import annotations

import argparse

import torch

from _common import HBM_BYTES_PER_S, open_gpu

H, I, E, K_SLOTS, LIMIT = 5120, 2304, 32, 6, 10.0
CALLS = 8
VARIANTS = [dict(UP_SPLIT_K=1), dict(UP_SPLIT_K=4), dict(UP_SPLIT_K=5), dict(UP_BLOCK_N=64, DOWN_BLOCK_N=64),
            dict(UP_BLOCK_N=64, DOWN_BLOCK_N=64, UP_SPLIT_K=4), dict(UP_G=4, DOWN_G=4, UP_SPLIT_K=4),
            dict(UP_G=16, DOWN_G=16, UP_BLOCK_N=64, DOWN_BLOCK_N=64), dict(UP_G=16, UP_BLOCK_N=64, UP_SPLIT_K=5),
            dict(num_stages=2), dict(num_stages=4), dict(num_warps=8)]


def graph_time(triton, fns) -> float:
    for f in fns:
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    return triton.testing.do_bench(g.replay, warmup=25, rep=200, return_mode="median") * 1e3 / len(fns)


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    args = ap.parse_args()
    triton = open_gpu("bench_moe_gemv")
    if triton is None:
        return
    from vllm_dsv41 import formats
    from vllm_dsv41.ops import moe_gemv as mg
    from vllm_dsv41.ops import moe_mxfp4 as mm

    w13, s13 = formats.quant_mxfp4(torch.randn(E, 2 * I, H, device="cuda") * 0.05)
    w2, s2 = formats.quant_mxfp4(torch.randn(E, H, I, device="cuda") * 0.05)
    w13, w2 = w13.view(torch.uint8), w2.view(torch.uint8)
    s13, s2 = formats.as_uint8(s13), formats.as_uint8(s2)
    per_expert = (w13[0].numel() + s13[0].numel() + w2[0].numel() + s2[0].numel())
    try:
        from vllm_dsv41.model_executor import linear

        linear._require_matmul_ogs()  # registers vLLM's vendored triton_kernels under that name
        from vllm.model_executor.layers.quantization.utils.mxfp4_utils import _swizzle_mxfp4, mx_scale_kwargs
        from triton_kernels.matmul_ogs import FlexCtx, PrecisionConfig

        a13, f13, b13 = _swizzle_mxfp4(w13.clone(), s13.clone())
        a2, f2, b2 = _swizzle_mxfp4(w2.clone(), s2.clone())
        ogs = (a13, a2, PrecisionConfig(**mx_scale_kwargs(b13), flex_ctx=FlexCtx(rhs_data=f13)),
               PrecisionConfig(**mx_scale_kwargs(b2), flex_ctx=FlexCtx(rhs_data=f2)))
    except Exception as e:  # the bare image: no vLLM, no triton_kernels
        print(f"ogs column absent: {type(e).__name__}: {e}")
        ogs = None
    print(f"moe_gemv plan: {mg.plan(H, I)}")
    print("| tokens | route | µs | TB/s | % of 4.8 | rel err vs own ref |")
    print("|---|---|---|---|---|---|")
    for T in args.rows:
        g = torch.Generator(device="cuda").manual_seed(T)
        xs = [torch.randn(T, H, device="cuda", generator=g).bfloat16() for _ in range(CALLS)]
        idxs = [torch.rand(T, E, device="cuda", generator=g).argsort(1)[:, :K_SLOTS].to(torch.int32)
                for _ in range(CALLS)]
        wtss = [torch.rand(T, K_SLOTS, device="cuda", generator=g) for _ in range(CALLS)]
        distinct = sum(int(i.unique().numel()) for i in idxs) / CALLS
        nbytes = distinct * per_expert
        want_g = mg.moe_gemv_ref(xs[0], w13, s13, w2, s2, idxs[0], wtss[0], LIMIT)
        want_m = mm.moe_mxfp4_ref(xs[0], w13, s13, w2, s2, idxs[0], wtss[0], LIMIT)

        def row(name, us, err):
            print(f"| {T} | {name} | {us:.1f} | {nbytes / us / 1e6:.2f} | {100 * nbytes / us / 1e6 / (HBM_BYTES_PER_S / 1e12):.0f}% "
                  f"| {err:.2e} |", flush=True)

        for cfg in [None] + VARIANTS:
            fns = [lambda x=x, i=i, w=w: mg._moe_gemv_triton(x, w13, s13, w2, s2, i, w, LIMIT, config=cfg)
                   for x, i, w in zip(xs, idxs, wtss)]
            try:
                us = graph_time(triton, fns)
                err = rel(mg._moe_gemv_triton(xs[0], w13, s13, w2, s2, idxs[0], wtss[0], LIMIT, config=cfg), want_g)
                row(f"gemv {cfg or 'plan'}", us, err)
            except Exception as e:
                print(f"| {T} | gemv {cfg} | failed: {type(e).__name__}: {str(e)[:120]} | | | |", flush=True)
        if ogs is not None:
            fns = [lambda x=x, i=i, w=w: linear.ogs_moe(x, ogs, i, w, LIMIT) for x, i, w in zip(xs, idxs, wtss)]
            row("ogs (routing + 2 matmul_ogs + act + sum)", graph_time(triton, fns),
                rel(linear.ogs_moe(xs[0], ogs, idxs[0], wtss[0], LIMIT), want_m))
        fns = [lambda x=x, i=i, w=w: torch.ops.dsv41.moe_mxfp4(x, w13, s13, w2, s2, i, w, LIMIT)
               for x, i, w in zip(xs, idxs, wtss)]
        row("moe_mxfp4 (swapab)", graph_time(triton, fns),
            rel(torch.ops.dsv41.moe_mxfp4(xs[0], w13, s13, w2, s2, idxs[0], wtss[0], LIMIT), want_m))


if __name__ == "__main__":
    main()
