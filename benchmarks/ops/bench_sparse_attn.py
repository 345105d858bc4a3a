"""Micro-benchmark of torch.ops.dsv41.sparse_attn: torch reference on the GPU vs the Triton kernel.

    python benchmarks/ops/bench_sparse_attn.py                 # decode T = 1, 8, 64, 256 + prefill 4096
    python benchmarks/ops/bench_sparse_attn.py --splits 1 2 4 8 --no-ref
    python benchmarks/ops/bench_sparse_attn.py --config 64 32 8 1   # pin BLOCK_H BLOCK_N warps stages
    python benchmarks/ops/bench_sparse_attn.py --combine            # decode T = 1, 4: the combine's chunk (graphs)

Real sizes: Hq=64, D=512, R=64, W=128 SWA keys (MXFP8, 528 B) + K=512 compressed keys (NVFP4, 288 B)
per row, bf16 q.  Decode rows belong to different requests (random distinct slots in large pools);
the prefill case is one request at positions [P, P+T): consecutive windows and 512 entries drawn
from each row's visible compressed entries.

MB per line = records the rows list (each row's own reads: 528 B per SWA key, 288 B per
compressed key, 4 B per slot) + q + out; % is that over 4.8 TB/s (H200 HBM3e).  "uniq MB" counts
each distinct record once: prefill rows share most records, so their DRAM traffic is near that.
Not collected by pytest; exits 0 with a message when there is no GPU.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from _common import HBM_BYTES_PER_S, graph_us, open_gpu

from vllm_dsv41 import formats  # noqa: E402  (the repository is on sys.path now)
from vllm_dsv41.ops import sparse_attn as sa  # noqa: E402
Hq, D, R, W, K = 64, 512, 64, 128, 512


def _inv_freq() -> torch.Tensor:
    return 1.0 / 10000.0 ** (torch.arange(0, R, 2, dtype=torch.float32) / R)


def _latents(n: int, g: torch.Generator) -> torch.Tensor:
    return torch.randn(n, D, generator=g, device="cuda") * torch.exp(0.7 * torch.randn(D, generator=g, device="cuda"))


def decode_case(T: int, seed: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(seed)
    swa_pool, comp_pool = max(160 * T, 4096), 65536
    swa_cache = formats.encode_mxfp8_record(_latents(swa_pool, g))
    comp_cache = formats.encode_nvfp4_record(_latents(comp_pool, g))
    swa_slots = torch.randperm(swa_pool, generator=g, device="cuda")[: T * W].view(T, W).int()
    comp_slots = torch.stack([torch.randperm(comp_pool, generator=g, device="cuda")[:K] for _ in range(T)]).int()
    pos = torch.randint(4096, 1_000_000, (T,), generator=g, device="cuda")
    return dict(q=(2.0 * torch.randn(T, Hq, D, generator=g, device="cuda")).bfloat16(), swa_cache=swa_cache,
                swa_slots=swa_slots, comp_cache=comp_cache, comp_slots=comp_slots,
                sink=torch.randn(Hq, generator=g, device="cuda"), scale=D ** -0.5, positions=pos,
                inv_freq=_inv_freq().to("cuda"))


def prefill_case(T: int, seed: int, start: int = 8192) -> dict:
    g = torch.Generator(device="cuda").manual_seed(seed)
    pos = torch.arange(start, start + T, device="cuda")
    end = start + T
    swa_cache = formats.encode_mxfp8_record(_latents(end, g))  # slot = position
    n_vis = (pos + 1) // 2  # ratio-2 compressed entries visible to each row
    N = int(n_vis.max())
    comp_cache = formats.encode_nvfp4_record(_latents(N, g))  # slot = entry index
    key = torch.rand(T, N, generator=g, device="cuda")
    key[torch.arange(N, device="cuda")[None, :] >= n_vis[:, None]] = 2.0  # invisible entries sort last
    comp_slots = key.argsort(1)[:, :K].int()
    swa_slots = (pos[:, None] - torch.arange(W, device="cuda")[None, :]).int()
    return dict(q=(2.0 * torch.randn(T, Hq, D, generator=g, device="cuda")).bfloat16(), swa_cache=swa_cache,
                swa_slots=swa_slots, comp_cache=comp_cache, comp_slots=comp_slots,
                sink=torch.randn(Hq, generator=g, device="cuda"), scale=D ** -0.5, positions=pos,
                inv_freq=_inv_freq().to("cuda"))


def _args(c: dict) -> tuple:
    return (c["q"], c["swa_cache"], c["swa_slots"], c["comp_cache"], c["comp_slots"], c["sink"], c["scale"],
            c["positions"], c["inv_freq"])


def moved_bytes(c: dict) -> tuple[int, int]:
    """(logical bytes: every row's own record reads + slot lists + q + out, the same with each distinct
    record counted once: a lower bound on DRAM traffic)."""
    sw, cs = c["swa_slots"], c["comp_slots"]
    rs, rc = formats.mxfp8_record_bytes(D), formats.nvfp4_record_bytes(D)
    other = 4 * (sw.numel() + cs.numel()) + 2 * c["q"].numel() * c["q"].element_size()
    logical = int((sw >= 0).sum()) * rs + int((cs >= 0).sum()) * rc + other
    unique = torch.unique(sw[sw >= 0]).numel() * rs + torch.unique(cs[cs >= 0]).numel() * rc + other
    return logical, unique


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decode", type=int, nargs="*", default=[1, 8, 64, 256], help="decode batch sizes T")
    ap.add_argument("--prefill", type=int, nargs="*", default=[4096], help="prefill lengths T (one request)")
    ap.add_argument("--splits", type=int, nargs="*", default=[0],
                    help="split-KV counts to time (0 = the default heuristic)")
    ap.add_argument("--config", type=int, nargs=4, metavar=("BLOCK_H", "BLOCK_N", "WARPS", "STAGES"),
                    help="pin one kernel config instead of autotuning")
    ap.add_argument("--bits", action="store_true", help="integer E4M3 decode instead of the hardware cvt")
    ap.add_argument("--no-ref", action="store_true", help="skip the torch reference timing")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--combine", action="store_true",
                    help="only: the op at decode T = 1 and 4 (default config and splits), graph-replayed, under each "
                         "VLLM_DSV41_COMBINE_CHUNK")
    a = ap.parse_args()
    if open_gpu("bench_sparse_attn", a.seed) is None:
        return 0
    if a.combine:
        return combine()
    from triton.testing import do_bench

    print(f"shapes: Hq={Hq} D={D} R={R} W={W} K={K}, q bf16")
    cfg = None
    if a.config:
        cfg = dict(BLOCK_H=a.config[0], BLOCK_N=a.config[1], num_warps=a.config[2], num_stages=a.config[3])
    else:
        os.environ[sa.AUTOTUNE_ENV] = "1"  # the benchmark reports the autotuner's winners
    print(f"config: {cfg or 'autotuned'}, e4m3 decode: {'integer' if a.bits else 'hardware cvt'}")
    hdr = (f"{'case':>14} {'splits':>6} {'ref us':>10} {'triton us':>10} {'speed-up':>8} {'MB':>8} {'uniq MB':>8} "
           f"{'% 4.8TB/s':>9}  tuned")
    print(hdr)
    cases = [(f"decode T={t}", decode_case(t, a.seed + t)) for t in a.decode]
    cases += [(f"prefill T={t}", prefill_case(t, a.seed + t)) for t in a.prefill]
    for name, c in cases:
        T = c["q"].shape[0]
        nbytes, ubytes = moved_bytes(c)
        ref_us = float("nan")
        if not a.no_ref:
            ref = sa.sparse_attn_ref(*_args(c))
            ref_us = 1e3 * do_bench(lambda: sa.sparse_attn_ref(*_args(c)), warmup=5, rep=30)
        for s in a.splits:
            n_split = s or None
            run = lambda: sa._sparse_attn_triton(*_args(c), num_splits=n_split, config=cfg,  # noqa: E731
                                                 hw_fp8=not a.bits)
            out = run()  # compiles / autotunes
            torch.cuda.synchronize()
            if not a.no_ref:
                err = ((out.float() - ref.float()).pow(2).mean().sqrt() / ref.float().pow(2).mean().sqrt()).item()
                if not err < 1e-2:
                    print(f"{name}: WRONG RESULT, relative rms error {err:.3e}")
                    return 1
            us = 1e3 * do_bench(run, warmup=25, rep=100)
            used = sa.plan_splits(T, Hq, W, K, c["q"].device, n_split)[2]
            tuned = "" if cfg else str(getattr(sa._sparse_attn_kernel_tuned, "best_config", ""))
            print(f"{name:>14} {used:>6} {ref_us:>10.1f} {us:>10.1f} {ref_us / us:>8.2f} {nbytes / 1e6:>8.2f} "
                  f"{ubytes / 1e6:>8.2f} {100 * nbytes / (us * 1e-6) / HBM_BYTES_PER_S:>8.1f}%  {tuned}")
    return 0


def combine() -> int:
    """The split-KV combine merging 1, 2, 4 or 8 splits a step (capped at 8 // BLOCK_H by the launcher): the whole
    op graph-replayed at batch-1 decode sizes (default config and split count), its output against chunk 1's."""
    print("combine chunk (VLLM_DSV41_COMBINE_CHUNK), µs a call of the op, graph-replayed:")
    for T in (1, 4):
        c = decode_case(T, 100 + T)
        S = sa.plan_splits(T, Hq, W, K, c["q"].device, None)[2]
        cols, base = [], None
        for chunk in ("1", "2", "4", "8"):
            os.environ[sa.COMBINE_CHUNK_ENV] = chunk
            out = sa._sparse_attn_triton(*_args(c))
            base = out if base is None else base
            err = ((out.float() - base.float()).abs().max()).item()
            cols.append(f"chunk {chunk} {graph_us(lambda: sa._sparse_attn_triton(*_args(c))):6.2f} (max |d| {err:.1e})")
        os.environ[sa.COMBINE_CHUNK_ENV] = "1"
        print(f"  T={T} splits={S}: " + "  ".join(cols), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
