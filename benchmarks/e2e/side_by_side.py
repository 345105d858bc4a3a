"""Side-by-side end-to-end benchmark: our plugin vs vLLM's built-in DeepSeek-V4.1, same GPU, same
engine config, same workloads.

Owns: the workload list (decode at batch 1/16/64, a 32k prefill, a stress sweep of batch x length; each
throughput workload is timed after one untimed run of its shape on other tokens, :func:`warm_up`),
the per-impl worker (one ``vllm.LLM`` in-process, results appended to ``OUTDIR/<impl>.json`` after
every workload), the driver (one worker subprocess per impl with a timeout; a worker that dies keeps
what it measured and its running workload is marked ``crashed``; after a crash, or a workload that
raised, a fresh worker runs the workloads left while the impl's time lasts), the global KV bytes/token read from
the engine's own KV-cache config, and the comparison table (``OUTDIR/table.md``).

GPU (one H200, vLLM 0.32 and this package importable):

    python benchmarks/e2e/side_by_side.py run --model /models/DeepSeek-V4.1-Flash \\
        --impls plugin,builtin --out out/side_by_side

The impls may also run in two invocations (same ``--out`` merges them; ``table`` re-renders):

    python benchmarks/e2e/side_by_side.py run --model DIR --impls builtin --out out/sbs
    python benchmarks/e2e/side_by_side.py run --model DIR --impls plugin --out out/sbs
    python benchmarks/e2e/side_by_side.py table out/sbs/plugin.json out/sbs/builtin.json \\
        --out out/sbs/table.md

CPU smoke run on the tiny checkpoint (plugin only; the built-in V4.1 needs a GPU):

    python benchmarks/e2e/side_by_side.py run --model ckpt/tiny --impls plugin --scale tiny --out /tmp/sbs
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import itertools
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
import traceback
import zlib
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

IMPLS = ("plugin", "builtin")
#: plugin/builtin ratio each throughput row must reach.
RATIO_TARGETS = {"decode_b1": 2.0, "decode_b64": 1.5, "prefill_32k": 1.0}
#: Upper bound of the plugin's global (non-sliding) KV bytes per token.
KV_LIMIT_BYTES_PER_TOKEN = 900
#: Statuses of a workload that count as a crash of the engine.
CRASH_STATUSES = ("crashed", "timeout")
LOG_TAIL_CHARS = 4000


@dataclass(frozen=True)
class Workload:
    name: str
    kind: str  # "decode" | "prefill" | "stress"
    batch: int
    prompt_len: int
    max_tokens: int


def _stress(pairs: list[tuple[int, int]], max_tokens: int) -> list[Workload]:
    return [Workload(f"stress_{b}x{n}", "stress", b, n, max_tokens) for b, n in pairs]


SCALES: dict[str, list[Workload]] = {
    "full": [
        Workload("decode_b1", "decode", 1, 4096, 256),
        Workload("decode_b16", "decode", 16, 1024, 256),
        Workload("decode_b64", "decode", 64, 1024, 256),
        Workload("prefill_32k", "prefill", 1, 32768, 1),
        *_stress([(1, 65536), (8, 16384), (32, 8192), (64, 4096), (64, 1024)], 16),
    ],
    "tiny": [
        Workload("decode_b1", "decode", 1, 64, 8),
        Workload("decode_b16", "decode", 16, 32, 8),
        Workload("decode_b64", "decode", 64, 16, 4),
        Workload("prefill_32k", "prefill", 1, 512, 1),
        *_stress([(1, 1024), (8, 256), (64, 16)], 4),
    ],
}


# ---------------------------------------------------------------------------------------------
# small helpers


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def save_json(path: Path, obj: dict) -> None:
    """Write atomically, so a worker killed mid-write never leaves a truncated file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=False))
    os.replace(tmp, path)


def load_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def select_workloads(scale: str, only: str | None) -> list[Workload]:
    """The scale's workloads, or those named in ``only`` (``stress`` selects every stress pair)."""
    workloads = SCALES[scale]
    if not only:
        return workloads
    names = {n.strip() for n in only.split(",") if n.strip()}
    known = {w.name for w in workloads} | {"stress"}
    if names - known:
        raise SystemExit(f"unknown workloads {sorted(names - known)}; known: {sorted(known)}")
    return [w for w in workloads if w.name in names or (w.kind == "stress" and "stress" in names)]


