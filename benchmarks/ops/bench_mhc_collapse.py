"""The decode boundary's collapse in two launches (pre kernel + normalising epilogue) against one
(``_mhc_collapse_rows_kernel``, ``VLLM_DSV41_MHC_COLLAPSE_ROWS``), GPU time per call.

For the two ops the model calls at decode sizes, ``mhc_collapse_quant`` (attention boundary, no post-mix) and
``mhc_post_collapse_quant`` with the MoE's two parts (the FFN post-mix folded in), C=4, H=5120, bf16 streams: each
route's calls on 16 different inputs replayed from one CUDA graph (the inputs stay in L2, as a boundary's stream does
in a decode step: its producer wrote it just before), median of ``do_bench``, µs a call.  The one-launch route is
checked against the two-launch one: the stream bitwise, x, codes and scales to the last bit of x's sum of squares.

    python3 benchmarks/ops/bench_mhc_collapse.py [--tokens 1 2 4 16]
"""

from __future__ import annotations

import argparse

import torch

from _common import graph_us, open_gpu

C, H, EPS, CALLS = 4, 5120, 1e-6, 16
ROWS = [None, dict(block_h=1024, programs=5, num_warps=4), dict(block_h=1024, programs=5, num_warps=8),
        dict(block_h=512, programs=10, num_warps=4), dict(block_h=2048, programs=3, num_warps=8),
        dict(block_h=1024, programs=1, num_warps=8), dict(block_h=2048, programs=1, num_warps=16),
        dict(block_h=8192, programs=1, num_warps=16), dict(block_h=256, programs=20, num_warps=2)]


def inputs(T: int, seed: int) -> dict:
    from vllm_dsv41.reference.model import sinkhorn

    g = torch.Generator().manual_seed(seed)
    t = dict(stream=torch.randn(T, C, H, generator=g).bfloat16(), y=(torch.randn(T, H, generator=g) * 0.1).bfloat16(),
             y2=(torch.randn(T, H, generator=g) * 0.1).bfloat16(),
             post=2.0 * torch.sigmoid(torch.randn(T, C, generator=g)),
             comb=sinkhorn(torch.randn(T, C, C, generator=g) * 2.0, 1e-6, 20),
             pre=torch.sigmoid(torch.randn(T, C, generator=g)) + 1e-6,
             w=(torch.randn(H, generator=g) * 0.2 + 1.0).bfloat16())
    return {k: v.cuda() for k, v in t.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 16])
    args = ap.parse_args()
    if open_gpu("bench_mhc_collapse") is None:
        return
    from vllm_dsv41.ops import mhc

    ops = {"collapse_quant": lambda t, cfg: mhc._mhc_collapse_quant_triton(t["stream"], t["pre"], t["w"], EPS, cfg),
           "post_collapse_quant+y2": lambda t, cfg: mhc._mhc_post_collapse_quant_triton(
               t["stream"], t["y"], t["post"], t["comb"], t["pre"], t["w"], EPS, t["y2"], cfg)}
    for T in args.tokens:
        sets = [inputs(T, s) for s in range(CALLS)]
        for name, op in ops.items():
            base = None
            for cfg in ROWS:
                config = {"rows": False} if cfg is None else {"rows": True, **cfg}
                outs = op(sets[0], config)
                us = graph_us(lambda config=config: [op(t, config) for t in sets], calls=1) / CALLS
                if base is None:
                    base, check = (us, outs), "the two-launch route"
                else:
                    x0, x1 = base[1][-3].float(), outs[-3].float()
                    stream_same = len(outs) == 3 or torch.equal(base[1][0], outs[0])
                    check = (f"stream bitwise {stream_same}, x max rel diff {((x1 - x0).abs().max() / x0.abs().max()):.1e}"
                             f", scales equal {torch.equal(base[1][-1], outs[-1])}, "
                             f"{100 * (base[0] - us) / base[0]:+.1f}% time")
                label = "two launches" if cfg is None else " ".join(f"{k}={v}" for k, v in cfg.items())
                print(f"T={T} {name:22s} {label:34s} {us:6.2f} µs  ({check})", flush=True)


if __name__ == "__main__":
    main()
