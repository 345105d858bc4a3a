"""Where a throughput workload's wall time goes, engine step by engine step.

One engine (the side-by-side benchmark's settings: bench checkpoint, dummy weights, our plugin unless
``VLLM_DSV41_DISABLE``), one untimed run of the workload's shape, then the timed run with hooks on the
in-process engine core:

* ``scheduler.schedule``: when a step is planned, its scheduled tokens and how many of them are prefill;
* the model runner's ``execute_model`` / ``sample_tokens``: host time inside them, and CUDA events around
  them (the GPU time between the step's first and last launch on the current stream);
* ``scheduler.update_from_output``: when the step's output reached the host (the step's end as the
  engine sees it).

Per phase (steps that hold prefill tokens, pure decode steps) it prints the steps, the wall between step
ends (the pace), the host time in the runner and the GPU time per step.  Under async scheduling a pace
close to the host time says the host sets it; close to the GPU time, the GPU.  The GPU time is the span between
the events around a step's launches, so when a step is launched while the previous one still runs on the GPU
(the batch-64 prefill chunks, session 21: spans of 455-480 ms against 280-450 ms between plan and output) the span
includes that wait, the spans of consecutive steps overlap, and a host time that follows such a step can be the
host waiting on that GPU work (a copy from pageable memory, a synchronising call) rather than launch work.  The rows go to
``$OUT/timeline.json``.  ``--profile-decode N`` adds a third run whose first N pure decode steps (every
prompt prefilled) run under ``torch.profiler``: their kernels by name, count and time per step, without the
prefill chunks that a difference of two runs (``profile_steps.py``) mixes in; ``--profile-prefill`` does the same for
the steps that hold prefill tokens.  Both then report, on a GPU, where the GPU sat idle between kernels in those
steps (``profile_steps.gap_report``: gaps by length, the longest with the work around them).
``--cprofile-prefill`` puts the runner's host work in the prefill steps of one more run under ``cProfile``: where the
host's time goes when it, not the GPU, sets a prefill step's pace.

    PYTHONPATH=/tmp/site OUT=$OUT python3 scripts/gpu/step_timeline.py /tmp/bench --batch 64 --prompt 1024 --out 256
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")


def _runner(core):
    """The GPU model runner behind an in-process engine core (uniproc executor)."""
    worker = core.model_executor.driver_worker
    worker = getattr(worker, "worker", worker)
    return worker.model_runner


def summarize(rows: list[dict]) -> list[dict]:
    """Per phase: steps, wall (sum of paces), mean pace / host / GPU ms, tokens."""
    out = []
    for phase in ("prefill", "decode"):
        sel = [r for r in rows if r["phase"] == phase and r.get("pace_ms") is not None]
        if not sel:
            continue
        gpu = [r["gpu_ms"] for r in sel if r.get("gpu_ms") is not None]
        out.append(dict(
            phase=phase, steps=len(sel), wall_s=sum(r["pace_ms"] for r in sel) / 1e3,
            tokens=sum(r["tokens"] for r in sel),
            pace_ms=statistics.mean(r["pace_ms"] for r in sel),
            host_ms=statistics.mean(r["host_ms"] for r in sel),
            gpu_ms=statistics.mean(gpu) if gpu else None,
        ))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--out", type=int, default=256)
    ap.add_argument("--kv-bytes", type=int, default=16 << 30)
    ap.add_argument("--max-model-len", type=int, default=66560)
    ap.add_argument("--profile-decode", type=int, default=0, metavar="N",
                    help="profile the first N pure decode steps of a third run")
    ap.add_argument("--profile-prefill", action="store_true",
                    help="profile the steps that hold prefill tokens (until the first pure decode step) of a run")
    ap.add_argument("--cprofile-prefill", action="store_true",
                    help="cProfile the model runner's host work in the steps that hold prefill tokens of a run")
    args = ap.parse_args()
    out_dir = os.environ.get("OUT", "/tmp")

    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    cuda = torch.cuda.is_available()
    extra = dict(kv_cache_memory_bytes=args.kv_bytes) if cuda else dict(dtype="float32")
    t0 = time.perf_counter()
    llm = LLM(model=args.model, load_format="dummy", seed=0, max_num_seqs=max(64, args.batch),
              max_model_len=args.max_model_len, **extra)
    print(f"engine start {time.perf_counter() - t0:.1f} s", flush=True)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    core = llm.llm_engine.engine_core.engine_core
    runner = _runner(core)
    calls = iter(range(1 << 30))

    def run() -> float:
        g = torch.Generator().manual_seed(next(calls))
        prompts = [TokensPrompt(prompt_token_ids=torch.randint(3, vocab - 64, (args.prompt,), generator=g).tolist())
                   for _ in range(args.batch)]
        t = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.out, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - t

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        held = torch.cuda.memory_allocated()
    warm = run()
    print(f"untimed run {warm:.2f} s", flush=True)
    if cuda:
        # what the workload's steps allocated above the weights, caches and graph pools the engine already held:
        # the figure the profile run's activation reservation (model.activation_bytes) stands in for
        peak = torch.cuda.max_memory_allocated() - held
        print(f"activation peak of the untimed run {peak / 2**30:.2f} GiB above the {held / 2**30:.2f} GiB held "
              f"(max_num_batched_tokens {llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens})",
              flush=True)

    rows: list[dict] = []
    pending: list[dict] = []  # planned steps whose output has not come back yet, oldest first
    live = {"on": False}

    def hook_schedule(fn):
        @functools.wraps(fn)
        def wrapped(*a, **kw):
            so = fn(*a, **kw)
            if live["on"] and so.total_num_scheduled_tokens:
                new = sum(so.num_scheduled_tokens.get(r.req_id, 0) for r in so.scheduled_new_reqs)
                decode = sum(1 for n in so.num_scheduled_tokens.values() if n == 1)
                row = dict(t_plan=time.perf_counter(), tokens=so.total_num_scheduled_tokens,
                           reqs=len(so.num_scheduled_tokens), decode_reqs=decode, new_req_tokens=new,
                           host_ms=0.0, events=[])
                row["phase"] = "decode" if decode == row["reqs"] else "prefill"
                pending.append(row)
                rows.append(row)
                live.get("watch", lambda: None)()
            return so
        return wrapped

    def hook_runner(fn):
        @functools.wraps(fn)
        def wrapped(*a, **kw):
            if not (live["on"] and pending):
                return fn(*a, **kw)
            row = pending[-1]
            ev0 = ev1 = None
            if cuda:
                ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                ev0.record()
            cprof = live.get("cprofile") if row["phase"] == "prefill" else None
            t = time.perf_counter()
            if cprof is not None:
                cprof.enable()
            res = fn(*a, **kw)
            if cprof is not None:
                cprof.disable()
            row["host_ms"] += (time.perf_counter() - t) * 1e3
            if cuda:
                ev1.record()
                row["events"].append((ev0, ev1))
            return res
        return wrapped

    def hook_update(fn):
        @functools.wraps(fn)
        def wrapped(*a, **kw):
            res = fn(*a, **kw)
            if live["on"] and pending:
                pending.pop(0)["t_done"] = time.perf_counter()
                live.get("watch", lambda: None)()
            return res
        return wrapped

    core.scheduler.schedule = hook_schedule(core.scheduler.schedule)
    core.scheduler.update_from_output = hook_update(core.scheduler.update_from_output)
    runner.execute_model = hook_runner(runner.execute_model)
    if hasattr(runner, "sample_tokens"):
        runner.sample_tokens = hook_runner(runner.sample_tokens)

    live["on"] = True
    t_start = time.perf_counter()
    wall = run()
    live["on"] = False
    if cuda:
        torch.cuda.synchronize()
    prev = t_start
    for r in rows:
        evs = r.pop("events")
        r["gpu_ms"] = evs[0][0].elapsed_time(evs[-1][1]) if evs else None
        done = r.get("t_done")
        r["pace_ms"] = (done - prev) * 1e3 if done else None
        prev = done or prev
        r["t_plan"] = (r["t_plan"] - t_start) * 1e3
        r["t_done"] = (done - t_start) * 1e3 if done else None

    n_out = args.batch * args.out
    print(f"\ntimed run: {args.batch} x {args.prompt} prompt, {args.out} out: {wall:.2f} s, "
          f"{n_out / wall:,.1f} output tok/s, {len(rows)} steps")
    print(f"{'phase':8s} {'steps':>6s} {'wall s':>8s} {'tokens':>8s} {'pace ms':>9s} {'host ms':>9s} {'GPU ms':>9s}")
    for s in summarize(rows):
        gpu = f"{s['gpu_ms']:9.2f}" if s["gpu_ms"] is not None else f"{'-':>9s}"
        print(f"{s['phase']:8s} {s['steps']:6d} {s['wall_s']:8.2f} {s['tokens']:8d} {s['pace_ms']:9.2f} "
              f"{s['host_ms']:9.2f} {gpu}")
    print("\nfirst steps (t_done ms, tokens, reqs, phase, pace / host / GPU ms):")
    for r in rows[:12]:
        print(f"  {r['t_done'] or 0:9.1f} {r['tokens']:6d} {r['reqs']:4d} {r['phase']:8s} "
              f"{r['pace_ms'] or 0:8.2f} {r['host_ms']:8.2f} {r['gpu_ms'] or 0:8.2f}")
    with open(os.path.join(out_dir, "timeline.json"), "w") as f:
        json.dump(dict(args=vars(args), wall_s=wall, rows=rows, summary=summarize(rows)), f, indent=1)
    if args.profile_prefill:
        profile_prefill(run, rows, live, cuda, out_dir)
    if args.profile_decode:
        profile_decode(run, rows, live, args.profile_decode, cuda, out_dir)
    if args.cprofile_prefill:
        cprofile_prefill(run, rows, live, out_dir)
    os._exit(0)


def _profiler(cuda: bool):
    """A ``torch.profiler`` over the GPU's kernels (the CPU's ops on a machine without one), not yet started."""
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU])


def _report(title: str, prof, cuda: bool, steps: int, out_dir: str, top: int) -> None:
    """``profile_steps.py``'s kernel table of ``prof``, per step, printed and written under ``out_dir``; on a GPU also
    its idle-time report (the gaps between kernels: where the GPU waited for the host) and the kernels by stream (the
    side streams' work on the critical path)."""
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from profile_steps import gap_report, kernel_table, report, stream_report

    report(title, kernel_table(prof, cuda), steps, out_dir, top=top)
    if cuda:
        gap_report(title, prof, steps, out_dir)
        stream_report(title, prof, steps, out_dir)


def profile_prefill(run, rows: list[dict], live: dict, cuda: bool, out_dir: str) -> None:
    """One more run of the workload under ``torch.profiler`` from its start until its first pure decode step is
    planned (the GPU drained first): the kernels of the steps that hold prefill tokens, per such step."""
    prof = _profiler(cuda)
    state = {"off": False}
    first = len(rows)

    def watch() -> None:
        new = rows[first:]
        if not state["off"] and new and new[-1]["phase"] == "decode":
            if cuda:
                import torch

                torch.cuda.synchronize()
            prof.stop()
            state["off"], state["steps"] = True, sum(1 for r in new if r["phase"] == "prefill")

    live["watch"] = watch
    live["on"] = True
    prof.start()
    run()
    live["on"] = False
    live.pop("watch")
    if not state["off"]:
        prof.stop()
        print("\nprefill profile: the run had no pure decode step; nothing reported")
        return
    _report("prefill steps", prof, cuda, state["steps"], out_dir, top=40)


def cprofile_prefill(run, rows: list[dict], live: dict, out_dir: str, top: int = 40) -> None:
    """One more run of the workload with the model runner's calls in steps that hold prefill tokens under
    ``cProfile`` (the host side: Python, launches, waits): the functions with the most own time and the most
    cumulative time, per step; the stats go to ``out_dir``/prefill_host.pstats."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    first = len(rows)
    live["cprofile"] = prof
    live["on"] = True
    run()
    live["on"] = False
    live.pop("cprofile")
    steps = sum(1 for r in rows[first:] if r["phase"] == "prefill")
    host = sum(r["host_ms"] for r in rows[first:] if r["phase"] == "prefill")
    prof.dump_stats(os.path.join(out_dir, "prefill_host.pstats"))
    print(f"\n== prefill steps, host side under cProfile: {steps} steps, {host / max(steps, 1):.1f} ms a step in the "
          f"runner (cProfile slows Python down: read the shares)")
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(top)
        lines = [ln for ln in buf.getvalue().splitlines() if ln.strip()]
        start = next((i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls")), 0)
        print(f"-- by {key}:")
        for ln in lines[start:start + top + 1]:
            print("  " + ln[:200])


def profile_decode(run, rows: list[dict], live: dict, n_steps: int, cuda: bool, out_dir: str) -> None:
    """One more run of the workload; ``torch.profiler`` runs from the planning of its first pure decode step
    until ``n_steps`` decode steps have come back (the hooks of :func:`main` call :func:`watch`)."""
    prof = _profiler(cuda)
    state = {"on": False, "done": 0, "off": False}
    first = len(rows)

    def watch() -> None:
        new = rows[first:]
        if not state["on"] and new and new[-1]["phase"] == "decode" and all(
                r["phase"] == "decode" or r.get("t_done") for r in new):
            prof.start()
            state["on"], state["start_row"] = True, len(rows) - 1
        elif state["on"] and not state["off"]:
            done = sum(1 for r in rows[state["start_row"]:] if r.get("t_done"))
            if done >= n_steps:
                if cuda:
                    import torch

                    torch.cuda.synchronize()
                prof.stop()
                state["off"] = True

    live["watch"] = watch
    live["on"] = True
    run()
    live["on"] = False
    if not state["off"]:
        print(f"\nprofile: fewer than {n_steps} decode steps came back; nothing reported")
        return
    _report("decode steps", prof, cuda, n_steps, out_dir, top=30)


if __name__ == "__main__":
    raise SystemExit(main())
