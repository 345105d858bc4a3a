"""``vllm-dsv41-bench``: throughput per GPU against interactivity for any
OpenAI-compatible server.

    vllm-dsv41-bench sweep --url http://127.0.0.1:8000 --workload agentic \\
        --concurrency 1,2,4,8,16,32,64 --num-requests 256 --gpus 1 --out runs/ours
    vllm-dsv41-bench compare runs/ours/results.json runs/builtin/results.json \\
        --out runs/compare.png

``sweep`` replays a seeded workload (``agentic`` multi-turn sessions with
prefix reuse, or fixed-length ``random`` prompts) at each concurrency, records
TTFT and inter-token latencies of every request, and writes ``results.json``,
``results.csv`` and ``pareto.png`` under ``--out``.  ``compare`` overlays
several result files and prints the ratio table at the target interactivity.
See docs/benchmarks.md.

Exit codes: 0 done; 1 every request failed; 2 usage error or unreachable
server; 130 interrupted (partial results written).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import datetime as _dt
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

SCHEMA = "vllm-dsv41-bench/1"
DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_CONCURRENCY = "1,2,4,8,16,32,64"


class UsageError(Exception):
    """Bad arguments or unusable server: exit code 2 with a one-line message."""


# ---------------------------------------------------------------------------
# argument parsing


def _int_list(text: str) -> list[int]:
    try:
        vals = [int(x) for x in str(text).replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    out: list[int] = []
    for v in vals:  # keep order, drop duplicates (a repeated level would hit the cache)
        if v not in out:
            out.append(v)
    return out


def _range(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO,HI, got {text!r}")
    if not 0 <= lo < hi:
        raise argparse.ArgumentTypeError(f"need 0 <= LO < HI, got {text!r}")
    return lo, hi


def _json_obj(text: str) -> dict:
    try:
        obj = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"invalid JSON: {exc}")
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return obj


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="vllm-dsv41-bench",
        description="Throughput/GPU vs interactivity sweeps for OpenAI-compatible servers.")
    sub = ap.add_subparsers(dest="cmd")

    sw = sub.add_parser("sweep", help="run a concurrency sweep against one server",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = sw.add_argument_group("server")
    g.add_argument("--url", default=DEFAULT_URL, help="base URL of the server (…/v1 accepted)")
    g.add_argument("--model", default=None, help="model name (default: first of GET /v1/models)")
    g.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    g.add_argument("--serve-cmd", default=None,
                   help="shell command that starts the server; it is run in its own process "
                        "group, awaited on GET /v1/models, killed at the end; log in OUT/server.log")
    g.add_argument("--server-timeout", type=float, default=900.0,
                   help="seconds to wait for --serve-cmd's server to come up")
    g.add_argument("--request-timeout", type=float, default=1800.0, help="seconds per request")

    g = sw.add_argument_group("sweep")
    g.add_argument("--workload", choices=["agentic", "random"], default="agentic")
    g.add_argument("--concurrency", type=_int_list, default=DEFAULT_CONCURRENCY,
                   help="comma-separated concurrencies (agentic: sessions in flight)")
    g.add_argument("--num-requests", type=int, default=256, help="requests per concurrency")
    g.add_argument("--gpus", type=float, default=1.0, help="GPUs behind the server")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--target-tps-per-user", type=float, default=150.0,
                   help="interactivity (tok/s/user) at which throughput/GPU is read")
    g.add_argument("--interactivity-stat", choices=["median", "p90"], default="median",
                   help="per-level interactivity used for the frontier (p90 = what 90%% of "
                        "requests met)")
    g.add_argument("--warmup-requests", type=int, default=0,
                   help="short unrecorded requests sent before the first level")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--label", default=None, help="name in plots and compare tables")
    g.add_argument("--out", default="bench-results", help="output directory")

    g = sw.add_argument_group("tokens")
    g.add_argument("--vocab-size", type=int, default=1000,
                   help="prompt ids are drawn from [100, vocab-100) unless --vocab-range")
    g.add_argument("--vocab-range", type=_range, default=None, help="LO,HI: ids in [LO, HI)")
    g.add_argument("--input-len", type=int, default=4096, help="random: prompt tokens")
    g.add_argument("--output-len", type=int, default=1024, help="random: output tokens")

    g = sw.add_argument_group("agentic workload")
    g.add_argument("--shared-prefix-len", type=int, default=2048,
                   help="tokens shared by every session of a level (system prompt, tools)")
    g.add_argument("--first-turn-len", type=int, default=4096,
                   help="median new tokens in a session's first turn")
    g.add_argument("--turn-input-len", type=int, default=1024,
                   help="median new user/tool tokens per later turn")
    g.add_argument("--turn-output-len", type=int, default=512, help="median output per turn")
    g.add_argument("--turns", type=int, default=8, help="median turns per session")
    g.add_argument("--max-turns", type=int, default=32)
    g.add_argument("--len-sigma", type=float, default=0.6, help="lognormal sigma of lengths")
    g.add_argument("--turns-sigma", type=float, default=0.5, help="lognormal sigma of turns")
    g.add_argument("--max-context", type=int, default=65536,
                   help="a session ends before prompt+output would exceed this")
    g.add_argument("--think-time-scale", type=float, default=1.0,
                   help="mean seconds of exponential think time between turns (0: none)")
    g.add_argument("--feedback", choices=["returned", "synthetic"], default="returned",
                   help="next turn's context uses the returned output ids (return_token_ids) "
                        "or deterministic stand-ins of the same length")

    g = sw.add_argument_group("output")
    g.add_argument("--no-save-itls", action="store_true",
                   help="do not keep every request's ITL list in results.json")
    g.add_argument("--no-progress", action="store_true", help="no progress bars")
    g.add_argument("--continuous-usage-stats", action="store_true",
                   help="ask for usage on every chunk (exact token counts when the server "
                        "does not return token ids)")
    g.add_argument("--no-return-token-ids", action="store_true",
                   help="do not send vLLM's return_token_ids")
    g.add_argument("--extra-body", type=_json_obj, default={},
                   help="JSON object merged into every request body")

    cp = sub.add_parser("compare", help="overlay result files; ratio table at the target",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    cp.add_argument("results", nargs="+", help="results.json files (or their directories)")
    cp.add_argument("--labels", default=None, help="comma-separated labels (default: from runs)")
    cp.add_argument("--target-tps-per-user", type=float, default=None,
                    help="default: the first run's target")
    cp.add_argument("--interactivity-stat", choices=["median", "p90"], default=None,
                    help="default: the first run's")
    cp.add_argument("--out", default="compare.png", help="PNG path")
    cp.add_argument("--json", default=None, help="also write the table as JSON here")
    return ap


# ---------------------------------------------------------------------------
# server process management


def process_group_alive(pgid: int) -> bool:
    """Whether any non-zombie process is left in process group ``pgid``."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    proc_dir = Path("/proc")
    if not proc_dir.is_dir():
        return True
    for stat in proc_dir.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and fields[0] != "Z" and int(fields[2]) == pgid:
            return True
    return False


