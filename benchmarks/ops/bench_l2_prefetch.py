"""Does an L2 prefetch of the next GEMV's weight, issued beside a latency-bound phase, make that GEMV faster?

The batch-1 decode layer's shape: a phase that keeps the HBM nearly idle (here ``--phase-calls`` router launches on
one token, a stand-in for the attention after ``wq_b``; or the mHC boundary's quantising collapse with its post-mix,
which comes before ``[wq_a; wkv]`` and the shared expert's ``[w1; w3]``), then a dense FP8 GEMV (``dsv41::fp8_gemv``)
on a weight that was last read a layer ago (8 copies in turn, more bytes than the L2 holds).  Each line is one CUDA
graph of 8 such (phase, GEMV) pairs, replayed (median of ``do_bench``), µs a pair:

* ``gemv cold`` / ``gemv hot``: the GEMV alone on the 8 copies / 8 times on one copy (the L2-resident bound);
* ``phase``: the phase alone; ``phase + gemv``: the pair on one stream;
* ``+ prefetch P[/el][ f]``: the same pair with ``dsv41::l2_prefetch`` of the weight (``P`` programs; ``el``: with
  the evict-last hint; ``f``: only the weight's first fraction ``f``) forked onto a side stream as the phase starts,
  joined before the GEMV.  Its gain is ``phase + gemv`` minus this line; the outputs must stay bitwise the same.

Last, the routed experts at one token (``dsv41::moe_gemv``, 32 MXFP4 experts, top-6, two expert sets in turn):
alone, and with ``dsv41::l2_prefetch_rows`` of the chosen experts' ``w2`` and scales forked beside it (the model's
``experts_w2`` target), with and without the evict-last hint: does ``w2`` arrive while the first GEMM streams w13?

    python3 benchmarks/ops/bench_l2_prefetch.py [--phase-calls 3] [--programs 8 16 32 132]
"""

from __future__ import annotations

import argparse

import torch

from _common import open_gpu

# (name, N, K, groups, the phase before it in the model: an mHC boundary's collapse, or the router launches as a
# stand-in for the sparse attention (~17 µs with its combine at batch 1, docs/benchmarks.md session 31))
SHAPES = [("wq_a+wkv", 1792, 5120, 1, "collapse"), ("wq_b", 32768, 1280, 1, "router"),
          ("wo_a (8 groups)", 8192, 4096, 8, "router"), ("wo_b", 5120, 8192, 1, "router"),
          ("shared w1+w3", 4608, 5120, 1, "collapse")]
COPIES, H, C, E = 8, 5120, 4, 32