def max_model_len(scale: str) -> int:
    """The next multiple of 1024 above the scale's longest request (the same for every --only)."""
    longest = max(w.prompt_len + w.max_tokens for w in SCALES[scale])
    return (longest // 1024 + 1) * 1024


def llm_kwargs(impl: str, model: str, scale: str, overrides: dict[str, Any]) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(model=model, load_format="dummy", seed=0, max_num_seqs=64,
                                  max_model_len=max_model_len(scale))
    if scale == "tiny":
        kwargs.update(dtype="float32", enforce_eager=True)
    kwargs.update(overrides)
    return kwargs


def worker_env(impl: str) -> dict[str, str]:
    # FlashInfer's sampler JIT-compiles for ~100 s at every engine start on a machine without its cubin
    # package (the H200 image); greedy sampling is not what this compares, so both impls use vLLM's own.
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_USE_FLASHINFER_SAMPLER="0")
    if impl == "builtin":
        env["VLLM_DSV41_DISABLE"] = "1"
    else:
        env.pop("VLLM_DSV41_DISABLE", None)
        env["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    return env


def token_range(vocab: int) -> tuple[int, int]:
    """Prompt ids avoid the specials at both ends; tiny vocabularies keep most of their ids."""
    return (100, vocab - 1000) if vocab >= 2000 else (3, vocab - 64)


# ---------------------------------------------------------------------------------------------
# KV-cache accounting (engine-side)


def engine_kv_cache_config(llm) -> tuple[Any, str]:
    """The in-process engine's KV-cache config and where it came from.

    The worker's copy keeps every layer's spec; the scheduler's copy replaces a
    ``UniformTypeKVCacheSpecs`` group by its first layer's spec, so it is only the fallback.
    """
    core = llm.llm_engine.engine_core.engine_core
    runner = getattr(getattr(core.model_executor.driver_worker, "worker", None), "model_runner", None)
    kcc = getattr(runner, "kv_cache_config", None)
    if kcc is not None:
        return kcc, "worker.model_runner.kv_cache_config"
    return core.scheduler.kv_cache_config, "scheduler.kv_cache_config"


def spec_kind(spec) -> str:
    """``sliding`` (bounded window), ``per_request`` (fixed-size state) or ``global``."""
    from vllm.v1.kv_cache_interface import (ChunkedLocalAttentionSpec, CircularBufferSpec,
                                            HiSparseHotSpec, MambaSpec)

    if getattr(spec, "sliding_window", None) is not None or isinstance(spec, ChunkedLocalAttentionSpec):
        return "sliding"
    if isinstance(spec, (CircularBufferSpec, MambaSpec, HiSparseHotSpec)):
        return "per_request"
    return "global"


def group_summary(group) -> dict[str, Any]:
    """One KV-cache group: its layers' specs and, for global groups, bytes per token.

    ``block_size`` counts original tokens (a compressed page holds ``block_size / tokens_per_state``
    states), so one layer costs ``page_size_bytes / block_size`` bytes per token.
    """
    from vllm.v1.kv_cache_interface import iter_layer_specs

    specs = list(iter_layer_specs(group.kv_cache_spec))
    if len(specs) == 1:
        specs *= len(group.layer_names)
    first = specs[0]
    per_token = sum(s.page_size_bytes / s.block_size for s in specs if spec_kind(s) == "global")
    return {
        "spec": "/".join(sorted({type(s).__name__ for s in specs})),
        "kind": spec_kind(first),
        "layers": len(group.layer_names),
        "block_size": first.block_size,
        "tokens_per_state": "/".join(sorted({str(getattr(s, "tokens_per_state", 1)) for s in specs}, key=float)),
        "page_size_bytes": sorted({s.page_size_bytes for s in specs}),
        "bytes_per_token": per_token,
    }


def kv_cache_summary(kcc, source: str) -> dict[str, Any]:
    groups = [group_summary(g) for g in kcc.kv_cache_groups]
    pool = max((t.size for t in kcc.kv_cache_tensors if not t.host_resident), default=0)
    return {
        "global_bytes_per_token": sum(g["bytes_per_token"] for g in groups),
        "groups": groups,
        "pool_bytes": pool,
        "num_blocks": kcc.num_blocks,
        "source": source,
    }


# ---------------------------------------------------------------------------------------------
# worker: one engine, the workloads in order, the JSON rewritten after each


def make_prompts(w: Workload, vocab: int) -> list:
    import numpy as np
    from vllm.inputs import TokensPrompt

    lo, hi = token_range(vocab)
    rng = np.random.default_rng(zlib.crc32(w.name.encode()))
    ids = rng.integers(lo, hi, size=(w.batch, w.prompt_len))
    return [TokensPrompt(prompt_token_ids=row.tolist()) for row in ids]


def run_workload(llm, w: Workload, vocab: int) -> dict[str, Any]:
    from vllm import SamplingParams

    prompts = make_prompts(w, vocab)
    params = SamplingParams(temperature=0, max_tokens=w.max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    if n_out != w.batch * w.max_tokens:
        raise RuntimeError(f"expected {w.batch * w.max_tokens} output tokens, got {n_out}")
    prompt_tokens = w.batch * w.prompt_len
    result: dict[str, Any] = {
        "wall_s": wall,
        "prompt_tokens": prompt_tokens,
        "output_tokens": n_out,
        "tok_s": (prompt_tokens if w.kind == "prefill" else n_out) / wall,
    }
    ttfts = [o.metrics.first_token_latency for o in outs
             if getattr(o, "metrics", None) is not None and o.metrics.first_token_latency > 0]
    if ttfts:
        result["ttft_s_median"] = statistics.median(ttfts)
    return result


def warm_up(llm, w: Workload, vocab: int) -> float:
    """One untimed run of ``w``'s shape (other tokens, so the prefix cache cannot serve the timed run; a few
    output tokens): JIT compiles, autotuning and first-touch allocations for its batch and prompt length
    land here, not in the timed run.  Returns its wall time."""
    t0 = time.perf_counter()
    run_workload(llm, replace(w, name=f"warmup_{w.name}", max_tokens=min(w.max_tokens, 4)), vocab)
    return time.perf_counter() - t0


def error_text(exc: BaseException) -> str:
    """The exception and the end of its traceback (where it was raised)."""
    return f"{type(exc).__name__}: {exc}\n" + traceback.format_exc()[-LOG_TAIL_CHARS:]


def gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


#: Worker exit code after a workload raised: the engine's state is unknown (its requests may still be
#: scheduled; a server's engine would be dead), so the driver starts a fresh one for the rest.
EXIT_STOPPED = 3
#: A finished workload keeps its result when a worker resumes the impl.
FINAL_STATUSES = ("ok", "error", "crashed", "timeout")


#: The worker prints every thread's Python stack to its log this often: a worker killed at the timeout
#: then shows where it was (slow in a kernel's first compile, or stuck).
STACK_DUMP_S = 60


def worker_main(args: argparse.Namespace) -> int:
    faulthandler.dump_traceback_later(STACK_DUMP_S, repeat=True, file=sys.stderr)
    path = Path(args.out) / f"{args.impl}.json"
    workloads = select_workloads(args.scale, args.only)
    kwargs = llm_kwargs(args.impl, args.model, args.scale, json.loads(args.llm_args))
    prev = load_json(path) if args.resume else None
    rec: dict[str, Any] = prev or {
        "impl": args.impl, "status": "starting", "date_utc": utc_now(), "command": args.command,
        "worker_command": shlex.join([sys.executable, *sys.argv]), "scale": args.scale,
        "llm_kwargs": kwargs, "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_")},
        "vllm_version": None, "gpu": None, "engine_start_s": None, "kv_cache": None,
        "workloads": {w.name: {**asdict(w), "status": "pending"} for w in workloads},
    }
    if prev is not None:  # a fresh engine for the workloads the previous one did not finish
        rec["status"] = "starting"
        rec["restarts"] = rec.get("restarts", 0) + 1
        for w in workloads:
            if rec["workloads"][w.name]["status"] not in FINAL_STATUSES:
                rec["workloads"][w.name] = {**asdict(w), "status": "pending"}
    todo = [w for w in workloads if rec["workloads"][w.name]["status"] == "pending"]
    save_json(path, rec)
    import vllm

    rec["vllm_version"] = vllm.__version__
    t0 = time.perf_counter()
    try:
        llm = vllm.LLM(**kwargs)
    except Exception:
        rec.update(status="engine_error", error=traceback.format_exc()[-LOG_TAIL_CHARS:])
        save_json(path, rec)
        return 1
    rec.setdefault("engine_starts_s", []).append(time.perf_counter() - t0)
    rec.update(engine_start_s=rec["engine_starts_s"][0], gpu=gpu_name(), status="running")
    try:
        rec["kv_cache"] = kv_cache_summary(*engine_kv_cache_config(llm))
    except Exception as e:
        rec["kv_cache"] = {"error": error_text(e)}
    rec["async_scheduling"] = bool(llm.llm_engine.vllm_config.scheduler_config.async_scheduling)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    save_json(path, rec)
    try:
        run_workload(llm, Workload("warmup", "decode", 1, 16, 4), vocab)
    except Exception as e:
        rec["warmup_error"] = error_text(e)
    for w in todo:
        entry = rec["workloads"][w.name]
        entry["status"] = "running"
        save_json(path, rec)
        print(f"[{args.impl}] {w.name}: {w.batch} x {w.prompt_len} -> {w.max_tokens}", flush=True)
        try:
            if w.kind != "stress":
                entry["warmup_s"] = warm_up(llm, w, vocab)
            entry.update(run_workload(llm, w, vocab), status="ok")
        except Exception as e:
            entry.update(status="error", error=error_text(e))
        print(f"[{args.impl}] {w.name}: {json.dumps(entry)}", flush=True)
        if entry["status"] == "error" and w is not todo[-1]:
            rec["status"] = "stopped"
            save_json(path, rec)
            return EXIT_STOPPED
        save_json(path, rec)
    rec["status"] = "done"
    rec["decode_graphs"] = decode_graphs(llm) if args.impl == "plugin" else None
    save_json(path, rec)
    return 0