class ManagedServer:
    """A server started from ``--serve-cmd`` in its own process group."""

    def __init__(self, cmd: str, log_path: Path) -> None:
        self.cmd = cmd
        self.log_path = log_path
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(cmd, shell=True, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)

    def exited(self) -> int | None:
        return self.proc.poll()

    def log_tail(self, n: int = 15) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def _group_alive(self) -> bool:
        return process_group_alive(self.proc.pid)

    def stop(self, grace: float = 30.0) -> None:
        """SIGTERM the whole process group (the shell, the server and e.g.
        vLLM's engine-core workers), wait for every member to exit, then
        SIGKILL what is left."""
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
            if not self._group_alive():
                break
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            except PermissionError:
                pass
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                self.proc.poll()  # reap the leader
                if not self._group_alive():
                    break
                time.sleep(0.05)
        try:
            self.proc.wait(1.0)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()


# ---------------------------------------------------------------------------
# the sweep


@dataclass
class _RunState:
    interrupted: bool = False
    tasks: list = field(default_factory=list)

    def interrupt(self) -> None:
        if not self.interrupted:
            self.interrupted = True
            for t in self.tasks:
                t.cancel()


def _strip(rec: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in rec.items() if not k.startswith("_")}


class _Progress:
    def __init__(self, total: int, desc: str, enabled: bool) -> None:
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, desc=desc, unit="req", leave=False,
                                dynamic_ncols=True, file=sys.stderr, disable=None)
            except ImportError:
                self.bar = None
        self.failed = 0

    def update(self, rec: dict[str, Any]) -> None:
        if rec.get("status") == "failed":
            self.failed += 1
        if self.bar is not None:
            self.bar.update(1)
            if self.failed:
                self.bar.set_postfix(failed=self.failed, refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


async def _run_level(args, session, cfg, workload, conc: int, state: _RunState,
                     records: list[dict[str, Any]]) -> tuple[float, bool]:
    """Run one concurrency level; appends records as requests finish.
    Returns (wall time, interrupted)."""
    from vllm_dsv41.tools.bench_client import stream_completion

    n_total = int(args.num_requests)
    issued = 0
    next_session = 0
    progress = _Progress(n_total, f"c={conc}", not args.no_progress)
    t_level = time.perf_counter()

    def take() -> int | None:
        nonlocal issued
        if issued >= n_total or state.interrupted:
            return None
        issued += 1
        return issued - 1

    async def one(prompt: list[int], max_tokens: int, meta: dict[str, Any]) -> dict[str, Any]:
        t_start = time.perf_counter() - t_level
        try:
            rec = await stream_completion(session, cfg, prompt, max_tokens)
        except asyncio.CancelledError:
            rec = {"status": "cancelled", "error": "cancelled (interrupted)",
                   "prompt_tokens": len(prompt), "max_tokens": max_tokens, "output_tokens": 0}
            records.append({"concurrency": conc, **meta, "start_s": t_start, **rec})
            raise
        out = {"concurrency": conc, **meta, "start_s": round(t_start, 6), **rec}
        records.append(out)
        progress.update(out)
        return out

    async def random_worker() -> None:
        while (i := take()) is not None:
            prompt = workload.prompt(conc, i)
            await one(prompt, workload.output_len,
                      {"index": i, "session": i, "turn": 0, "prefix_len": 0, "think_time_s": 0.0})

    async def agentic_worker() -> None:
        nonlocal next_session
        while issued < n_total and not state.interrupted:
            s_idx = next_session
            next_session += 1
            sess = workload.session(conc, s_idx)
            for k, turn in enumerate(sess.plan.turns):
                i = take()  # reserve the turn before thinking: no idle tail at the end
                if i is None:
                    return
                if k and turn.think_time_s > 0:
                    await asyncio.sleep(turn.think_time_s)
                prompt = sess.prompt(k)
                rec = await one(prompt, turn.output_len,
                                {"index": i, "session": s_idx, "turn": k,
                                 "prefix_len": sess.last_prefix_len,
                                 "think_time_s": round(turn.think_time_s, 6)})
                if rec["status"] != "ok":
                    break  # the context is unknown after a failure: start a new session
                ids = rec.get("_output_ids") if args.feedback == "returned" else None
                rec["feedback"] = sess.record_output(k, ids)
                rec.pop("_output_ids", None)

    worker = agentic_worker if args.workload == "agentic" else random_worker
    tasks = [asyncio.ensure_future(worker()) for _ in range(conc)]
    state.tasks = tasks
    if state.interrupted:
        for t in tasks:
            t.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    state.tasks = []
    wall = time.perf_counter() - t_level
    progress.close()
    for r in results:
        if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError):
            raise r
    for r in records:
        r.pop("_output_ids", None)
    return wall, state.interrupted


