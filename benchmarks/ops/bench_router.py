"""Microbenchmark of ``dsv41::router``: torch on the GPU versus the fused Triton router.

    python benchmarks/ops/bench_router.py            # all cases, then a small tiling sweep
    python benchmarks/ops/bench_router.py --no-sweep
    python benchmarks/ops/bench_router.py --no-sweep --x-dtype float32   # the model's fp32 x

Per case (T tokens, E experts, top-k, H = 5120) it prints the median time of
  ref      ``router_ref`` on the GPU: fp32 GEMM (the weight upcast each call) + sort-based top-k,
  torch    an idiomatic eager router: bf16 GEMM (bf16 logits), sqrt-softplus, ``torch.topk``, gather,
  triton   the fused kernel (``_router_triton``, default tiling, fused epilogue),
  unfused  the same GEMM with the epilogue as a second kernel,
and the speed-up of triton over ref and over torch, the bytes the op must move (x, weight, bias,
outputs) and the fraction of 4.8 TB/s (H200 HBM) that triton reaches.  Not collected by pytest.
"""

import argparse
import sys

import torch

from _common import HBM_BYTES_PER_S, graph_us, open_gpu
H = 5120
CASES = [(E, k, T) for E, k in ((384, 6), (32, 6), (128, 3)) for T in (1, 16, 64, 1024, 8192)]


X_DTYPE = torch.bfloat16  # --x-dtype


def make(T: int, E: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, H, device="cuda", generator=g).to(X_DTYPE)
    w = (torch.randn(E, H, device="cuda", generator=g) * H ** -0.5).bfloat16()
    b = torch.randn(E, device="cuda", generator=g) * 0.05
    return x, w, b


def torch_router(x, w, b, k, scaling):
    s = torch.sqrt(torch.nn.functional.softplus(torch.nn.functional.linear(x.to(w.dtype), w).float()))
    ids = torch.topk(s + b, k, dim=-1).indices
    wts = s.gather(-1, ids)
    return ids, wts / wts.sum(-1, keepdim=True) * scaling


def bench(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3  # microseconds


def run_cases() -> None:
    from vllm_dsv41.ops import router as r

    fp32_x = X_DTYPE == torch.float32
    print(f"{'case':<22}{'ref us':>10}{'torch us':>10}{'triton us':>11}{'unfused us':>12}"
          + (f"{'fma us':>9}" if fp32_x else "") + f"{'x ref':>8}{'x torch':>9}{'MB':>9}{'%HBM':>7}")
    for E, k, T in CASES:
        x, w, b = make(T, E)
        t_ref = bench(lambda: r.router_ref(x, w, b, k, 1.5))
        t_torch = bench(lambda: torch_router(x, w, b, k, 1.5))
        t_tri = bench(lambda: r._router_triton(x, w, b, k, 1.5))
        t_unf = bench(lambda: r._router_triton(x, w, b, k, 1.5, fuse_epilogue=False))
        # fp32 x: the three-part bf16 split (triton) against the IEEE FMA dot it replaced (fma)
        fma = f"{bench(lambda: r._router_triton(x, w, b, k, 1.5, split_x=False)):>9.1f}" if fp32_x else ""
        nbytes = T * H * x.element_size() + E * H * 2 + E * 4 + T * k * 8
        pct = nbytes / (t_tri * 1e-6) / HBM_BYTES_PER_S * 100
        print(f"{f'T{T} E{E} k{k}':<22}{t_ref:>10.1f}{t_torch:>10.1f}{t_tri:>11.1f}{t_unf:>12.1f}{fma}"
              f"{t_ref / t_tri:>8.1f}{t_torch / t_tri:>9.1f}{nbytes / 1e6:>9.2f}{pct:>7.1f}", flush=True)


def sweep() -> None:
    """Time a few tilings per T (E = 384) so the heuristics in ``_router_config`` can be tuned."""
    from vllm_dsv41.ops import router as r

    grids = {
        1: [dict(BLOCK_T=16, BLOCK_E=be, BLOCK_K=bk, SPLIT_K=sk, num_warps=4, num_stages=st)
            for be in (16, 32, 64) for sk in (5, 10, 20) for bk, st in ((128, 4), (256, 3))],
        64: [dict(BLOCK_T=bt, BLOCK_E=be, BLOCK_K=128, SPLIT_K=sk, num_warps=4, num_stages=4)
             for bt in (16, 64) for be in (32, 64) for sk in (2, 4, 8)],
        1024: [dict(BLOCK_T=bt, BLOCK_E=be, BLOCK_K=64, SPLIT_K=sk, num_warps=w, num_stages=4)
               for bt, be, w in ((64, 128, 8), (64, 64, 4), (128, 128, 8)) for sk in (1, 3, 6)],
        8192: [dict(BLOCK_T=bt, BLOCK_E=be, BLOCK_K=bk, SPLIT_K=1, num_warps=w, num_stages=st)
               for bt, be, w in ((64, 128, 8), (128, 128, 8), (128, 64, 4)) for bk, st in ((64, 4), (64, 3))],
    }
    print("\nsweep (E=384, k=6): best tilings per T")
    for T, configs in grids.items():
        x, w, b = make(T, 384)
        want = r.router_ref(x, w, b, 6, 1.5)[0]
        results = []
        for cfg in configs:
            try:
                ids, _ = r._router_triton(x, w, b, 6, 1.5, config=cfg)
                ok = (ids == want).all(1).float().mean().item()
                results.append((bench(lambda: r._router_triton(x, w, b, 6, 1.5, config=cfg)), ok, cfg))
            except Exception as exc:  # a tiling the compiler rejects (e.g. out of shared memory)
                print(f"  T{T} {cfg}: failed ({type(exc).__name__})")
        default = bench(lambda: r._router_triton(x, w, b, 6, 1.5))
        print(f"  T{T}: default {default:.1f} us")
        for t, ok, cfg in sorted(results, key=lambda v: v[0])[:3]:
            print(f"  T{T}: {t:.1f} us  rows-equal {ok:.4f}  {cfg}", flush=True)


def epilogues() -> None:
    """The top-k epilogue's two forms at decode sizes, graph-replayed: one reduction of (score, id, s) a round
    (``ONE_PASS``) against three (the default); the picks must agree."""
    from vllm_dsv41.ops import router as r

    print("\ntop-k epilogue, graph-replayed µs a call: one reduction a round / three reductions a round")
    for E, k in ((384, 6), (32, 6), (16, 6)):
        for T in (1, 4, 16):
            x, w, b = make(T, E)
            one = graph_us(lambda: r._router_triton(x, w, b, k, 1.5, config={"ONE_PASS": True}))
            three = graph_us(lambda: r._router_triton(x, w, b, k, 1.5, config={"ONE_PASS": False}))
            same = torch.equal(r._router_triton(x, w, b, k, 1.5, config={"ONE_PASS": True})[0],
                               r._router_triton(x, w, b, k, 1.5, config={"ONE_PASS": False})[0])
            print(f"  T{T} E{E} k{k}: {one:6.2f} / {three:6.2f} µs ({100 * (three - one) / three:+.1f}%), "
                  f"ids equal {same}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--x-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="x's dtype (float32: the model's mHC output, the three-part split)")
    args = parser.parse_args()
    global X_DTYPE
    X_DTYPE = getattr(torch, args.x_dtype)
    if open_gpu("bench_router") is None:
        return 0
    print(f"  H={H}  {args.x_dtype} x, bf16 weight, fp32 bias, routed scaling 1.5")
    epilogues()
    run_cases()
    if not args.no_sweep:
        sweep()
    return 0


if __name__ == "__main__":
    sys.exit(main())
