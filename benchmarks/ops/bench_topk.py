"""Microbenchmark of ``dsv41::topk_select`` and ``dsv41::candidate_blocks``: torch versus Triton.

    python benchmarks/ops/bench_topk.py            # all cases, then a small launch-config sweep
    python benchmarks/ops/bench_topk.py --no-sweep
    python benchmarks/ops/bench_topk.py --decode     # the batch-1 decode rows, every route, graph-replayed

Rows are fully visible (n_vis = N) Gaussian scores.  Per case it prints the median time of
  ref      the op's reference on the GPU (stable sort of the whole row: the exact tie rule),
  topk     ``torch.topk(sorted=False)`` (no tie guarantee; the usual fast torch baseline; topk only),
  triton   the Triton kernel,
and the speed-up of triton over both, the bytes the op must move (one read of the visible scores
plus the output) and the fraction of 4.8 TB/s (H200 HBM) that triton reaches.  Not collected by
pytest.
"""

import argparse
import sys

import torch

from _common import HBM_BYTES_PER_S, graph_us, open_gpu
TOPK, BLOCK_SIZE, N_BLOCKS = 512, 8, 2048
ROWS = (1, 64, 1024)
TOPK_N = (4096, 65536, 524288)
CAND_N = (65536, 524288)


def bench(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3  # microseconds


def make(T: int, N: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    scores = torch.randn(T, N, device="cuda", generator=g)
    return scores, torch.full((T,), N, dtype=torch.int32, device="cuda")


def line(name, t_ref, t_topk, t_tri, nbytes):
    pct = nbytes / (t_tri * 1e-6) / HBM_BYTES_PER_S * 100
    topk = f"{t_topk:>10.1f}" if t_topk is not None else f"{'-':>10}"
    x_topk = f"{t_topk / t_tri:>8.1f}" if t_topk is not None else f"{'-':>8}"
    print(f"{name:<30}{t_ref:>11.1f}{topk}{t_tri:>11.1f}{t_ref / t_tri:>8.1f}{x_topk}"
          f"{nbytes / 1e6:>10.2f}{pct:>7.1f}", flush=True)


def run_cases() -> None:
    from vllm_dsv41.ops import topk as m

    print(f"{'case':<30}{'ref us':>11}{'topk us':>10}{'triton us':>11}{'x ref':>8}{'x topk':>8}"
          f"{'MB':>10}{'%HBM':>7}")
    for T in ROWS:
        for N in TOPK_N:
            s, nv = make(T, N)
            t_ref = bench(lambda: m.topk_select_ref(s, nv, TOPK))
            t_topk = bench(lambda: torch.topk(s, TOPK, dim=-1, sorted=False))
            t_tri = bench(lambda: m._topk_select_triton(s, nv, TOPK))
            exact = torch.equal(m._topk_select_triton(s, nv, TOPK), m.topk_select_ref(s, nv, TOPK))
            line(f"topk T{T} N{N} k{TOPK}{'' if exact else ' MISMATCH'}", t_ref, t_topk, t_tri,
                 T * N * 4 + T * TOPK * 4)
            del s, nv
    for T in ROWS:
        for N in CAND_N:
            s, nv = make(T, N)
            t_ref = bench(lambda: m.candidate_blocks_ref(s, nv, BLOCK_SIZE, N_BLOCKS))
            t_tri = bench(lambda: m._candidate_blocks_triton(s, nv, BLOCK_SIZE, N_BLOCKS))
            exact = torch.equal(m._candidate_blocks_triton(s, nv, BLOCK_SIZE, N_BLOCKS),
                                m.candidate_blocks_ref(s, nv, BLOCK_SIZE, N_BLOCKS))
            line(f"cand T{T} N{N} {N_BLOCKS}x{BLOCK_SIZE}{'' if exact else ' MISMATCH'}", t_ref, None,
                 t_tri, T * N * 4 + T * N_BLOCKS * 4)
            del s, nv


def sweep() -> None:
    """Time a few launch configs on three cases so ``_select_config`` can be tuned."""
    from vllm_dsv41.ops import topk as m

    configs = [dict(BLOCK=b, num_warps=w, STAGES=st) for b, w in ((1024, 4), (2048, 8), (4096, 8))
               for st in (2, 3, 4)]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    configs += [dict(BLOCK=2048, num_warps=8, STAGES=3, CAND_BITS=8),
                dict(BLOCK=2048, num_warps=8, STAGES=3, PROGRAMS=sms)]
    print("\nsweep: best launch configs (topk_select, k=512)")
    for T, N in ((1, 524288), (64, 65536), (1024, 65536)):
        s, nv = make(T, N)
        want = m.topk_select_ref(s, nv, TOPK)
        results = []
        for cfg in configs:
            try:
                ok = torch.equal(m._topk_select_triton(s, nv, TOPK, config=cfg), want)
                results.append((bench(lambda: m._topk_select_triton(s, nv, TOPK, config=cfg)), ok, cfg))
            except Exception as exc:  # a config the compiler rejects
                print(f"  T{T} N{N} {cfg}: failed ({type(exc).__name__})")
        print(f"  T{T} N{N}: default {bench(lambda: m._topk_select_triton(s, nv, TOPK)):.1f} us")
        for t, ok, cfg in sorted(results, key=lambda v: v[0])[:3]:
            print(f"  T{T} N{N}: {t:.1f} us  exact {ok}  {cfg}", flush=True)
        del s, nv


def decode() -> None:
    """The batch-1 decode selections (top-512 of one row of 1-4k visible entries), graph-replayed, by route: the
    register route with 4-bit digits (the default) and 8-bit digits, its sort form (``REG_SORT``), the compaction
    path (``IN_REGS`` off) and ``torch.topk``; each checked against the reference."""
    from vllm_dsv41.ops import topk as m

    routes = {"regs 4-bit": {}, "regs 8-bit": {"REG_BITS": 8}, "regs sort": {"REG_SORT": True},
              "compaction": {"IN_REGS": False}}
    print("\ndecode rows (graph-replayed µs a call; n_vis = N):")
    for T in (1, 4):
        for N in (1024, 2048, 4096):
            s, nv = make(T, N)
            want = m.topk_select_ref(s, nv, TOPK)
            cols = []
            for name, cfg in routes.items():
                ok = torch.equal(m._topk_select_triton(s, nv, TOPK, config=cfg), want)
                us = graph_us(lambda cfg=cfg: m._topk_select_triton(s, nv, TOPK, config=cfg))
                cols.append(f"{name} {us:6.2f}{'' if ok else ' MISMATCH'}")
            cols.append(f"torch.topk {graph_us(lambda: torch.topk(s, TOPK, dim=-1, sorted=False)):6.2f}")
            print(f"  T{T} N{N}: " + "  ".join(cols), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--decode", action="store_true", help="only the batch-1 decode rows, every route")
    args = parser.parse_args()
    if open_gpu("bench_topk") is None:
        return 0
    if args.decode:
        decode()
        return 0
    print("  fp32 Gaussian scores, n_vis = N")
    run_cases()
    if not args.no_sweep:
        sweep()
    return 0


if __name__ == "__main__":
    sys.exit(main())
