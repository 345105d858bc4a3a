"""``dsv41::fp8_gemv`` against the other few-row routes of the dense FP8 weights, GPU time per call.

Each route runs 8 times in a row, on 8 copies of the weight (more bytes than the L2 holds), inside one CUDA graph;
the figure is the graph's replay time / 8 (median of ``do_bench``): kernels and the gaps between them, no host
launch cost, as in a captured decode step.  Routes: ``gemv`` (this op, its :func:`plan` and the variants below),
``scaled_mm`` (torch's row-wise FP8 ``_scaled_mm`` after torch's per-token quantisation: the stand-in for vLLM's
quantisation + CUTLASS where vLLM is absent), ``cutlass`` (vLLM's ``scaled_fp8_quant`` + ``cutlass_scaled_mm``, the
``w8a8`` default, when vLLM imports) and ``bf16`` (cuBLAS on the dequantised weight).  Relative error against the fp32
reference of each route's own arithmetic is printed for the gemv.

    python3 benchmarks/ops/bench_fp8_gemv.py [--rows 1 2 4]
"""

from __future__ import annotations

import argparse

import torch

from _common import HBM_BYTES_PER_S, open_gpu

SHAPES = [("wq_a+wkv", 1792, 5120, 1), ("wq_b", 32768, 1280, 1), ("wo_b", 5120, 8192, 1),
          ("shared w1+w3", 4608, 5120, 1), ("shared w2", 5120, 2304, 1), ("wo_a (8 groups)", 8192, 4096, 8)]
COPIES = 8


