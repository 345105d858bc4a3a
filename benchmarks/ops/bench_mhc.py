"""Microbenchmark of the mHC ops (vllm_dsv41/ops/mhc.py): PyTorch reference vs Triton, on CUDA.

    python benchmarks/ops/bench_mhc.py [--tokens 1 16 64 512 8192] [--sweep-tokens 1 8192]

For C=4, H=5120 and a bf16 stream, one line per (op, T): median µs of the reference (torch on the
GPU) and of the Triton path with ``triton.testing.do_bench`` (L2 flushed before every call, as in a
real layer whose fn was evicted), the speed-up, the Triton path replayed back-to-back from a CUDA graph
(no launch cost, but fn and small streams stay in L2), the bytes an ideal kernel moves (every input
read once, every output written once; the kernels' scratch, h and the partials, is not counted) and
the achieved bandwidth (from the do_bench time) against the H200's 4.8 TB/s.  Then a sweep of
``_mhc_pre_kernel`` launch parameters for ``mhc_pre`` and ``mhc_post_pre`` at a few T (the three
fastest each; ``--sweep-tokens`` with no value skips it), to tune ``_pre_config``.  Never collected
by pytest.
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch

from _common import HBM_BYTES_PER_S, open_gpu
C, H, EPS, HC_EPS, ITERS = 4, 5120, 1e-20, 1e-6, 20


def make_inputs(T: int, dtype=torch.bfloat16, device="cuda") -> dict[str, torch.Tensor]:
    nmix = (2 + C) * C
    comb = torch.softmax(torch.randn(T, C, C, device=device) * 2, -1)
    return dict(
        stream=torch.randn(T, C, H, device=device).to(dtype),
        fn=torch.randn(nmix, C * H, device=device) * (C * H) ** -0.5,
        base=torch.randn(nmix, device=device) * 0.5,
        scale=torch.tensor([0.8, 1.2, 3.0], device=device),
        pre_prev=torch.sigmoid(torch.randn(T, C, device=device)),
        norm_w=(1 + 0.2 * torch.randn(H, device=device)).to(dtype),
        y=torch.randn(T, H, device=device).to(dtype),
        post_prev=2 * torch.sigmoid(torch.randn(T, C, device=device)),
        comb_prev=comb / comb.sum(1, keepdim=True),
    )


def op_args(op: str, t: dict) -> tuple:
    pre = (t["fn"], t["base"], t["scale"], t["pre_prev"], t["norm_w"], EPS, HC_EPS, ITERS)
    post = (t["stream"], t["y"], t["post_prev"], t["comb_prev"])
    return {"pre": (t["stream"], *pre), "post": post, "post_pre": (*post, *pre)}[op]


def ideal_bytes(op: str, T: int, es: int) -> int:
    """Every input read once and every output written once (fp32 coefficients, ``es``-byte stream)."""
    nmix = (2 + C) * C
    stream, row, w = T * C * H * es, T * H * es, H * es
    pre_io = nmix * C * H * 4 + nmix * 4 + 3 * 4 + w + T * C * 4 + T * (2 * C + C * C) * 4
    post_in = T * C * 4 + T * C * C * 4
    return {"pre": stream + row + pre_io,
            "post": 2 * stream + row + post_in,
            "post_pre": 2 * stream + row + post_in + row + pre_io}[op]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 512, 8192])
    parser.add_argument("--sweep-tokens", type=int, nargs="*", default=[1, 8192],
                        help="token counts of the _mhc_pre_kernel launch-parameter sweep (none: skip it)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="the stream's dtype (the model keeps its streams in float32)")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    triton = open_gpu("bench_mhc")
    if triton is None:
        return 0
    from triton.testing import do_bench, do_bench_cudagraph

    from vllm_dsv41.ops import mhc
    from vllm_dsv41.ops._triton import sm_count

    print(f"C={C} H={H} stream {args.dtype}, eps={EPS} hc_eps={HC_EPS} iters={ITERS}; times are medians in µs")
    refs = {"pre": mhc.mhc_pre_ref, "post": mhc.mhc_post_ref, "post_pre": mhc.mhc_post_pre_ref}
    tris = {"pre": mhc._mhc_pre_triton, "post": mhc._mhc_post_triton, "post_pre": mhc._mhc_post_pre_triton}

    print(f"{'op':>9} {'T':>5} {'ref µs':>9} {'triton µs':>10} {'speed-up':>8} {'graph µs':>9} "
          f"{'MB moved':>9} {'GB/s':>7} {'% 4.8TB/s':>9}")
    for op in ("pre", "post", "post_pre"):
        for T in args.tokens:
            torch.manual_seed(0)
            a = op_args(op, make_inputs(T, dtype))
            ref, tri = (lambda: refs[op](*a)), (lambda: tris[op](*a))
            tri(), ref()  # compile + warm up
            torch.cuda.synchronize()
            t_ref = do_bench(ref, return_mode="median") * 1e3
            t_tri = do_bench(tri, return_mode="median") * 1e3
            t_graph = do_bench_cudagraph(tri, return_mode="median") * 1e3
            nbytes = ideal_bytes(op, T, dtype.itemsize)
            gbs = nbytes / (t_tri * 1e-6) / 1e9
            print(f"{op:>9} {T:>5} {t_ref:>9.1f} {t_tri:>10.1f} {t_ref / t_tri:>7.1f}x {t_graph:>9.1f} "
                  f"{nbytes / 1e6:>9.2f} {gbs:>7.0f} {100 * gbs * 1e9 / HBM_BYTES_PER_S:>8.1f}%")
            del a
            torch.cuda.empty_cache()
    print("(GB/s and % use the do_bench time, which starts from a flushed L2 like a real layer does; the graph "
          "column replays back-to-back, with fn and small streams still in L2.)")

    if not args.sweep_tokens:
        return 0
    print("\n_mhc_pre_kernel launch sweep (do_bench µs; default = _pre_config):")
    n_sms = sm_count(torch.device("cuda"))
    for op, T in itertools.product(("pre", "post_pre"), args.sweep_tokens):
        torch.manual_seed(0)
        a = op_args(op, make_inputs(T, dtype))
        fuse = op == "post_pre"
        default = mhc._pre_config(T, H, fuse, torch.device("cuda"))
        bt = default["block_t"]
        tiles = [(bt, bh, nw, st) for bh in ((16, 32) if fuse else (32, 64)) for nw in (4, 8) for st in (1, 2)]
        tiles += [(2 * bt, 16 if fuse else 32, 8, 2)] if bt == 64 else [(bt // 2 if bt > 16 else 32, 32, 4, 2)]
        results = []
        for (bt_, bh, nw, st), sm in itertools.product(tiles, (0.5, 1, 2)):
            split = max(1, min(round(sm * 2 * n_sms / -(-T // bt_)), -(-H // bh)))
            cfg = dict(block_t=bt_, block_h=bh, num_warps=nw, num_stages=st, split=split)
            try:
                tris[op](*a, config=cfg)
                us = do_bench(lambda: tris[op](*a, config=cfg), return_mode="median") * 1e3
            except Exception as exc:  # e.g. out of shared memory for this tile
                print(f"  {op} T={T} {cfg}: {type(exc).__name__}")
                continue
            results.append((us, cfg))
        t_def = do_bench(lambda: tris[op](*a), return_mode="median") * 1e3
        print(f"  {op:>8} T={T:>5} default {t_def:7.1f} µs {default}")
        for us, cfg in sorted(results, key=lambda r: r[0])[:3]:
            print(f"  {op:>8} T={T:>5}    best {us:7.1f} µs {cfg}")
        del a
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