def decode_graphs(llm) -> dict[str, Any]:
    """The plugin's captured decode graphs: the (batch, context) keys and why capture failed, if it did; under
    ``mixed``, the same for its mixed-step graphs, with every key run (``seen``)."""
    try:
        def state(model):
            g, m = getattr(model, "_graphs", None), getattr(model, "_mixed", None)
            if g is None:
                return None
            mixed = None if m is None else {"failed": m.failed, "captured": sorted(m.entries),
                                            "seen": sorted(m.entries_seen)}
            return {"failed": g.failed, "captured": sorted(g.entries), "mixed": mixed}
        return llm.apply_model(state)[0] or {"failed": "decode graphs off", "captured": []}
    except Exception as e:
        return {"failed": error_text(e), "captured": []}


# ---------------------------------------------------------------------------------------------
# driver: one worker subprocess per impl, crash/timeout bookkeeping, merged results


def log_tail(path: Path) -> str:
    try:
        return path.read_bytes()[-LOG_TAIL_CHARS:].decode(errors="replace")
    except OSError:
        return ""


def describe_exit(returncode: int | None, reason: str | None) -> str:
    if reason:
        return reason
    if returncode is not None and returncode < 0:
        return f"killed by signal {signal.Signals(-returncode).name}"
    return f"exit code {returncode}"