def graph_time(triton, fns) -> float:
    """µs per call of the calls ``fns`` (one per weight copy) replayed from one CUDA graph."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    ms = triton.testing.do_bench(g.replay, warmup=25, rep=200, return_mode="median")
    return ms * 1e3 / len(fns)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    args = ap.parse_args()
    triton = open_gpu("bench_fp8_gemv")
    if triton is None:
        return
    from vllm_dsv41 import formats
    from vllm_dsv41.ops import fp8_gemv as fv

    try:
        from vllm import _custom_ops as vops
    except Exception:  # the bare image: no vLLM
        vops = None
    print(f"cutlass column: {'vLLM ' if vops else 'absent (no vLLM)'}")
    rows = []
    for name, N, K, G in SHAPES:
        w8s = [torch.randn(N, K, device="cuda").mul(0.5).to(torch.float8_e4m3fn) for _ in range(COPIES)]
        ws = torch.rand(N, 1, device="cuda") * 1e-2 + 1e-3
        w16s = [(w.float() * ws).bfloat16() for w in w8s[:4]] * 2
        nbytes = N * K
        for M in args.rows:
            x = torch.randn(M, G * K, device="cuda").bfloat16()
            want = fv.fp8_gemv_ref(x.float(), w8s[0], ws, G)
            got = torch.ops.dsv41.fp8_gemv(x, w8s[0], ws, G).float()
            err = ((got - want).norm() / want.norm()).item()
            out = {"gemv": graph_time(triton, [lambda w=w: torch.ops.dsv41.fp8_gemv(x, w, ws, G) for w in w8s])}
            p = fv.plan(M, N, K, torch.cuda.get_device_properties(0).multi_processor_count, G)
            # session 31: the small shapes' fixed cost (ramp, split-K reduce, tail) is the question; narrow tiles with
            # wide K steps and no split (one program a row block, ~1 a SM) against the plan's split K
            # session 34: the weight block asked of L2 before the amax pass over x
            for label, cfg in (("gemv pf", {"PREFETCH": True}), ("gemv s=1", {"SPLIT_K": 1, "k_per_split": K}),
                               ("gemv st=6", {"num_stages": 6}), ("gemv n=128 w8", {"BLOCK_N": 128, "num_warps": 8}),
                               ("gemv 2x split", {"SPLIT_K": min(16, p["SPLIT_K"] * 2),
                                                  "k_per_split": K // min(16, p["SPLIT_K"] * 2)}),
                               ("gemv n=16 k=512 s=1", {"BLOCK_N": 16, "BLOCK_K": 512, "SPLIT_K": 1, "k_per_split": K}),
                               ("gemv n=32 k=256 s=1", {"BLOCK_N": 32, "BLOCK_K": 256, "SPLIT_K": 1, "k_per_split": K}),
                               ("gemv n=32 k=256 half split", {"BLOCK_N": 32, "BLOCK_K": 256,
                                                               "SPLIT_K": max(1, p["SPLIT_K"] // 2),
                                                               "k_per_split": K // max(1, p["SPLIT_K"] // 2)})):
                kps, bk = cfg.get("k_per_split", p["k_per_split"]), cfg.get("BLOCK_K", p["BLOCK_K"])
                if K % kps or kps % bk:
                    continue
                try:
                    out[label] = graph_time(triton, [lambda w=w, c=cfg: fv._fp8_gemv_triton(x, w, ws, G, config=c)
                                                     for w in w8s])
                except Exception as e:  # a variant that does not fit: say so, keep going
                    print(f"{name} M={M} {label}: {type(e).__name__}: {str(e)[:120]}")
            if G == 1:  # the pre-quantised variant (a fused norm's QuantRows): the codes made outside the graph
                qx, sx = formats.quant_fp8_tokens(x)
                out["gemv_q"] = graph_time(triton, [lambda w=w: torch.ops.dsv41.fp8_gemv_q(qx, sx, w, ws) for w in w8s])

                def scaled_mm(w):
                    q, s = formats.quant_fp8_tokens(x)
                    return torch._scaled_mm(q, w.t(), scale_a=s, scale_b=ws.t(), out_dtype=torch.bfloat16)
                try:
                    out["scaled_mm"] = graph_time(triton, [lambda w=w: scaled_mm(w) for w in w8s])
                except Exception as e:
                    print(f"{name} M={M} scaled_mm: {type(e).__name__}: {str(e)[:120]}")
                if vops is not None:
                    def cutlass(w):
                        q, s = vops.scaled_fp8_quant(x, use_per_token_if_dynamic=True)
                        return vops.cutlass_scaled_mm(q, w.t(), s, ws, torch.bfloat16)
                    out["cutlass"] = graph_time(triton, [lambda w=w: cutlass(w) for w in w8s])
                out["bf16"] = graph_time(triton, [lambda w=w: x @ w.t() for w in w16s])
            else:
                xg = x.view(M, G, K).transpose(0, 1)
                out["bf16"] = graph_time(triton, [lambda w=w: torch.bmm(xg, w.view(G, N // G, K).transpose(1, 2))
                                                  for w in w16s])
            line = "  ".join(f"{k} {v:7.1f}" for k, v in out.items())
            print(f"{name:16s} M={M}  plan {p['SPLIT_K']}x{p['BLOCK_N']}  err {err:.1e}  | {line}  | gemv "
                  f"{nbytes / (out['gemv'] * 1e-6) / 1e12:.2f} TB/s ({100 * nbytes / (out['gemv'] * 1e-6) / HBM_BYTES_PER_S:.0f}%)")
            rows.append((name, M, out))
    print("\nsummary (µs per call; sum over one batch-1 layer's shapes at M=1: gemv vs the best other route)")
    for M in args.rows:
        g = sum(o["gemv"] for n, m, o in rows if m == M)
        best = sum(min(v for k, v in o.items() if not k.startswith("gemv")) for n, m, o in rows if m == M)
        cut = sum(o.get("cutlass", o["bf16"]) for n, m, o in rows if m == M)  # the grouped wo_a has no cutlass
        bestg = sum(min(v for k, v in o.items() if k.startswith("gemv") and k != "gemv_q") for n, m, o in rows if m == M)
        print(f"M={M}: gemv plan {g:.1f}, best gemv variant {bestg:.1f}, best other {best:.1f}, the default routes "
              f"(cutlass where vLLM imports, the grouped wo_a on bf16) {cut:.1f}")


if __name__ == "__main__":
    main()