def _fmt(v: Any, spec: str = ".1f") -> str:
    if v is None:
        return "-"
    try:
        return format(v, spec)
    except (TypeError, ValueError):
        return str(v)


TABLE_COLS = [("conc", "concurrency", "d"), ("ok", "completed", "d"), ("fail", "failed", "d"),
              ("out tok/s", "output_throughput_tok_s", ".1f"),
              ("tok/s/GPU", "output_throughput_per_gpu", ".1f"),
              ("inter p50", "interactivity_median", ".1f"), ("inter p90", "interactivity_p90", ".1f"),
              ("TTFT p50 ms", "ttft_p50_ms", ".0f"), ("TTFT p99 ms", "ttft_p99_ms", ".0f")]


def format_table(levels: Sequence[dict[str, Any]]) -> str:
    head = [c[0] for c in TABLE_COLS]
    rows = [[_fmt(s.get(k), spec) + ("*" if k == "concurrency" and s.get("partial") else "")
             for _, k, spec in TABLE_COLS] for s in levels]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_outputs(out: Path, result: dict[str, Any], plot: bool = True) -> None:
    from vllm_dsv41.tools.bench_stats import SUMMARY_FIELDS

    out.mkdir(parents=True, exist_ok=True)
    _atomic_write(out / "results.json", json.dumps(result, indent=1) + "\n")
    tmp = out / "results.csv.tmp"
    with open(tmp, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(SUMMARY_FIELDS + ["top_failure_reason"])
        for s in result["levels"]:
            reasons = s.get("failure_reasons") or {}
            top = next(iter(reasons), "")
            w.writerow([("" if s.get(k) is None else s.get(k)) for k in SUMMARY_FIELDS] + [top])
    os.replace(tmp, out / "results.csv")
    if plot:
        from vllm_dsv41.tools.bench_plot import plot_frontiers

        cfg = result["config"]
        title = (f"{cfg.get('label') or cfg.get('model')} - {cfg['workload']} workload, "
                 f"{_fmt(cfg.get('gpus'), 'g')} GPU(s)")
        plot_frontiers([(cfg.get("label") or cfg.get("model") or "run", result["pareto"])],
                       result["pareto"]["target_tps_per_user"], str(out / "pareto.png"), title)


def _make_workload(args):
    from vllm_dsv41.tools.bench_workload import (AgenticWorkload, RandomWorkload,
                                                 default_vocab_range)

    vocab = args.vocab_range or default_vocab_range(args.vocab_size)
    if args.workload == "random":
        return RandomWorkload(args.input_len, args.output_len, vocab, args.seed)
    return AgenticWorkload(
        vocab=vocab, seed=args.seed, shared_prefix_len=args.shared_prefix_len,
        first_turn_len=args.first_turn_len, turn_input_len=args.turn_input_len,
        turn_output_len=args.turn_output_len, turns=args.turns, max_turns=args.max_turns,
        len_sigma=args.len_sigma, turns_sigma=args.turns_sigma, max_context=args.max_context,
        think_time_scale=args.think_time_scale)


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


async def _wait_ready(session, base_url: str, api_key, server: ManagedServer | None,
                      timeout: float, state: _RunState) -> list[str]:
    from vllm_dsv41.tools.bench_client import ServerUnreachable, list_models

    if server is None:
        return await list_models(session, base_url, api_key)
    deadline = time.monotonic() + timeout
    last = ""
    while not state.interrupted:
        rc = server.exited()
        if rc is not None:
            raise UsageError(f"--serve-cmd exited with code {rc} before {base_url} came up; "
                             f"log {server.log_path}:\n{server.log_tail()}")
        try:
            return await list_models(session, base_url, api_key, timeout=5.0)
        except (ServerUnreachable, RuntimeError) as exc:
            last = str(exc)
        if time.monotonic() > deadline:
            raise UsageError(f"server at {base_url} not ready after {timeout:g}s ({last}); "
                             f"log {server.log_path}")
        try:
            await asyncio.sleep(0.5)
        except asyncio.CancelledError:
            break
    raise asyncio.CancelledError


async def _sweep(args, state: _RunState) -> int:
    import aiohttp

    from vllm_dsv41.tools.bench_client import (ClientConfig, ServerUnreachable, list_models,
                                               normalize_base_url, stream_completion)
    from vllm_dsv41.tools.bench_stats import frontier_report, summarize_level
    from vllm_dsv41.tools.bench_workload import default_vocab_range, warmup_prompt

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        workload = _make_workload(args)
    except ValueError as exc:
        raise UsageError(str(exc))
    if args.num_requests < 1 or args.gpus <= 0:
        raise UsageError("--num-requests must be >= 1 and --gpus > 0")
    base_url = normalize_base_url(args.url)

    server = None
    if args.serve_cmd:
        _say(f"starting server: {args.serve_cmd}  (log: {out / 'server.log'})")
        server = ManagedServer(args.serve_cmd, out / "server.log")
    try:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
        async with aiohttp.ClientSession(connector=connector) as session:
            try:
                models = await _wait_ready(session, base_url, args.api_key, server,
                                           args.server_timeout, state)
            except asyncio.CancelledError:
                _say("interrupted while waiting for the server")
                return 130
            except ServerUnreachable as exc:
                raise UsageError(f"server unreachable at {base_url}: {exc}")
            except RuntimeError as exc:
                if not args.model:
                    raise UsageError(f"server at {base_url} failed: {exc}")
                _say(f"warning: {exc}")
                models = []
            model = args.model or (models[0] if models else None)
            if not model:
                raise UsageError(f"server at {base_url} lists no models; pass --model")
            if args.model and models and args.model not in models:
                _say(f"warning: --model {args.model!r} not in /v1/models {models}")

            cfg = ClientConfig(base_url=base_url, model=model, api_key=args.api_key,
                               request_timeout=args.request_timeout,
                               temperature=args.temperature,
                               return_token_ids=not args.no_return_token_ids,
                               continuous_usage_stats=args.continuous_usage_stats,
                               save_itls=not args.no_save_itls, extra_body=args.extra_body)
            config = {
                "url": base_url, "model": model, "label": args.label or model,
                "workload": args.workload, "workload_params": workload.describe(),
                "concurrencies": list(args.concurrency), "num_requests": args.num_requests,
                "gpus": args.gpus, "seed": args.seed,
                "target_tps_per_user": args.target_tps_per_user,
                "interactivity_stat": args.interactivity_stat,
                "temperature": args.temperature, "feedback": args.feedback,
                "return_token_ids": cfg.return_token_ids,
                "extra_body": args.extra_body, "serve_cmd": args.serve_cmd,
                "warmup_requests": args.warmup_requests,
                "argv": args._argv,
            }
            result: dict[str, Any] = {
                "schema": SCHEMA, "status": "running",
                "started": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                "finished": None, "config": config, "server_models": models,
                "levels": [], "pareto": frontier_report([], args.target_tps_per_user,
                                                        args.interactivity_stat),
                "requests": [],
            }

            if args.warmup_requests > 0 and not state.interrupted:
                vocab = args.vocab_range or default_vocab_range(args.vocab_size)
                _say(f"warmup: {args.warmup_requests} requests")
                warm = [asyncio.ensure_future(stream_completion(
                    session, cfg, warmup_prompt(args.seed, i, vocab), 16))
                    for i in range(args.warmup_requests)]
                state.tasks = warm
                wres = await asyncio.gather(*warm, return_exceptions=True)
                state.tasks = []
                bad = [r for r in wres if isinstance(r, dict) and r["status"] != "ok"]
                if bad:
                    _say(f"warning: {len(bad)} warmup request(s) failed: {bad[0]['error']}")

            rc = 0
            for conc in args.concurrency:
                if state.interrupted:
                    break
                records: list[dict[str, Any]] = []
                cpu0 = time.process_time()
                wall, interrupted = await _run_level(args, session, cfg, workload, conc, state,
                                                     records)
                cpu = time.process_time() - cpu0
                records.sort(key=lambda r: (r.get("index", 0)))
                summary = summarize_level(records, concurrency=conc, wall_time_s=wall,
                                          gpus=args.gpus, partial=interrupted, client_cpu_s=cpu)
                result["levels"].append(summary)
                result["requests"].extend(_strip(r) for r in records)
                result["pareto"] = frontier_report(result["levels"], args.target_tps_per_user,
                                                   args.interactivity_stat)
                _report_level(summary)
                write_outputs(out, result, plot=False)
                if summary["num_requests"] and summary["completed"] == 0 and not interrupted:
                    try:  # did the server go away?
                        await list_models(session, base_url, args.api_key)
                    except ServerUnreachable as exc:
                        _say(f"error: server at {base_url} became unreachable at "
                             f"concurrency {conc}: {exc}")
                        result["status"] = "aborted"
                        rc = 2
                        break
                    except RuntimeError:
                        pass
            if state.interrupted:
                result["status"] = "interrupted"
                rc = 130
            elif result["status"] == "running":
                result["status"] = "complete"
                total_ok = sum(s["completed"] for s in result["levels"])
                if total_ok == 0:
                    _say("error: every request failed; see failure_reasons in results.json")
                    rc = 1
            result["finished"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
            write_outputs(out, result, plot=True)
            _final_report(result, out)
            return rc
    finally:
        if server is not None:
            _say("stopping server")
            server.stop()


def _report_level(s: dict[str, Any]) -> None:
    msg = (f"c={s['concurrency']}: {s['completed']} ok, {s['failed']} failed"
           f"{', %d cancelled' % s['cancelled'] if s['cancelled'] else ''}; "
           f"{_fmt(s['output_throughput_per_gpu'])} tok/s/GPU, "
           f"interactivity p50 {_fmt(s['interactivity_median'])} tok/s/user, "
           f"TTFT p50 {_fmt(s['ttft_p50_ms'], '.0f')} ms")
    _say(msg)
    if (s.get("client_cpu_util") or 0.0) > 0.85:
        _say(f"warning: c={s['concurrency']}: the benchmark client used "
             f"{100 * s['client_cpu_util']:.0f}% of a CPU; its latencies may be inflated "
             f"(split the concurrency over several client processes/machines)")
    if s.get("completed") and s.get("requests_without_itl", 0) > 0.1 * s["completed"]:
        _say(f"warning: c={s['concurrency']}: {s['requests_without_itl']} request(s) delivered "
             f"all tokens in one burst (no inter-token latency); interactivity ignores them")
    if s["failed"]:
        reasons = "; ".join(f"{n}x {r}" for r, n in list(s["failure_reasons"].items())[:3])
        _say(f"warning: c={s['concurrency']}: {s['failed']}/{s['num_requests']} requests failed "
             f"({100 * s['failure_rate']:.1f}%): {reasons}")


def _final_report(result: dict[str, Any], out: Path) -> None:
    print(format_table(result["levels"]))
    p = result["pareto"]
    tgt = p["target_tps_per_user"]
    if p["throughput_per_gpu_at_target"] is not None:
        print(f"throughput at {tgt:g} tok/s/user: {p['throughput_per_gpu_at_target']:.1f} "
              f"tok/s/GPU")
    else:
        print(f"throughput at {tgt:g} tok/s/user: n/a ({p['reason']})")
    status = result["status"]
    print(f"[{status}] results: {out / 'results.json'}, {out / 'results.csv'}, "
          f"{out / 'pareto.png'}")


def _run_async(coro_fn, *a) -> int:
    """Run ``coro_fn(*a, state)`` with Ctrl-C turned into a clean interrupt:
    the first SIGINT cancels in-flight requests (partial results are written),
    a second one raises KeyboardInterrupt as usual."""
    state = _RunState()

    async def runner() -> int:
        loop = asyncio.get_running_loop()
        installed = False

        def on_sigint() -> None:
            _say("\ninterrupted: cancelling in-flight requests, writing partial results "
                 "(Ctrl-C again to abort)")
            state.interrupt()
            loop.remove_signal_handler(signal.SIGINT)

        try:
            loop.add_signal_handler(signal.SIGINT, on_sigint)
            installed = True
        except (NotImplementedError, RuntimeError, ValueError):
            pass  # not the main thread: Ctrl-C handling is the caller's
        try:
            return await coro_fn(*a, state)
        finally:
            if installed:
                loop.remove_signal_handler(signal.SIGINT)

    try:
        return asyncio.run(runner())
    except KeyboardInterrupt:
        return 130


# ---------------------------------------------------------------------------
# compare


def _load_result(path: str) -> tuple[str, dict[str, Any]]:
    p = Path(path)
    if p.is_dir():
        p = p / "results.json"
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read {p}: {exc}")
    if data.get("schema") != SCHEMA or "levels" not in data:
        raise UsageError(f"{p} is not a {SCHEMA} results file")
    return str(p), data


def compare_results(paths: Sequence[str], labels: Sequence[str] | None = None,
                    target: float | None = None, stat: str | None = None) -> dict[str, Any]:
    """Frontiers of several runs at one target; rows carry the ratio to the first."""
    from vllm_dsv41.tools.bench_stats import frontier_report

    loaded = [_load_result(p) for p in paths]
    first_cfg = loaded[0][1]["config"]
    target = float(target if target is not None else first_cfg.get("target_tps_per_user", 150.0))
    stat = stat or first_cfg.get("interactivity_stat", "median")
    if labels and len(labels) != len(loaded):
        raise UsageError(f"--labels has {len(labels)} names for {len(loaded)} results")
    rows = []
    for i, (p, data) in enumerate(loaded):
        cfg = data["config"]
        label = labels[i] if labels else (cfg.get("label") or cfg.get("model") or Path(p).parent.name)
        rep = frontier_report(data["levels"], target, stat)
        peak = max((pt["throughput_per_gpu"] for pt in rep["points"]), default=None)
        best_i = max((pt["interactivity"] for pt in rep["points"]), default=None)
        rows.append({"label": label, "path": p, "workload": cfg.get("workload"),
                     "seed": cfg.get("seed"), "gpus": cfg.get("gpus"),
                     "status": data.get("status"),
                     "throughput_per_gpu_at_target": rep["throughput_per_gpu_at_target"],
                     "reason": rep["reason"], "peak_throughput_per_gpu": peak,
                     "max_interactivity": best_i, "pareto": rep})
    base = rows[0]["throughput_per_gpu_at_target"]
    for r in rows:
        v = r["throughput_per_gpu_at_target"]
        r["ratio_to_first"] = (v / base) if (v is not None and base) else None
    warnings = []
    keys = {(r["workload"], r["seed"]) for r in rows}
    if len(keys) > 1:
        warnings.append("runs differ in workload or seed: "
                        + ", ".join(f"{r['label']}={r['workload']}/seed {r['seed']}" for r in rows))
    return {"target_tps_per_user": target, "interactivity_stat": stat, "rows": rows,
            "warnings": warnings}


def _compare_main(args) -> int:
    labels = [s for s in args.labels.split(",")] if args.labels else None
    cmp = compare_results(args.results, labels, args.target_tps_per_user,
                          args.interactivity_stat)
    from vllm_dsv41.tools.bench_plot import plot_frontiers

    target = cmp["target_tps_per_user"]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    plot_frontiers([(r["label"], r["pareto"]) for r in cmp["rows"]], target, str(out),
                   f"Throughput/GPU vs interactivity ({cmp['interactivity_stat']})")
    for w in cmp["warnings"]:
        _say(f"warning: {w}")
    head = ["run", f"tok/s/GPU @ {target:g}", "ratio", "peak tok/s/GPU", "max tok/s/user"]
    rows = [[r["label"], _fmt(r["throughput_per_gpu_at_target"]),
             _fmt(r["ratio_to_first"], ".2f") + ("x" if r["ratio_to_first"] is not None else ""),
             _fmt(r["peak_throughput_per_gpu"]), _fmt(r["max_interactivity"])]
            for r in cmp["rows"]]
    widths = [max(len(h), *(len(x[i]) for x in rows)) for i, h in enumerate(head)]
    print("  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(head, widths))))
    for x in rows:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(x, widths))))
    for r in cmp["rows"]:
        if r["throughput_per_gpu_at_target"] is None:
            print(f"note: {r['label']}: {r['reason']}")
    print(f"plot: {out}")
    if args.json:
        slim = {**cmp, "rows": [{k: v for k, v in r.items() if k != "pareto"} | {
            "frontier": r["pareto"]["frontier"]} for r in cmp["rows"]]}
        Path(args.json).write_text(json.dumps(slim, indent=1) + "\n")
    return 0


