"""Where a bench-config step spends its GPU time: kernels by name, count and total time.

One engine (bench checkpoint, dummy weights, our plugin), then under ``torch.profiler``, for every
``--decode-shapes`` entry BATCH:CONTEXT (default 1:4096 and 64:1024):
  1. decode through the captured graphs: (BATCH prompts of CONTEXT tokens, 1 + ``--decode`` outputs) minus
     (other prompts of the same shape, 1 output), kernel by kernel, so the prompts' prefill cancels out
     and what is left is ``--decode`` decode steps;
  2. the same eagerly (graphs switched off on the model), batch 1 only: the launch count of one step;
then 3. one prefill of ``--prefill`` tokens; ``--host`` adds a cProfile of the host side.  Prints the top kernels of each and the wall time per decode step
(the same difference of two runs), and writes the full tables to $OUT.

Caveat (session 9): when the prompts' prefill takes several chunks, the two runs do not cancel (decode tokens of
early requests ride in later chunks), so the batch-64 difference holds prefill-sized kernels and its wall per step
is not the decode step's (38.5 ms here against 21.5 ms measured step by step).  ``step_timeline.py`` times the
steps themselves, and ``--profile-decode N`` lists the kernels of pure decode steps.

    PYTHONPATH=/tmp/site OUT=$OUT python3 scripts/gpu/profile_steps.py /tmp/bench
"""

from __future__ import annotations

import argparse
import bisect
import os
import time
from collections import defaultdict

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")


def kernel_table(prof, gpu: bool) -> list[tuple[str, int, float]]:
    """(kernel name, launches, total µs) of the GPU kernels the profiler saw, largest total first (on a
    machine without a GPU, the aten ops and their own CPU time: the script's dry run)."""
    agg: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if gpu and e.device_type.name == "CUDA" and e.device_time > 0:
            t = e.device_time
        elif not gpu and e.name.startswith("aten::"):
            t = e.self_cpu_time_total
        else:
            continue
        row = agg[e.name[:90]]
        row[0] += 1
        row[1] += t
    return sorted(((k, int(v[0]), v[1]) for k, v in agg.items()), key=lambda r: -r[2])


def device_gaps(prof) -> tuple[float, float, list[tuple[float, float, str, str]]]:
    """The GPU's idle time between the kernels (and copies) the profiler saw: (span µs from the first start to the
    last end, busy µs = the union of their intervals, gaps [(start µs from the span's start, length µs, the work
    before, the work after)] in time order)."""
    ivs = sorted((e.time_range.start, e.time_range.end, e.name[:60]) for e in prof.events()
                 if e.device_type.name == "CUDA" and e.device_time > 0)
    if not ivs:
        return 0.0, 0.0, []
    t0, gaps, busy = ivs[0][0], [], 0.0
    end, prev, start = ivs[0][1], ivs[0][2], ivs[0][0]
    for s, e, name in ivs[1:]:
        if s > end:
            gaps.append((end - t0, s - end, prev, name))
            busy += end - start
            start = s
        if e >= end:
            end, prev = e, name
    busy += end - start
    return end - t0, busy, gaps


