"""Microbenchmark of ``compress_insert`` (vllm_dsv41/ops/compressor.py): PyTorch reference vs Triton, on CUDA.

    python benchmarks/ops/bench_compressor.py [--tokens 1 64 8192] [--no-sweep]

Real sizes (D=512, ID=128, R=64, bf16 wk, NVFP4 288-B and MXFP4 68-B records).  One line per
(ratio, T): median µs of the reference (torch on the GPU) and of the Triton kernel with
``triton.testing.do_bench`` (L2 flushed before every call), the speed-up, the bytes an ideal kernel
moves (the closing tokens' rows and partner rows, positions and slots, the weights, the written
records) and the achieved bandwidth against the H200's 4.8 TB/s.  The token positions are those of
one long request (ratio 2: every other token closes an entry).  Then a small sweep of launch
parameters at T=8192.  Never collected by pytest.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys

import torch

from _common import HBM_BYTES_PER_S, open_gpu
D, ID, R, EPS = 512, 128, 64, 1e-20
COMP_REC, IDX_REC = D // 2 + D // 16, ID // 2 + ID // 32


def make_inputs(T: int, ratio: int, device="cuda") -> tuple:
    rows = torch.randn(T, ratio * D, device=device)
    prev = torch.roll(rows, 1, 0) if ratio == 2 else None  # the partner of token t is token t-1
    pos = torch.arange(100_001, 100_001 + T, device=device)  # odd first position: T=1 closes an entry
    closing = (pos + 1) % ratio == 0
    n_ent = int(closing.sum())
    slot = torch.full((T,), -1, dtype=torch.int64, device=device)
    slot[closing] = torch.randperm(n_ent, device=device)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, R, 2, device=device, dtype=torch.float32) / R)
    return (rows, prev, pos, ratio, 1 + 0.1 * torch.randn(D, device=device),
            (torch.randn(ID, D, device=device) / D ** 0.5).to(torch.bfloat16), 1 + 0.1 * torch.randn(ID, device=device),
            EPS, inv_freq, slot, slot.clone(),
            torch.zeros(max(n_ent, 1), COMP_REC, dtype=torch.uint8, device=device),
            torch.zeros(max(n_ent, 1), IDX_REC, dtype=torch.uint8, device=device))


def ideal_bytes(T: int, ratio: int) -> int:
    n_ent = -(-T // ratio)
    rows = n_ent * ratio * D * 4 * (2 if ratio == 2 else 1)  # closing rows (+ partner rows)
    meta = T * 8 * 3
    weights = ID * D * 2 + D * 4 + ID * 4 + R // 2 * 4
    return rows + meta + weights + n_ent * (COMP_REC + IDX_REC)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 8192])
    parser.add_argument("--no-sweep", action="store_true", help="skip the launch-parameter sweep")
    args = parser.parse_args()
    triton = open_gpu("bench_compressor")
    if triton is None:
        return 0
    from triton.testing import do_bench

    from vllm_dsv41.ops import compressor as cp

    torch.manual_seed(0)
    print(f"D={D} ID={ID} R={R}, bf16 wk, fp32 rows; times are medians in µs")
    print(f"{'ratio':>5} {'T':>5} {'ref µs':>9} {'triton µs':>10} {'speed-up':>8} {'MB moved':>9} {'GB/s':>7} "
          f"{'% 4.8TB/s':>9}  bytes equal to ref (comp / idx)")
    for ratio, T in itertools.product((2, 1), args.tokens):
        a = make_inputs(T, ratio)
        ref_caches = (a[11].clone(), a[12].clone())
        cp.compress_insert_ref(*a[:11], *ref_caches)
        cp._compress_insert_triton(*a)
        torch.cuda.synchronize()
        eq = [(x == y).float().mean().item() for x, y in zip(ref_caches, a[11:])]
        t_ref = do_bench(functools.partial(cp.compress_insert_ref, *a), return_mode="median") * 1e3
        t_tri = do_bench(functools.partial(cp._compress_insert_triton, *a), return_mode="median") * 1e3
        nbytes = ideal_bytes(T, ratio)
        gbs = nbytes / (t_tri * 1e-6) / 1e9
        print(f"{ratio:>5} {T:>5} {t_ref:>9.1f} {t_tri:>10.1f} {t_ref / t_tri:>7.1f}x {nbytes / 1e6:>9.2f} "
              f"{gbs:>7.0f} {100 * gbs * 1e9 / HBM_BYTES_PER_S:>8.1f}%  {eq[0]:.4f} / {eq[1]:.4f}")
        del a, ref_caches
        torch.cuda.empty_cache()

    if args.no_sweep:
        return 0
    print("\nlaunch sweep at T=8192 (do_bench µs; default block_d 64, 8 warps):")
    for ratio in (2, 1):
        a = make_inputs(8192, ratio)
        for bd, nw in itertools.product((32, 64, 128), (4, 8)):
            fn = functools.partial(cp._compress_insert_triton, *a, block_d=bd, num_warps=nw)
            try:
                fn()
                us = do_bench(fn, return_mode="median") * 1e3
            except Exception as exc:  # e.g. out of shared memory
                print(f"  ratio {ratio} block_d {bd} warps {nw}: {type(exc).__name__}: {str(exc)[:80]}")
                continue
            print(f"  ratio {ratio} block_d {bd:>3} warps {nw}: {us:8.1f} µs")
        del a
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
