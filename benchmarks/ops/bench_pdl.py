"""Programmatic dependent launch on a batch-1 decode layer's chain of our kernels, GPU time per layer.

A stand-in for the decode layer at the bench shapes (hidden 5120, 4 mHC streams, 32 MXFP4 experts, top-6), one
token, our ops only (no vLLM needed, so it runs on the bare image): the attention boundary's quantising collapse,
``[wq_a; wkv]`` and ``wq_b`` as GEMVs, the grouped ``wo_a`` and ``wo_b`` (the attention itself left out), the FFN
boundary's collapse, the shared expert (``w1 + w3``, ``swiglu_quant``, ``w2``), the router and ``moe_gemv``; ~15
launches a layer.  ``--layers`` layers of their own dense weights (more bytes than the L2 holds; the experts are
shared by two sets), all in one CUDA graph, replayed (median of ``do_bench``), under each setting:
``off`` (``VLLM_DSV41_PDL=0``), ``pdl`` (``=1``) and ``pdl+prefetch`` (with ``VLLM_DSV41_PDL_PREFETCH=1``).  Each
setting's outputs must equal the ``off`` run's bit for bit (PDL changes when kernels start, not what they compute).

    python3 benchmarks/ops/bench_pdl.py [--layers 16]
"""

from __future__ import annotations

import argparse
import os

import torch

from _common import open_gpu

H, C, Q_LORA, KV, HEADS_OUT, GROUPS, O_LORA, I, E, K_SLOTS, LIMIT = 5120, 4, 1280, 512, 32768, 8, 8192, 2304, 32, 6, 10.0
SETTINGS = {"off": {"VLLM_DSV41_PDL": "0", "VLLM_DSV41_PDL_PREFETCH": "0"},
            "pdl": {"VLLM_DSV41_PDL": "1", "VLLM_DSV41_PDL_PREFETCH": "0"},
            "pdl+prefetch": {"VLLM_DSV41_PDL": "1", "VLLM_DSV41_PDL_PREFETCH": "1"}}


def fp8_weight(n: int, k: int):
    w = torch.randn(n, k, device="cuda").mul(0.5).to(torch.float8_e4m3fn)
    return w, torch.rand(n, 1, device="cuda") * 2e-2 / k ** 0.5 + 1e-4


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    args = ap.parse_args()
    triton = open_gpu("bench_pdl")
    if triton is None:
        return
    from vllm_dsv41 import formats
    from vllm_dsv41.ops import fp8_gemv, mhc, moe_gemv, router, swiglu_quant  # noqa: F401  (define the ops)
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

    def chain():
        s, y, y2 = stream0, y0, None
        for li, p in enumerate(layers):
            s, x, q, qs = ops.mhc_post_collapse_quant(s, y, post, comb, pre, norm_w, 1e-6, y2)
            a = ops.fp8_gemv_q(q, qs, *p["qa"])
            b = ops.fp8_gemv(a[:, :Q_LORA].contiguous(), *p["qb"])
            o = ops.fp8_gemv(b, *p["oa"], GROUPS)
            y = ops.fp8_gemv(o, *p["ob"])
            s, x, q, qs = ops.mhc_post_collapse_quant(s, y, post, comb, pre, norm_w, 1e-6)
            h, hq, hs = ops.swiglu_quant(ops.fp8_gemv_q(q, qs, *p["w13"]), LIMIT)
            y2 = ops.fp8_gemv_q(hq, hs, *p["w2"])
            ids, wts = ops.router(x, p["gate"], p["bias"], K_SLOTS, 1.0)
            y = ops.moe_gemv(x, *experts[li % 2], ids, wts, LIMIT)
        return s, y, y2

    results, times = {}, {}
    saved = {k: os.environ.get(k) for k in SETTINGS["off"]}
    try:
        for name, env in SETTINGS.items():
            os.environ.update(env)
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
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    base = times["off"]
    for name, us in times.items():
        print(f"{name}: {us:.1f} µs a layer, {100 * (base - us) / base:+.1f}% against off")


if __name__ == "__main__":
    main()