def kill_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM the worker's process group, SIGKILL it if still there after ``grace_s``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue


def finalize(path: Path, impl: str, returncode: int | None, reason: str | None, log: Path) -> dict:
    """Fold the worker's fate into its JSON: a running workload becomes crashed/timeout, pending ones
    not_run (a resumed worker runs those)."""
    rec = load_json(path) or {"impl": impl, "status": "starting", "workloads": {}}
    exit_desc = describe_exit(returncode, reason)
    rec["exit"] = {"returncode": returncode, "description": exit_desc}
    if rec["status"] != "done":
        tail = log_tail(log)
        rec["log_tail"] = tail
        if rec["status"] not in ("engine_error", "stopped"):
            rec["status"] = "timeout" if reason and reason.startswith("timeout") else "crashed"
        for entry in rec["workloads"].values():
            if entry["status"] == "running":
                entry.update(status=rec["status"] if rec["status"] in CRASH_STATUSES else "crashed",
                             error=exit_desc, log_tail=tail)
            elif entry["status"] == "pending":
                entry["status"] = "not_run"
    save_json(path, rec)
    return rec


#: Seconds an engine restart needs at least to be worth starting (engine start + one workload).
MIN_RESTART_S = 120.0


def run_impl(impl: str, args: argparse.Namespace, command: str) -> tuple[dict, bool]:
    """Run one impl's workers to the end; returns its record and whether the user interrupted.

    A worker that crashed, or stopped after a workload raised, is followed by a fresh one (fresh engine)
    for the workloads not run yet, while the impl's time lasts; its log goes to ``<impl>.<n>.log``."""
    out = Path(args.out)
    path = out / f"{impl}.json"
    path.unlink(missing_ok=True)
    deadline = time.monotonic() + args.timeout_per_impl
    cmd = [sys.executable, str(Path(__file__).resolve()), "worker", "--impl", impl,
           "--model", args.model, "--out", str(out), "--scale", args.scale, "--command", command,
           "--llm-args", getattr(args, f"{impl}_llm_args")]
    if args.only:
        cmd += ["--only", args.only]
    for n in itertools.count():
        log = out / (f"{impl}.log" if n == 0 else f"{impl}.{n}.log")
        print(f"[{impl}] worker started, log: {log}", flush=True)
        reason, interrupted = None, False
        left = deadline - time.monotonic()
        with open(log, "wb") as logf:
            proc = subprocess.Popen(cmd + (["--resume"] if n else []), env=worker_env(impl), stdout=logf,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                proc.wait(timeout=left)
            except subprocess.TimeoutExpired:
                reason = f"timeout after {args.timeout_per_impl:.0f} s (process group killed)"
                kill_group(proc)
            except KeyboardInterrupt:
                reason, interrupted = "interrupted (process group killed)", True
                kill_group(proc)
        rec = finalize(path, impl, proc.returncode, reason, log)
        print(f"[{impl}] {rec['status']} ({rec['exit']['description']})", flush=True)
        rest = [w for w in rec["workloads"].values() if w["status"] == "not_run"]
        if (interrupted or reason or rec["status"] not in ("crashed", "stopped") or not rest
                or deadline - time.monotonic() < MIN_RESTART_S):
            return rec, interrupted


def load_impl_records(paths: list[Path]) -> dict[str, dict]:
    recs = {}
    for p in paths:
        rec = load_json(p)
        if rec is None:
            raise SystemExit(f"cannot read {p}")
        recs[rec["impl"]] = rec
    return recs


def run_main(args: argparse.Namespace) -> int:
    impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    if not impls or set(impls) - set(IMPLS):
        raise SystemExit(f"--impls must name some of {IMPLS}, got {args.impls!r}")
    select_workloads(args.scale, args.only)  # fail on unknown names before any engine starts
    for impl in IMPLS:
        json.loads(getattr(args, f"{impl}_llm_args"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = shlex.join([sys.executable, *sys.argv])
    for impl in impls:
        _, interrupted = run_impl(impl, args, command)
        if interrupted:
            break
    recs = load_impl_records([p for p in (out / f"{i}.json" for i in IMPLS) if p.exists()])
    save_json(out / "results.json", {"command": command, "date_utc": utc_now(), "impls": recs})
    table = render_table(recs)
    (out / "table.md").write_text(table)
    print(table)
    return 0


# ---------------------------------------------------------------------------------------------
# table


def _workload(rec: dict | None, name: str) -> dict | None:
    return None if rec is None else rec.get("workloads", {}).get(name)


def _tok_s(rec: dict | None, name: str) -> float | None:
    w = _workload(rec, name)
    return w["tok_s"] if w and w.get("status") == "ok" else None


def _global_kv(rec: dict | None) -> float | None:
    kv = (rec or {}).get("kv_cache") or {}
    return kv.get("global_bytes_per_token")


def _fmt(x: float | None, digits: int = 1) -> str:
    return "—" if x is None else f"{x:,.{digits}f}"


def _ratio(plugin: float | None, builtin: float | None) -> float | None:
    return plugin / builtin if plugin is not None and builtin else None


def _yes_no(ok: bool | None) -> str:
    return "—" if ok is None else ("yes" if ok else "no")


def _status_cell(rec: dict | None, name: str) -> str:
    w = _workload(rec, name)
    if rec is None or w is None:
        return "—"
    return w["status"] if w["status"] != "error" else f"error: {w.get('error', '')[:60]}"


def _value_cell(rec: dict | None, name: str, v: float | None) -> str:
    if v is None:
        return _status_cell(rec, name)
    if name == "prefill_32k":
        return f"{v:,.0f} ({_workload(rec, name)['wall_s']:.2f} s)"
    return _fmt(v)


def _compare_row(metric: str, cells: tuple[str, str], vb: float | None, vp: float | None,
                 target: str, met: bool | None) -> list[str]:
    r = _ratio(vp, vb)
    return [metric, *cells, "—" if r is None else f"{r:.2f}x", target, _yes_no(met)]


def _stress_met(w: dict | None) -> bool | None:
    """Served without a crash and without an error (a failed request counts: the target is that every
    size is served)."""
    if w is None or w["status"] in ("pending", "not_run", "running"):
        return None
    return w["status"] == "ok"


def table_rows(recs: dict[str, dict]) -> list[list[str]]:
    """[metric, builtin, plugin, ratio plugin/builtin, target, met?] rows."""
    b, p = recs.get("builtin"), recs.get("plugin")
    rows = []
    for name in ("decode_b1", "decode_b16", "decode_b64", "prefill_32k"):
        vb, vp = _tok_s(b, name), _tok_s(p, name)
        target, r = RATIO_TARGETS.get(name), _ratio(vp, vb)
        metric = f"{name} tok/s" + (" (s)" if name == "prefill_32k" else "")
        rows.append(_compare_row(metric, (_value_cell(b, name, vb), _value_cell(p, name, vp)), vb, vp,
                                 f"≥ {target}x" if target else "—",
                                 None if target is None or r is None else r >= target))
    stress = [n for rec in (b, p) if rec for n, w in rec["workloads"].items() if w["kind"] == "stress"]
    for name in dict.fromkeys(stress):
        rows.append([name.replace("_", " "), _status_cell(b, name), _status_cell(p, name), "—",
                     "no crash (plugin)", _yes_no(_stress_met(_workload(p, name)))])
    kb, kp = _global_kv(b), _global_kv(p)
    rows.append(_compare_row("global KV B/token", (_fmt(kb), _fmt(kp)), kb, kp,
                             f"≤ {KV_LIMIT_BYTES_PER_TOKEN} (plugin)",
                             None if kp is None else kp <= KV_LIMIT_BYTES_PER_TOKEN))
    sb, sp = ((rec or {}).get("engine_start_s") for rec in (b, p))
    rows.append(_compare_row("engine start s", (_fmt(sb), _fmt(sp)), sb, sp, "—", None))
    return rows


def _md_table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def _per_impl(recs: dict[str, dict], key: str) -> str:
    return "; ".join(f"{i}: {recs[i].get(key) or '—'}" for i in IMPLS if i in recs) or "—"


def render_table(recs: dict[str, dict]) -> str:
    lines = ["# DeepSeek-V4.1: our plugin vs vLLM built-in, side by side", "",
             f"- rendered: {utc_now()}; runs: {_per_impl(recs, 'date_utc')}",
             f"- GPU: {_per_impl(recs, 'gpu')}",
             f"- vLLM: {_per_impl(recs, 'vllm_version')}"]
    warmed = [i for i in IMPLS if i in recs and any("warmup_s" in w for w in recs[i].get("workloads", {}).values())]
    lines.append(f"- throughput timed after an untimed warm-up run of each workload's shape: "
                 f"{', '.join(warmed) or 'none'} (earlier runs of this tool timed the first run)")
    for impl in IMPLS:
        rec = recs.get(impl)
        if rec is None:
            lines.append(f"- {impl}: — (no results)")
            continue
        graphs = rec.get("decode_graphs")
        lines += [f"- {impl}: status {rec.get('status')}"
                  + (f" ({rec['exit']['description']})" if rec.get("exit") and rec["status"] != "done" else "")
                  + (f"; engine restarted {rec['restarts']}x after a failed workload" if rec.get("restarts") else ""),
                  f"  - command: `{rec.get('command')}`",
                  f"  - LLM kwargs: `{json.dumps(rec.get('llm_kwargs'), sort_keys=True)}`"]
        if graphs:
            lines.append(f"  - decode CUDA graphs: {len(graphs['captured'])} captured"
                         + (f"; capture failed: {graphs['failed'].splitlines()[0][:200]}" if graphs["failed"] else ""))
        mixed = (graphs or {}).get("mixed")
        if mixed:
            lines.append(f"  - mixed-step CUDA graphs: {len(mixed['captured'])} captured of {len(mixed['seen'])} "
                         "keys run"
                         + (f"; capture failed: {mixed['failed'].splitlines()[0][:200]}" if mixed["failed"] else ""))
    lines += [""] + _md_table(["metric", "builtin", "plugin", "ratio plugin/builtin", "target", "met?"],
                              table_rows(recs))
    lines += ["", "## KV cache groups (engine)", ""]
    rows = []
    for impl in IMPLS:
        kv = (recs.get(impl) or {}).get("kv_cache") or {}
        if "error" in kv:
            rows.append([impl, f"error: {kv['error']}", "", "", "", "", ""])
        for g in kv.get("groups", []):
            rows.append([impl, g["spec"], g["kind"], g["layers"], g["block_size"], g["tokens_per_state"],
                         _fmt(g["bytes_per_token"]) if g["kind"] == "global" else "—"])
        if kv.get("groups"):
            rows.append([impl, f"pool {kv['pool_bytes'] / 2**30:.2f} GiB, {kv['num_blocks']} blocks",
                         "", "", "", "", _fmt(kv["global_bytes_per_token"])])
    lines += _md_table(["impl", "spec", "kind", "layers", "block", "tokens/state", "global B/token"], rows)
    return "\n".join(lines) + "\n"


def table_main(args: argparse.Namespace) -> int:
    table = render_table(load_impl_records([Path(p) for p in args.files]))
    if args.out:
        Path(args.out).write_text(table)
    print(table)
    return 0


# ---------------------------------------------------------------------------------------------
# command line


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="run the impls one after the other, then write the table")
    run.add_argument("--model", required=True)
    run.add_argument("--impls", default="plugin,builtin")
    run.add_argument("--out", required=True)
    run.add_argument("--scale", choices=sorted(SCALES), default="full")
    run.add_argument("--only", default=None, help="comma-separated workload names ('stress' = all pairs)")
    run.add_argument("--plugin-llm-args", default="{}", help="JSON of extra LLM kwargs for the plugin")
    run.add_argument("--builtin-llm-args", default="{}", help="JSON of extra LLM kwargs for the built-in")
    run.add_argument("--timeout-per-impl", type=float, default=3600.0)
    worker = sub.add_parser("worker", help="(internal) one impl's engine and workloads")
    worker.add_argument("--impl", choices=IMPLS, required=True)
    worker.add_argument("--model", required=True)
    worker.add_argument("--out", required=True)
    worker.add_argument("--scale", choices=sorted(SCALES), default="full")
    worker.add_argument("--only", default=None)
    worker.add_argument("--llm-args", default="{}")
    worker.add_argument("--command", default="")
    worker.add_argument("--resume", action="store_true",
                        help="keep OUT/<impl>.json's finished workloads, run the others on a fresh engine")
    table = sub.add_parser("table", aliases=["merge"], help="render the table from per-impl JSON files")
    table.add_argument("files", nargs="+")
    table.add_argument("--out", default=None)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd == "run":
        return run_main(args)
    if args.cmd == "worker":
        rc = worker_main(args)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)  # skip engine teardown: everything measured is already on disk
    return table_main(args)


if __name__ == "__main__":
    sys.exit(main())
