"""Microbenchmark of ``index_scores`` (vllm_dsv41/ops/indexer.py): PyTorch reference vs Triton, on CUDA.

    python benchmarks/ops/bench_indexer.py [--rows 1 64] [--keys 4096 65536 524288] [--no-sweep]

Real sizes (IH=32 heads, ID=128, 68-byte MXFP4 records, 64 records per cache block).  One line per
(rows T, layout, visible entries N, q dtype): median µs of the reference (torch on the GPU: decode
to fp32 + einsum, chunked) and of the Triton kernel with ``triton.testing.do_bench`` (L2 flushed
before every call), the speed-up, the bytes an ideal kernel moves (each request's records read
once, q and w read once, the [T, N] fp32 scores written once) and the achieved bandwidth against
the H200's 4.8 TB/s.  Layouts for T > 1: "1req" = all rows of one request (a prefill chunk or a
speculative window: keys shared through L2), "Treq" = one row per request (batched decode: every
row streams its own N records).  Then a small sweep of launch parameters (decode path, tile size,
tiles per program, warps) at two shapes.  Never collected by pytest.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys

import torch

from _common import HBM_BYTES_PER_S, open_gpu
IH, ID, RPB = 32, 128, 64
REC = ID // 2 + ID // 32


def make_inputs(T: int, N: int, n_req: int, q_dtype: torch.dtype, device="cuda") -> tuple:
    """Every row sees all N entries of its request; blocks are shuffled through the cache."""
    blocks = -(-N // RPB)
    perm = torch.randperm(n_req * blocks, device=device).to(torch.int32)
    table = perm.view(n_req, blocks)
    keys_scale = torch.exp2(torch.randint(-4, 5, (n_req * blocks * RPB, ID // 32), device=device).float())
    from vllm_dsv41 import formats
    cache = torch.empty(n_req * blocks * RPB, REC, dtype=torch.uint8, device=device)
    step = 1 << 20
    for s in range(0, cache.shape[0], step):  # encode in slices (bounded fp32 temporaries)
        e = min(cache.shape[0], s + step)
        cache[s:e] = formats.encode_mxfp4_record(
            torch.randn(e - s, ID, device=device) * keys_scale[s:e].repeat_interleave(32, 1))
    q = torch.randn(T, IH, ID, device=device).to(q_dtype)
    w = torch.randn(T, IH, device=device) / 64
    req = (torch.arange(T, device=device) % n_req).to(torch.int32)
    n_vis = torch.full((T,), N, dtype=torch.int32, device=device)
    return q, w, cache, table, RPB, req, n_vis, N


def ideal_bytes(T: int, N: int, n_req: int, q_bytes: int) -> int:
    return n_req * N * REC + T * IH * ID * q_bytes + T * IH * 4 + T * N * 4 + T * 8


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--keys", type=int, nargs="+", default=[4096, 65536, 524288])
    parser.add_argument("--no-sweep", action="store_true", help="skip the launch-parameter sweep")
    args = parser.parse_args()
    triton = open_gpu("bench_indexer")
    if triton is None:
        return 0
    from triton.testing import do_bench

    from vllm_dsv41.ops import indexer as ix

    torch.manual_seed(0)
    print(f"IH={IH} ID={ID} record={REC} B, {RPB} records per block; times are medians in µs")
    print(f"{'T':>3} {'layout':>6} {'N':>7} {'q':>4} {'ref µs':>10} {'triton µs':>10} {'speed-up':>8} "
          f"{'MB moved':>9} {'GB/s':>7} {'% 4.8TB/s':>9}  max rel err")
    for T, N in itertools.product(args.rows, args.keys):
        for layout in (("1req",) if T == 1 else ("1req", "Treq")):
            n_req = 1 if layout == "1req" else T
            for q_dtype in (torch.float32, torch.bfloat16):
                a = make_inputs(T, N, n_req, q_dtype)
                tri = functools.partial(ix._index_scores_triton, *a)
                ref = functools.partial(ix.index_scores_ref, *a)
                got, want = tri(), ref()
                torch.cuda.synchronize()
                err = ((got - want).abs().max() / want.abs().max()).item()
                t_tri = do_bench(tri, return_mode="median") * 1e3
                t_ref = do_bench(ref, return_mode="median", rep=200) * 1e3
                nbytes = ideal_bytes(T, N, n_req, a[0].element_size())
                gbs = nbytes / (t_tri * 1e-6) / 1e9
                print(f"{T:>3} {layout:>6} {N:>7} {str(q_dtype)[6:10]:>4} {t_ref:>10.1f} {t_tri:>10.1f} "
                      f"{t_ref / t_tri:>7.1f}x {nbytes / 1e6:>9.2f} {gbs:>7.0f} "
                      f"{100 * gbs * 1e9 / HBM_BYTES_PER_S:>8.1f}%  {err:.1e}")
                del a, tri, ref, got, want
                torch.cuda.empty_cache()

    if args.no_sweep:
        return 0
    print("\nlaunch sweep (do_bench µs; default: asm decode, block_n 128, tiles auto, 4 warps):")
    for T, N, n_req in ((1, 524288, 1), (64, 65536, 64)):
        a = make_inputs(T, N, n_req, torch.float32)
        nbytes = ideal_bytes(T, N, n_req, 4)
        results = []
        for decode, bn, tiles, nw in itertools.product(("asm", "portable"), (64, 128), (None, 1, 4), (4, 8)):
            fn = functools.partial(ix._index_scores_triton, *a, decode=decode, block_n=bn, tiles=tiles,
                                   num_warps=nw)
            cfg = fn.keywords
            try:
                fn()
                us = do_bench(fn, return_mode="median") * 1e3
            except Exception as exc:  # e.g. out of registers / shared memory
                print(f"  T={T} N={N} {cfg}: {type(exc).__name__}: {str(exc)[:80]}")
                continue
            results.append((us, cfg))
        for us, cfg in sorted(results, key=lambda r: r[0])[:6]:
            print(f"  T={T:>2} N={N:>6} reqs={n_req:>2} {us:8.1f} µs "
                  f"({100 * nbytes / (us * 1e-6) / HBM_BYTES_PER_S:5.1f}% of 4.8 TB/s) {cfg}")
        del a
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