def _union(ivs: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted disjoint intervals covering ``ivs``."""
    out: list[list[float]] = []
    for s, e in sorted(ivs):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def stream_table(ivs: list[tuple[str, int, float, float]]) -> tuple[int | None, dict[int, dict], dict[str, float]]:
    """Per stream of ``ivs`` [(kernel name, stream, start µs, end µs)]: (the main stream = the busiest one, {stream:
    {"busy": µs of the union of its kernels, "kernels": {name: [launches, µs]}}}, {side-stream kernel name: µs of it
    that ran while the main stream was idle inside its span}).  The last dict is the side streams' work on the
    critical path: where the main stream waited for it (or for the host)."""
    streams: dict[int, dict] = {}
    for name, sid, s, e in ivs:
        st = streams.setdefault(sid, {"ivs": [], "kernels": defaultdict(lambda: [0, 0.0])})
        st["ivs"].append((s, e))
        k = st["kernels"][name]
        k[0] += 1
        k[1] += e - s
    for st in streams.values():
        st["union"] = _union(st.pop("ivs"))
        st["busy"] = sum(e - s for s, e in st["union"])
        st["kernels"] = dict(st["kernels"])
    if not streams:
        return None, {}, {}
    main = max(streams, key=lambda k: streams[k]["busy"])
    mu = streams[main]["union"]
    gaps = [(a[1], b[0]) for a, b in zip(mu, mu[1:])]  # the main stream's idle time inside its span
    gap_ends = [g1 for _, g1 in gaps]
    exposed: dict[str, float] = defaultdict(float)
    for name, sid, s, e in ivs:
        if sid == main:
            continue
        for g0, g1 in gaps[bisect.bisect_right(gap_ends, s):]:  # the first gap ending after the kernel starts
            if g0 >= e:
                break
            exposed[name] += max(0.0, min(e, g1) - max(s, g0))
    for st in streams.values():
        st.pop("union")
    return main, streams, {k: v for k, v in exposed.items() if v > 0}


def critical_path(ivs: list[tuple[str, int, float, float]]) -> tuple[dict[str, list], list[float]]:
    """An estimate of the critical path through ``ivs`` [(kernel name, stream, start µs, end µs)] without the
    dependency edges (a replayed CUDA graph runs its branches on streams of its own, so a "main stream" means
    little there): from the kernel that ends last, back through the *last finisher*, the kernel that ended latest
    at or before the current one started (what released it, unless a dependency ended earlier and the current one
    waited for its launch), to the first kernel.  -> ({kernel name: [launches, µs] on the path}, [the idle gaps
    between consecutive path kernels, µs]).  The path's kernel time plus its gaps is the span of ``ivs``.  Kernels
    launched with PDL start before the one they wait for ends, so the walk is for profiles with PDL off."""
    if not ivs:
        return {}, []
    ks = sorted(ivs, key=lambda k: (k[3], k[2]))
    ends = [k[3] for k in ks]
    on: dict[str, list] = defaultdict(lambda: [0, 0.0])
    gaps: list[float] = []
    i = len(ks) - 1
    while i >= 0:
        name, _, start, end = ks[i]
        k = on[name]
        k[0] += 1
        k[1] += end - start
        j = bisect.bisect_right(ends, start, hi=i) - 1  # the latest end at or before this kernel's start
        if j >= 0:
            gaps.append(start - ks[j][3])
        i = j
    return dict(on), gaps


def stream_report(title: str, prof, steps: int, out: str, top: int = 8) -> None:
    """The kernels of ``prof`` by CUDA stream, per step: each stream's busy time and top kernels, and the side
    streams' kernels that ran while the main stream stood idle (on the critical path); all rows to
    ``out``/<title>_streams.tsv."""
    ivs = [(e.name[:90], int(getattr(e, "device_resource_id", -1)), e.time_range.start, e.time_range.end)
           for e in prof.events() if e.device_type.name == "CUDA" and e.device_time > 0]
    main, streams, exposed = stream_table(ivs)
    if main is None:
        return
    print(f"\n== {title}: by stream (main = {main}, the busiest)")
    for sid in sorted(streams, key=lambda k: -streams[k]["busy"]):
        st = streams[sid]
        ks = sorted(st["kernels"].items(), key=lambda kv: -kv[1][1])
        n = sum(v[0] for v in st["kernels"].values())
        print(f"  stream {sid}{' (main)' if sid == main else ''}: busy {st['busy'] / steps / 1e3:.2f} ms a step, "
              f"{n / steps:.0f} kernels a step")
        for name, (cnt, us) in ks[:top]:
            print(f"    {us / steps:9.1f} µs/step {cnt / steps:7.1f}/step  {name}")
    total = sum(exposed.values())
    print(f"  side-stream kernels while the main stream was idle: {total / steps / 1e3:.2f} ms a step (inside a "
          f"replayed CUDA graph the branches run on streams of the graph's own: see the critical path below)")
    for name, us in sorted(exposed.items(), key=lambda kv: -kv[1])[:top]:
        print(f"    {us / steps:9.1f} µs/step  {name}")
    on, gaps = critical_path(ivs)
    busy = sum(v[1] for v in on.values())
    small = sum(g for g in gaps if g < 10.0)
    print(f"== {title}: critical path (estimate: each kernel's last finisher before it): {busy / steps / 1e3:.2f} ms "
          f"of kernels a step ({sum(v[0] for v in on.values()) / steps:.0f} launches), gaps under 10 µs "
          f"{small / steps / 1e3:.2f} ms, longer gaps {(sum(gaps) - small) / steps / 1e3:.2f} ms a step")
    for name, (cnt, us) in sorted(on.items(), key=lambda kv: -kv[1][1])[:2 * top]:
        print(f"    {us / steps:9.1f} µs/step {cnt / steps:7.1f}/step  {name}")
    with open(os.path.join(out, f"{title.replace(' ', '_')}_critical.tsv"), "w") as f:
        f.write("kernel\tlaunches_per_step\tus_per_step\n")
        for name, (cnt, us) in sorted(on.items(), key=lambda kv: -kv[1][1]):
            f.write(f"{name}\t{cnt / steps:.2f}\t{us / steps:.2f}\n")
    with open(os.path.join(out, f"{title.replace(' ', '_')}_streams.tsv"), "w") as f:
        f.write("stream\tkernel\tlaunches_per_step\tus_per_step\texposed_us_per_step\n")
        for sid, st in streams.items():
            for name, (cnt, us) in st["kernels"].items():
                ex = exposed.get(name, 0.0) if sid != main else 0.0
                f.write(f"{sid}\t{name}\t{cnt / steps:.2f}\t{us / steps:.2f}\t{ex / steps:.2f}\n")


def host_waits(prof) -> dict[str, tuple[int, float]]:
    """What in the profile made the host wait for the GPU: copies from or to pageable host memory (CUDA syncs the
    stream around them) and the runtime's synchronize calls; name -> (count, µs the host spent in them; 0 for the
    copies, whose wait shows as the runtime call that issued them)."""
    waits: dict[str, tuple[int, float]] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA" and "Pageable" in e.name:
            us = 0.0
        elif e.device_type.name == "CPU" and "Synchronize" in e.name:
            us = e.time_range.end - e.time_range.start
        else:
            continue
        n, t = waits.get(e.name, (0, 0.0))
        waits[e.name] = (n + 1, t + us)
    return waits


def gap_report(title: str, prof, steps: int, out: str, top: int = 20) -> None:
    """Where the GPU waited during ``steps`` profiled engine steps (for the host: launches, a host read, the
    scheduler between steps): idle time per step by gap length, and the longest gaps with the work around them;
    every gap of 10 µs or more to ``out``/<title>_gaps.tsv.  Under the profiler each launch costs the host more
    (CUPTI's callbacks), so gaps where the host sets the pace come out longer than in an unprofiled run: read their
    places and counts, and the timeline's unprofiled GPU time for their cost."""
    span, busy, gaps = device_gaps(prof)
    if not span:
        print(f"\n== {title}: no GPU work in the profile (no idle-time report)")
        return
    print(f"\n== {title}: GPU busy {busy / steps / 1e3:.2f} ms and idle {(span - busy) / steps / 1e3:.2f} ms per step "
          f"({steps} steps, {len(gaps) / steps:.0f} gaps a step)")
    for lo, hi in ((0, 10), (10, 100), (100, 1000), (1000, float("inf"))):
        sel = [g[1] for g in gaps if lo <= g[1] < hi]
        print(f"  gaps {lo:>5.0f}-{hi:<5.0f} µs: {len(sel) / steps:8.1f} a step, "
              f"{sum(sel) / steps / 1e3:8.2f} ms a step")
    waits = host_waits(prof)
    print("  host waits a step: " + (", ".join(f"{k} {n / steps:.1f} ({t / steps / 1e3:.2f} ms)"
                                              for k, (n, t) in sorted(waits.items())) or "none"))
    print(f"  the {top} longest (ms into the profile, µs, the work before the gap -> the work after it):")
    for at, gap, before, after in sorted(gaps, key=lambda g: -g[1])[:top]:
        print(f"  {at / 1e3:10.2f} {gap:9.1f}  {before} -> {after}")
    with open(os.path.join(out, f"{title.replace(' ', '_')}_gaps.tsv"), "w") as f:
        f.write("at_ms\tgap_us\twork_before\twork_after\n")
        for at, gap, before, after in gaps:
            if gap >= 10:
                f.write(f"{at / 1e3:.3f}\t{gap:.1f}\t{before}\t{after}\n")


def minus(a: list[tuple[str, int, float]], b: list[tuple[str, int, float]]) -> list[tuple[str, int, float]]:
    """Kernel table ``a`` less ``b`` (same kernel names), largest remaining total first."""
    rest = {k: (n, t) for k, n, t in b}
    rows = [(k, n - rest.get(k, (0, 0.0))[0], t - rest.get(k, (0, 0.0))[1]) for k, n, t in a]
    return sorted((r for r in rows if r[1] > 0 or r[2] > 0), key=lambda r: -r[2])


def report(title: str, rows: list[tuple[str, int, float]], steps: int, out: str, top: int = 25) -> None:
    n = sum(r[1] for r in rows)
    t = sum(r[2] for r in rows)
    print(f"\n== {title}: {n / steps:.0f} kernels and {t / steps / 1e3:.2f} ms of kernel time per step "
          f"({steps} steps)")
    for name, cnt, us in rows[:top]:
        print(f"  {us / steps:9.1f} µs/step {cnt / steps:7.1f} launches/step  {name}")
    with open(os.path.join(out, title.replace(" ", "_").replace(",", "") + ".tsv"), "w") as f:
        f.write("kernel\tlaunches_per_step\tus_per_step\n")
        for name, cnt, us in rows:
            f.write(f"{name}\t{cnt / steps:.2f}\t{us / steps:.2f}\n")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--decode-shapes", default="1:4096,64:1024", help="BATCH:CONTEXT,... decode profiles")
    ap.add_argument("--decode", type=int, default=16, help="decode steps profiled")
    ap.add_argument("--prefill", type=int, default=16384)
    ap.add_argument("--sync", action="store_true", help="async scheduling off (the engine's choice otherwise)")
    ap.add_argument("--host", action="store_true",
                    help="also cProfile the host side of the last decode shape (top functions; pstats in $OUT)")
    args = ap.parse_args()
    out = os.environ.get("OUT", "/tmp")

    import torch
    from torch.profiler import ProfilerActivity, profile
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    shapes = [tuple(int(v) for v in x.split(":")) for x in args.decode_shapes.split(",")]
    gpu = torch.cuda.is_available()
    activities = [ProfilerActivity.CUDA if gpu else ProfilerActivity.CPU]
    t0 = time.perf_counter()
    extra = dict(kv_cache_memory_bytes=16 << 30) if gpu else dict(dtype="float32")
    max_ctx = max([args.prefill] + [c for _, c in shapes])
    if args.sync:
        extra["async_scheduling"] = False
    llm = LLM(model=args.model, load_format="dummy", max_model_len=max_ctx + 1024,
              max_num_seqs=max(64, *(b for b, _ in shapes)), seed=0, **extra)
    print(f"engine start {time.perf_counter() - t0:.1f} s, async scheduling "
          f"{llm.llm_engine.vllm_config.scheduler_config.async_scheduling}", flush=True)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    calls = iter(range(1 << 30))

    def gen(batch: int, n_prompt: int, n_out: int) -> float:
        """``batch`` fresh random prompts (never a prefix-cache hit) of ``n_prompt`` tokens, ``n_out`` outputs."""
        g = torch.Generator().manual_seed(next(calls))
        prompts = [TokensPrompt(prompt_token_ids=torch.randint(3, vocab - 64, (n_prompt,), generator=g).tolist())
                   for _ in range(batch)]
        t = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - t

    def decode_profile(title: str, batch: int, ctx: int) -> None:
        gen(batch, ctx, 4)  # compile, capture
        dt = (gen(batch, ctx, 1 + args.decode) - gen(batch, ctx, 1)) / args.decode
        print(f"\n{title}: {dt * 1e3:.2f} ms/step ({batch / dt:,.1f} tok/s) at context {ctx}", flush=True)
        tables = []
        for n_out in (1 + args.decode, 1):
            with profile(activities=activities) as prof:
                gen(batch, ctx, n_out)
            tables.append(kernel_table(prof, gpu))
        report(title, minus(*tables), args.decode, out)

    for batch, ctx in shapes:
        decode_profile(f"decode graphs batch {batch}", batch, ctx)

    if args.host:
        import cProfile
        import pstats

        batch, ctx = shapes[-1]
        prof = cProfile.Profile()
        prof.enable()
        gen(batch, ctx, 1 + args.decode)
        prof.disable()
        prof.dump_stats(os.path.join(out, "host.pstats"))
        print(f"\n== host functions, batch {batch}, context {ctx}, prefill + {args.decode} decode steps "
              "(cProfile, by own time)")
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)

    def graphs_off(model):
        model._graphs, model._graph_mode = None, "off"

    llm.apply_model(graphs_off)
    decode_profile("decode eager batch 1", 1, shapes[0][1])

    gen(1, args.prefill, 1)
    with profile(activities=activities) as prof:
        dt = gen(1, args.prefill, 1)
    print(f"\nprefill {args.prefill} tokens: {dt:.3f} s ({args.prefill / dt:,.0f} tok/s)")
    report("prefill", kernel_table(prof, gpu), 1, out)
    os._exit(0)


if __name__ == "__main__":
    raise SystemExit(main())