def graph_timed(triton, body) -> tuple[float, list]:
    """``body()`` (COPIES calls, returning their outputs) captured in one CUDA graph after one eager run that compiles
    it: µs a call (median of ``do_bench`` over the replays / COPIES) and the outputs of one replay."""
    body()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = body()
    ms = triton.testing.do_bench(g.replay, warmup=20, rep=200, return_mode="median")
    g.replay()
    torch.cuda.synchronize()
    return ms * 1e3 / COPIES, [o.clone() for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase-calls", type=int, default=3, help="router launches in the latency-bound phase")
    ap.add_argument("--programs", type=int, nargs="+", default=[8, 16, 32, 132])
    args = ap.parse_args()
    triton = open_gpu("bench_l2_prefetch")
    if triton is None:
        return
    from vllm_dsv41.ops import fp8_gemv, l2_prefetch, mhc, router  # noqa: F401  (define the ops)
    from vllm_dsv41.reference.model import sinkhorn

    ops = torch.ops.dsv41
    side = torch.cuda.Stream()
    xr = torch.randn(1, H, device="cuda").bfloat16()
    gate = torch.randn(E, H, device="cuda").bfloat16() * H ** -0.5
    bias = torch.randn(E, device="cuda") * 0.1

    g = torch.Generator().manual_seed(0)
    streams = torch.randn(1, C, H, generator=g).bfloat16().cuda()
    y = (torch.randn(1, H, generator=g) * 0.1).bfloat16().cuda()
    post = (2.0 * torch.sigmoid(torch.randn(1, C, generator=g))).cuda()
    comb = sinkhorn(torch.randn(1, C, C, generator=g) * 2.0, 1e-6, 20).cuda()
    pre = (torch.sigmoid(torch.randn(1, C, generator=g)) + 1e-6).cuda()
    norm_w = (torch.randn(H, generator=g) * 0.2 + 1.0).bfloat16().cuda()

    def phase():
        if kind == "collapse":
            ops.mhc_post_collapse_quant(streams, y, post, comb, pre, norm_w, 1e-6)
            return
        for _ in range(args.phase_calls):
            ops.router(xr, gate, bias, 6, 1.0)

    def phases():
        for _ in range(COPIES):
            phase()
        return [xr]

    for name, N, K, G, kind in SHAPES:
        ws = [torch.randn(N, K, device="cuda").mul(0.5).to(torch.float8_e4m3fn) for _ in range(COPIES)]
        wsc = torch.rand(N, 1, device="cuda") * 1e-2 / K ** 0.5 + 1e-4
        x = torch.randn(1, G * K, device="cuda").bfloat16()
        mb = N * K / 1e6

        def gemvs(weights, with_phase=False, prefetch=None):
            outs = []
            for w in weights:
                if prefetch is not None:
                    programs, evict_last, frac = prefetch
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        ops.l2_prefetch(w[: max(1, int(N * frac))], programs, evict_last)
                if with_phase:
                    phase()
                if prefetch is not None:
                    torch.cuda.current_stream().wait_stream(side)
                outs.append(ops.fp8_gemv(x, w, wsc, G))
            return outs

        cold, want = graph_timed(triton, lambda: gemvs(ws))
        hot, _ = graph_timed(triton, lambda: gemvs([ws[0]] * COPIES))
        alone, _ = graph_timed(triton, phases)
        serial, base = graph_timed(triton, lambda: gemvs(ws, with_phase=True))
        print(f"{name:16s} {mb:5.1f} MB  gemv cold {cold:6.1f}  hot {hot:6.1f}  | phase ({kind}) {alone:6.1f}  "
              f"phase + gemv {serial:6.1f} µs", flush=True)
        for frac in (1.0, 0.5) if mb > 30 else (1.0,):
            for el in (False, True):
                for p in args.programs:
                    us, got = graph_timed(triton, lambda: gemvs(ws, with_phase=True, prefetch=(p, el, frac)))
                    same = all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(base, got))
                    label = f"+ prefetch {p}{'/el' if el else ''}{f' {frac:g}' if frac < 1 else ''}"
                    print(f"    {label:22s} {us:6.1f} µs ({serial - us:+5.1f} against phase + gemv); bitwise: {same}",
                          flush=True)
        del want
    experts(args, triton, ops, side)


def experts(args, triton, ops, side) -> None:
    from vllm_dsv41 import formats
    from vllm_dsv41.ops import moe_gemv  # noqa: F401  (defines the op)

    I, K_SLOTS, LIMIT = 2304, 6, 10.0
    sets = []
    for _ in range(2):
        w13, s13 = formats.quant_mxfp4(torch.randn(E, 2 * I, H, device="cuda") * 0.05)
        w2, s2 = formats.quant_mxfp4(torch.randn(E, H, I, device="cuda") * 0.05)
        sets.append((w13.view(torch.uint8), formats.as_uint8(s13), w2.view(torch.uint8), formats.as_uint8(s2)))
    x = torch.randn(1, H, device="cuda").bfloat16()
    idx = torch.randperm(E, device="cuda")[:K_SLOTS].view(1, K_SLOTS).to(torch.int32)
    wts = torch.rand(1, K_SLOTS, device="cuda")

    def run(prefetch):
        outs = []
        for i in range(COPIES):
            st = sets[i % 2]
            if prefetch is not None:
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    ops.l2_prefetch_rows(st[2], idx.view(-1), prefetch[0], prefetch[1])
                    ops.l2_prefetch_rows(st[3], idx.view(-1), prefetch[0], prefetch[1])
            outs.append(ops.moe_gemv(x, *st, idx, wts, LIMIT))
            if prefetch is not None:
                torch.cuda.current_stream().wait_stream(side)
        return outs

    def timed(prefetch):
        return graph_timed(triton, lambda: run(prefetch))

    base_us, base = timed(None)
    print(f"moe_gemv one token, top-{K_SLOTS} of {E} experts: {base_us:6.1f} µs a call", flush=True)
    for el in (False, True):
        for p in args.programs:
            us, got = timed((p, el))
            same = all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(base, got))
            print(f"    + w2 rows prefetch {p}{'/el' if el else ''}: {us:6.1f} µs ({base_us - us:+5.1f}); bitwise: "
                  f"{same}", flush=True)


if __name__ == "__main__":
    main()