# ---------------------------------------------------------------------------
# entry points


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point; returns the exit code (callable from tests)."""
    parser = build_parser()
    argv = list(argv) if argv is not None else sys.argv[1:]
    args = parser.parse_args(argv)
    args._argv = argv
    if args.cmd is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        if args.cmd == "sweep":
            return _run_async(_sweep, args)
        return _compare_main(args)
    except UsageError as exc:
        _say(f"error: {exc}")
        return 2


def run_sweep_against(url: str, out_dir: str | os.PathLike, *, workload: str = "random",
                      concurrency: Sequence[int] = (1, 2), num_requests: int = 4,
                      extra_args: Sequence[str] = (), **options: Any) -> tuple[int, dict | None]:
    """Run ``sweep`` against ``url`` into ``out_dir`` and return
    ``(exit_code, results_json_or_None)``.

    ``options`` become flags: ``input_len=32`` -> ``--input-len 32``; ``True``
    -> a bare flag; ``False``/``None`` -> omitted.  Small defaults suit a tiny
    model on CPU."""
    argv = ["sweep", "--url", url, "--out", str(out_dir), "--workload", workload,
            "--concurrency", ",".join(str(c) for c in concurrency),
            "--num-requests", str(num_requests), "--no-progress"]
    for k, v in options.items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            argv.append(flag)
        elif v is not None and v is not False:
            argv += [flag, str(v)]
    argv += list(extra_args)
    rc = main(argv)
    path = Path(out_dir) / "results.json"
    return rc, (json.loads(path.read_text()) if path.exists() else None)


if __name__ == "__main__":
    sys.exit(main())
