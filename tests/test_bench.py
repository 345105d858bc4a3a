"""Tests of ``vllm-dsv41-bench`` (vllm_dsv41/tools/bench*.py).

Unit tests of the statistics (percentiles, Pareto frontier, interpolation at
the target), the workload generators, and end-to-end sweeps against the
in-process streaming stub server (127.0.0.1, random port) with injected
failures, Ctrl-C, ``--serve-cmd`` and ``compare``.  ``test_sweep_real_tiny_server``
runs the same sweep against a real server given by ``DSV41_TINY_SERVER_URL``.
"""

from __future__ import annotations

import csv
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from vllm_dsv41.tools import bench
from vllm_dsv41.tools.bench_stats import (SUMMARY_FIELDS, failure_key, frontier_report,
                                          interpolate_at, pareto_frontier, percentile,
                                          request_interactivity, summarize_level, tokens_itls)
from vllm_dsv41.tools.bench_stub import StubServerThread, StubState
from vllm_dsv41.tools.bench_workload import (AgenticWorkload, RandomWorkload,
                                             default_vocab_range, lognormal_len)

REPO = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


# ---------------------------------------------------------------------------
# percentiles and per-request metrics


@pytest.mark.parametrize("n", [1, 2, 5, 10, 101])
def test_percentile_matches_numpy_linear(n):
    rng = np.random.default_rng(n)
    xs = rng.exponential(size=n).tolist()
    for q in (0, 1, 10, 25, 50, 90, 99, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12)


def test_percentile_edge_cases():
    assert percentile([], 50) is None
    assert percentile([None, float("nan")], 50) is None
    assert percentile([3.0, None, 1.0, float("nan"), 2.0], 50) == 2.0
    assert percentile([7.0], 99) == 7.0
    assert percentile([1.0, 2.0], 50) == 1.5
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_tokens_itls_are_token_weighted():
    # chunk 0 is the first token; chunk 2 carries 2 tokens over 2 s -> 1 s each
    assert tokens_itls([0.0, 1.0, 3.0], [1, 1, 2]) == [1.0, 1.0, 1.0]
    assert tokens_itls([5.0], [3]) == []
    assert tokens_itls([0.0, 0.5, 0.5], [1, 1, 0]) == [0.5]
    with pytest.raises(ValueError):
        tokens_itls([0.0, 1.0], [1])


def test_request_interactivity_is_inverse_median_itl():
    assert request_interactivity([0.01, 0.01, 0.5]) == pytest.approx(100.0)
    assert request_interactivity([0.002, 0.004]) == pytest.approx(1 / 0.003)
    assert request_interactivity([]) is None
    assert request_interactivity([0.0, 0.0]) is None


# ---------------------------------------------------------------------------
# Pareto frontier and interpolation


def _brute_frontier(points):
    pts = {(float(x), float(y)) for x, y in points}
    keep = [p for p in pts if not any(
        q[0] >= p[0] and q[1] >= p[1] and (q[0] > p[0] or q[1] > p[1]) for q in pts)]
    return sorted(keep)


def test_pareto_frontier_simple():
    pts = [(10, 100), (20, 80), (15, 70), (30, 50), (5, 90), (30, 40), (40, 10)]
    # (15,70) dominated by (20,80); (5,90) by (10,100); (30,40) by (30,50)
    assert pareto_frontier(pts) == [(10, 100), (20, 80), (30, 50), (40, 10)]


def test_pareto_frontier_edge_cases():
    assert pareto_frontier([]) == []
    assert pareto_frontier([(1, 1)]) == [(1.0, 1.0)]
    assert pareto_frontier([(1, 1), (1, 1)]) == [(1.0, 1.0)]           # duplicates once
    assert pareto_frontier([(1, 5), (1, 3)]) == [(1.0, 5.0)]           # same x: max y
    assert pareto_frontier([(1, 5), (3, 5)]) == [(3.0, 5.0)]           # same y: max x
    assert pareto_frontier([(1, 1), (2, 2), (3, 3)]) == [(3.0, 3.0)]   # one dominates all
    assert pareto_frontier([(None, 1), (float("nan"), 9), (2, float("inf")), (1, 1)]) == [(1.0, 1.0)]


def test_pareto_frontier_matches_brute_force():
    rng = np.random.default_rng(0)
    for trial in range(50):
        n = int(rng.integers(1, 30))
        # coarse grid so ties in either coordinate are frequent
        pts = [(int(rng.integers(0, 8)), int(rng.integers(0, 8))) for _ in range(n)]
        front = pareto_frontier(pts)
        assert front == _brute_frontier(pts), pts
        ys = [y for _, y in front]
        assert ys == sorted(ys, reverse=True) and len(set(ys)) == len(ys)


def test_interpolate_at_target():
    front = [(50.0, 1000.0), (100.0, 600.0), (200.0, 100.0)]
    assert interpolate_at(front, 75.0) == (pytest.approx(800.0), None)
    assert interpolate_at(front, 150.0) == (pytest.approx(350.0), None)
    assert interpolate_at(front, 100.0) == (pytest.approx(600.0), None)   # on a point
    assert interpolate_at(front, 50.0) == (pytest.approx(1000.0), None)   # range ends
    assert interpolate_at(front, 200.0) == (pytest.approx(100.0), None)
    assert interpolate_at(list(reversed(front)), 75.0)[0] == pytest.approx(800.0)


def test_interpolate_refuses_to_extrapolate():
    front = [(50.0, 1000.0), (100.0, 600.0)]
    v, why = interpolate_at(front, 150.0)
    assert v is None and "above" in why and "150" in why
    v, why = interpolate_at(front, 10.0)
    assert v is None and "below" in why
    v, why = interpolate_at([], 150.0)
    assert v is None and why
    assert interpolate_at([(150.0, 42.0)], 150.0) == (42.0, None)
    assert interpolate_at([(149.0, 42.0)], 150.0)[0] is None
    assert interpolate_at(front, float("nan"))[0] is None


def _summary(conc, inter, tput, completed=4, partial=False):
    return {"concurrency": conc, "interactivity_median": inter, "interactivity_p90": inter,
            "output_throughput_per_gpu": tput, "completed": completed, "partial": partial}


def test_frontier_report_skips_failed_and_partial_levels():
    levels = [_summary(1, 300.0, 100.0), _summary(2, 250.0, 180.0), _summary(4, 200.0, 150.0),
              _summary(8, 120.0, 400.0), _summary(16, None, 0.0, completed=0),
              _summary(32, 100.0, 9999.0, partial=True)]
    rep = frontier_report(levels, 150.0)
    assert [p["concurrency"] for p in rep["frontier"]] == [8, 2, 1]  # c=4 dominated by c=2
    assert {p["concurrency"] for p in rep["points"]} == {1, 2, 4, 8, 32}
    # between (120, 400) and (250, 180)
    assert rep["throughput_per_gpu_at_target"] == pytest.approx(400 + (180 - 400) * 30 / 130)
    assert rep["reason"] is None
    rep = frontier_report(levels[:1], 150.0)
    assert rep["throughput_per_gpu_at_target"] is None and "below" in rep["reason"]


# ---------------------------------------------------------------------------
# per-level summary


def _rec(status, out=10, prompt=100, itl=0.01, ttft=0.1, err=None):
    return {"status": status, "output_tokens": out, "prompt_tokens": prompt, "ttft_s": ttft,
            "e2e_s": ttft + itl * (out - 1), "tpot_s": itl, "itls_s": [itl] * (out - 1),
            "itl_median_s": itl, "interactivity": 1 / itl, "error": err}


def test_summarize_level():
    recs = [_rec("ok", itl=0.01), _rec("ok", itl=0.02), _rec("ok", itl=0.005),
            _rec("ok", itl=0.004), _rec("failed", out=3, err="HTTP 500: boom #1"),
            _rec("failed", out=0, err="HTTP 500: boom #2"), _rec("cancelled", out=5)]
    s = summarize_level(recs, concurrency=4, wall_time_s=2.0, gpus=2)
    assert set(SUMMARY_FIELDS) <= set(s)
    assert (s["num_requests"], s["completed"], s["failed"], s["cancelled"]) == (6, 4, 2, 1)
    assert s["failure_rate"] == pytest.approx(2 / 6)
    assert s["output_tokens"] == 40 and s["input_tokens"] == 400
    assert s["output_throughput_tok_s"] == pytest.approx(20.0)
    assert s["output_throughput_per_gpu"] == pytest.approx(10.0)
    inter = [100.0, 50.0, 200.0, 250.0]
    assert s["interactivity_median"] == pytest.approx(float(np.median(inter)))
    # p90 = what 90% of requests met or beat = the 10th percentile
    assert s["interactivity_p90"] == pytest.approx(float(np.percentile(inter, 10)))
    assert s["ttft_p50_ms"] == pytest.approx(100.0)
    assert s["failure_reasons"] == {"HTTP 500: boom #N": 2}
    empty = summarize_level([], concurrency=1, wall_time_s=0.0)
    assert empty["failure_rate"] == 0.0 and empty["output_throughput_tok_s"] is None


def test_failure_key_groups_numbers_but_keeps_http_status():
    assert failure_key("HTTP 503: busy, retry in 12s") == "HTTP 503: busy, retry in Ns"
    assert failure_key("completion token mismatch: requested 8, usage says 7") == \
        "completion token mismatch: requested N, usage says N"
    assert failure_key(None) == "unknown"


# ---------------------------------------------------------------------------
# workloads


def test_random_workload_seeded_exact_and_in_range():
    w = RandomWorkload(4096, 1024, (100, 900), seed=7)
    p = w.prompt(4, 3)
    assert len(p) == 4096 and min(p) >= 100 and max(p) < 900
    assert p == RandomWorkload(4096, 1024, (100, 900), seed=7).prompt(4, 3)
    assert p != w.prompt(4, 4)                     # requests differ
    assert p != w.prompt(8, 3)                     # levels differ (no cross-level cache hits)
    assert p != RandomWorkload(4096, 1024, (100, 900), seed=8).prompt(4, 3)
    assert default_vocab_range(1000) == (100, 900)
    with pytest.raises(ValueError):
        default_vocab_range(150)
    with pytest.raises(ValueError):
        RandomWorkload(0, 10, (100, 900))


def test_lognormal_len_median():
    rng = np.random.default_rng(0)
    xs = [lognormal_len(rng, 500, 0.8) for _ in range(4000)]
    assert 450 < np.median(xs) < 550 and min(xs) >= 1
    assert lognormal_len(rng, 500, 0.0) == 500
    assert lognormal_len(rng, 500, 2.0, lo=10, hi=20) in range(10, 21)


def _agentic(**kw):
    base = dict(vocab=(100, 900), seed=3, shared_prefix_len=32, first_turn_len=200,
                turn_input_len=40, turn_output_len=20, turns=6, max_turns=12, max_context=4000,
                think_time_scale=0.5)
    base.update(kw)
    return AgenticWorkload(**base)


def test_agentic_plan_seeded_and_bounded():
    w = _agentic()
    plans = [w.session_plan(4, s) for s in range(40)]
    assert plans == [_agentic().session_plan(4, s) for s in range(40)]
    assert plans != [_agentic(seed=4).session_plan(4, s) for s in range(40)]
    assert len({len(p.turns) for p in plans}) > 1          # lognormal turn counts
    for p in plans:
        assert 1 <= len(p.turns) <= 12
        assert p.turns[0].think_time_s == 0.0
        lens = p.prompt_lens(32)
        for t, n in zip(p.turns, lens):
            assert t.new_input_len >= 1 and t.output_len >= 1 and t.think_time_s >= 0
            assert n + t.output_len <= 4000                 # max_context respected
    assert any(t.think_time_s > 0 for p in plans for t in p.turns[1:])
    assert all(t.think_time_s == 0 for s in range(10)
               for t in _agentic(think_time_scale=0).session_plan(1, s).turns)
    # a tight context ends sessions early
    tight = _agentic(max_context=400)
    for s in range(20):
        p = tight.session_plan(1, s)
        assert all(n + t.output_len <= 400 for t, n in zip(p.turns, p.prompt_lens(32)))


@pytest.mark.parametrize("returned", [True, False])
def test_agentic_turns_extend_previous_context(returned):
    w = _agentic()
    shared = w.shared_prefix(2)
    for s in range(5):
        sess = w.session(2, s)
        lens = sess.plan.prompt_lens(w.shared_prefix_len)
        prev = None
        for k, turn in enumerate(sess.plan.turns):
            prompt = sess.prompt(k)
            assert len(prompt) == lens[k]                   # exact length
            assert prompt[:len(shared)] == shared           # shared system prefix
            if not returned:  # every id synthetic: all inside the vocab range
                assert min(prompt) >= 100 and max(prompt) < 900
            if prev is not None:
                ctx = prev[0] + prev[1]
                assert prompt[:len(ctx)] == ctx             # extends prompt + output
                assert sess.last_prefix_len == len(ctx)
                assert len(prompt) == len(ctx) + turn.new_input_len
            else:
                assert sess.last_prefix_len == w.shared_prefix_len
            out = [5000 + k * 1000 + i for i in range(turn.output_len)] if returned else None
            kind = sess.record_output(k, out)
            assert kind == ("returned" if returned else "synthetic")
            if not returned:  # deterministic stand-in of the planned length
                out = w.standin_output(2, s, k, turn.output_len)
            prev = (prompt, out)
    # wrong-length ids fall back to the stand-in
    sess = w.session(2, 0)
    sess.prompt(0)
    assert sess.record_output(0, [1, 2, 3]) == "synthetic"


def test_agentic_session_enforces_turn_order():
    sess = _agentic().session(1, 0)
    with pytest.raises(ValueError):
        sess.prompt(1)
    sess.prompt(0)
    if sess.num_turns > 1:
        with pytest.raises(ValueError):
            sess.prompt(1)  # output of turn 0 not recorded


# ---------------------------------------------------------------------------
# end to end against the stub server


def _check_outputs(out: Path, concs, n_req):
    data = json.loads((out / "results.json").read_text())
    for key in ("schema", "status", "config", "levels", "pareto", "requests", "server_models"):
        assert key in data
    assert data["schema"] == bench.SCHEMA
    assert [lv["concurrency"] for lv in data["levels"]] == list(concs)
    for lv in data["levels"]:
        assert set(SUMMARY_FIELDS) <= set(lv)
        assert lv["num_requests"] == n_req
        assert lv["completed"] + lv["failed"] == n_req
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert [int(r["concurrency"]) for r in rows] == list(concs)
    assert set(SUMMARY_FIELDS) <= set(rows[0])
    png = out / "pareto.png"
    assert png.exists() and png.stat().st_size > 1000
    assert png.read_bytes()[:8] == PNG_MAGIC
    for p in ("target_tps_per_user", "throughput_per_gpu_at_target", "frontier", "points"):
        assert p in data["pareto"]
    return data


def test_sweep_random_against_stub(tmp_path, capsys):
    st = StubState(token_delay=0.001, fail_every=5)
    with StubServerThread(st) as srv:
        rc, data = bench.run_sweep_against(srv.url, tmp_path, workload="random",
                                           concurrency=(1, 3), num_requests=10, input_len=48,
                                           output_len=12, gpus=2, seed=1,
                                           target_tps_per_user=150)
    assert rc == 0
    data = _check_outputs(tmp_path, (1, 3), 10)
    assert data["status"] == "complete"
    assert data["config"]["model"] == "stub-model"        # auto from /v1/models
    reqs = data["requests"]
    assert len(reqs) == 20
    ok = [r for r in reqs if r["status"] == "ok"]
    failed = [r for r in reqs if r["status"] == "failed"]
    assert len(failed) == st.failed == 4                   # every 5th of 20
    assert all(r["error"].startswith("HTTP 500") and r["http_status"] == 500 for r in failed)
    for r in ok:
        assert r["prompt_tokens"] == r["usage_prompt_tokens"] == 48
        assert r["output_tokens"] == r["usage_completion_tokens"] == r["max_tokens"] == 12
        # 12 tokens, one per event: 11 ITLs, fewer when events share a network read (merged chunks)
        assert 0 < len(r["itls_s"]) <= 11 and r["ttft_s"] > 0 and r["interactivity"] > 0
        assert r["token_count_source"] == "token_ids"
    for lv in data["levels"]:
        n_ok = sum(1 for r in ok if r["concurrency"] == lv["concurrency"])
        assert lv["completed"] == n_ok and lv["output_tokens"] == 12 * n_ok
        assert lv["failure_rate"] == pytest.approx(lv["failed"] / 10)
        assert lv["output_throughput_per_gpu"] == pytest.approx(
            lv["output_throughput_tok_s"] / 2)
        assert lv["interactivity_median"] > 0
        assert "HTTP 500" in next(iter(lv["failure_reasons"]))
    assert sum(lv["failed"] for lv in data["levels"]) == 4
    out = capsys.readouterr()
    assert "tok/s/GPU" in out.out and "failed" in out.err


def test_sweep_agentic_against_stub_checks_token_counts(tmp_path):
    st = StubState(token_delay=0.0005, short_every=7)
    with StubServerThread(st) as srv:
        rc = bench.main(["sweep", "--url", srv.url + "/v1", "--workload", "agentic",
                         "--concurrency", "2,4", "--num-requests", "14", "--out", str(tmp_path),
                         "--shared-prefix-len", "32", "--first-turn-len", "96",
                         "--turn-input-len", "24", "--turn-output-len", "8", "--turns", "4",
                         "--think-time-scale", "0", "--max-context", "2048", "--seed", "5",
                         "--target-tps-per-user", "150"])   # progress bars on
    assert rc == 0
    data = _check_outputs(tmp_path, (2, 4), 14)
    reqs = data["requests"]
    bad = [r for r in reqs if r["status"] == "failed"]
    assert len(bad) == 4                                   # every 7th of 28 was short
    assert all("completion token mismatch" in r["error"] for r in bad)
    assert all(r["usage_completion_tokens"] == r["max_tokens"] - 1 for r in bad)
    by_session = {}
    for r in sorted(reqs, key=lambda r: (r["concurrency"], r["session"], r["turn"])):
        by_session.setdefault((r["concurrency"], r["session"]), []).append(r)
    later_turns = 0
    for turns in by_session.values():
        assert [r["turn"] for r in turns] == list(range(len(turns)))
        assert turns[0]["prefix_len"] == 32
        for a, b in zip(turns, turns[1:]):
            assert a["status"] == "ok"                     # a failed turn ends its session
            assert b["prefix_len"] == a["prompt_tokens"] + a["max_tokens"]
            assert b["prompt_tokens"] > b["prefix_len"]
            if b["status"] == "ok":
                assert b["feedback"] == "returned"
                # the stub's prefix cache saw the previous prompt + output
                assert b["cached_tokens"] >= (b["prefix_len"] // 16) * 16
                later_turns += 1
    assert later_turns > 0
    for r in reqs:
        if r["status"] == "ok":
            assert r["prompt_tokens"] == r["usage_prompt_tokens"]
            assert r["output_tokens"] == r["max_tokens"]
    assert data["levels"][0]["cached_tokens"] > 0


def test_sweep_multi_token_chunks_without_token_ids(tmp_path):
    """Spec-decode-like chunks of 3 tokens, no token ids: ITLs from usage."""
    st = StubState(token_delay=0.01, chunk_size=3, token_ids=False)
    with StubServerThread(st) as srv:
        rc, data = bench.run_sweep_against(srv.url, tmp_path, concurrency=(1,), num_requests=2,
                                           input_len=16, output_len=10)
    assert rc == 0
    for r in data["requests"]:
        assert r["status"] == "ok" and r["token_count_source"] == "chunks"
        assert r["output_tokens"] == 10
        # 4 chunks (3+3+3+1) 30/30/10 ms apart: each gap is spread over 3 tokens,
        # so the median ITL is ~10 ms, not the 30 ms chunk gap
        assert 0.006 < r["itl_median_s"] < 0.02, r["itls_s"]
        assert 0.006 < r["tpot_s"] < 0.02


def test_unreachable_server_exits_2(tmp_path, capsys):
    port = _free_port()
    rc = bench.main(["sweep", "--url", f"http://127.0.0.1:{port}", "--out", str(tmp_path),
                     "--no-progress"])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"127.0.0.1:{port}" in err[0] and "unreachable" in err[0]


def test_all_requests_failing_exits_1(tmp_path, capsys):
    with StubServerThread() as srv:
        rc, data = bench.run_sweep_against(srv.url, tmp_path, concurrency=(1, 2),
                                           num_requests=2, input_len=8, output_len=4,
                                           model="no-such-model")
    assert rc == 1
    assert all(lv["failure_rate"] == 1.0 for lv in data["levels"])
    assert all(r["http_status"] == 404 for r in data["requests"])
    assert data["pareto"]["throughput_per_gpu_at_target"] is None
    assert (tmp_path / "pareto.png").stat().st_size > 0
    assert "every request failed" in capsys.readouterr().err


def test_ctrl_c_keeps_partial_results(tmp_path):
    st = StubState(token_delay=0.05)
    with StubServerThread(st) as srv:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm_dsv41.tools.bench", "sweep", "--url", srv.url,
             "--workload", "random", "--input-len", "16", "--output-len", "200",
             "--concurrency", "2,4", "--num-requests", "8", "--out", str(tmp_path),
             "--no-progress"],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 20
        while st.requests < 2 and time.time() < deadline and proc.poll() is None:
            time.sleep(0.05)
        time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=20)
    assert proc.returncode == 130, err
    assert "interrupted" in err
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["status"] == "interrupted"
    assert len(data["levels"]) == 1 and data["levels"][0]["partial"]
    assert data["levels"][0]["cancelled"] == 2
    assert {r["status"] for r in data["requests"]} == {"cancelled"}
    assert (tmp_path / "results.csv").exists() and (tmp_path / "pareto.png").exists()


def test_serve_cmd_starts_and_stops_the_server(tmp_path):
    port = _free_port()
    cmd = (f"{sys.executable} -m vllm_dsv41.tools.bench_stub --port {port} "
           f"--token-delay 0.001")
    rc, data = bench.run_sweep_against(f"http://127.0.0.1:{port}", tmp_path, concurrency=(1, 2),
                                       num_requests=2, input_len=8, output_len=4,
                                       serve_cmd=cmd, server_timeout=30)
    assert rc == 0
    assert data["config"]["serve_cmd"] == cmd
    assert all(r["status"] == "ok" for r in data["requests"])
    assert (tmp_path / "server.log").exists()
    assert not _port_open(port)                            # the group was killed


def test_serve_cmd_that_dies_is_reported(tmp_path, capsys):
    rc = bench.main(["sweep", "--serve-cmd", "echo no-gpu-here; exit 3",
                     "--url", f"http://127.0.0.1:{_free_port()}", "--out", str(tmp_path),
                     "--server-timeout", "20"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "exited with code 3" in err and "no-gpu-here" in err


def _fake_result(path: Path, label, points, workload="agentic", seed=0):
    levels = [dict(_summary(c, x, y), output_throughput_tok_s=y) for c, x, y in points]
    data = {"schema": bench.SCHEMA, "status": "complete",
            "config": {"label": label, "model": label, "workload": workload, "seed": seed,
                       "gpus": 1, "target_tps_per_user": 150.0, "interactivity_stat": "median"},
            "levels": levels, "pareto": frontier_report(levels, 150.0), "requests": []}
    path.write_text(json.dumps(data))
    return path


def test_compare_overlays_and_ratios(tmp_path, capsys):
    a = _fake_result(tmp_path / "a.json", "ours", [(1, 300, 100), (8, 100, 500)])
    b_dir = tmp_path / "b"
    b_dir.mkdir()
    _fake_result(b_dir / "results.json", "builtin", [(1, 250, 80), (8, 100, 250)])
    c = _fake_result(tmp_path / "c.json", "other", [(1, 400, 50), (8, 200, 90)], seed=1)
    cmp = bench.compare_results([str(a), str(b_dir), str(c)])
    rows = {r["label"]: r for r in cmp["rows"]}
    assert rows["ours"]["throughput_per_gpu_at_target"] == pytest.approx(400.0)
    # between (100, 250) and (250, 80): 250 - 170 * 50 / 150
    assert rows["builtin"]["throughput_per_gpu_at_target"] == pytest.approx(250 - 170 / 3)
    assert rows["builtin"]["ratio_to_first"] == pytest.approx((250 - 170 / 3) / 400)
    assert rows["other"]["throughput_per_gpu_at_target"] is None   # 150 below its range
    assert cmp["warnings"]                                         # seeds differ
    png = tmp_path / "cmp.png"
    rc = bench.main(["compare", str(a), str(b_dir), str(c), "--out", str(png),
                     "--labels", "A,B,C", "--json", str(tmp_path / "cmp.json")])
    assert rc == 0
    assert png.read_bytes()[:8] == PNG_MAGIC
    out = capsys.readouterr().out
    assert "0.48x" in out and "1.00x" in out and "below" in out
    assert json.loads((tmp_path / "cmp.json").read_text())["rows"][1]["label"] == "B"
    assert bench.main(["compare", str(tmp_path / "missing.json")]) == 2


def test_cli_entry_points():
    res = subprocess.run([sys.executable, "-m", "vllm_dsv41.tools.bench", "sweep", "--help"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0
    for flag in ("--workload", "--concurrency", "--num-requests", "--gpus", "--out",
                 "--target-tps-per-user", "--serve-cmd", "--think-time-scale"):
        assert flag in res.stdout
    assert bench.main([]) == 2


# ---------------------------------------------------------------------------
# the real engine: the tiny model's OpenAI server on CPU (tests/e2e/server.py, one per session)

try:
    from tests.e2e.server import tiny_server  # noqa: E402,F401
except ModuleNotFoundError:  # plain `pytest` does not put the repository root on sys.path
    sys.path.insert(0, str(REPO))
    from tests.e2e.server import tiny_server  # noqa: E402,F401

TINY_VOCAB_RANGE = "3,1000"  # the tiny vocabulary has 1024 ids; chat/special tokens sit at the top


@pytest.mark.engine
def test_sweep_real_tiny_server(tiny_server, tmp_path):  # noqa: F811
    url = tiny_server.url
    t0 = time.monotonic()
    rc, data = bench.run_sweep_against(url, tmp_path, workload="random", concurrency=(1, 2),
                                       num_requests=3, input_len=64, output_len=16,
                                       vocab_range=TINY_VOCAB_RANGE, request_timeout=300)
    t_random = time.monotonic() - t0
    assert rc == 0, data and data["levels"]
    data = _check_outputs(tmp_path, (1, 2), 3)
    assert data["status"] == "complete"
    assert data["server_models"] == ["tiny"] and data["config"]["model"] == "tiny"
    assert len(data["requests"]) == 6
    for r in data["requests"]:
        assert r["status"] == "ok", r["error"]
        assert r["prompt_tokens"] == r["usage_prompt_tokens"] == 64
        assert r["output_tokens"] == r["usage_completion_tokens"] == r["max_tokens"] == 16
        assert r["token_count_source"] == "token_ids"          # vLLM's return_token_ids
        assert r["ttft_s"] > 0 and 0 < len(r["itls_s"]) <= 15 and r["interactivity"] > 0
        assert r["e2e_s"] >= r["ttft_s"]
    for lv in data["levels"]:
        assert lv["completed"] == 3 and lv["failed"] == 0 and lv["failure_rate"] == 0
        assert lv["output_tokens"] == 48 and lv["input_tokens"] == 192
        assert lv["output_throughput_tok_s"] > 0 and lv["interactivity_median"] > 0
        assert lv["output_throughput_per_gpu"] == pytest.approx(lv["output_throughput_tok_s"])
    rows = list(csv.DictReader((tmp_path / "results.csv").open()))
    assert [int(r["output_tokens"]) for r in rows] == [48, 48]
    assert os.path.getsize(tmp_path / "pareto.png") > 0

    # the agentic workload: later turns extend the previous prompt + returned output ids, so
    # the server's prefix cache (64-token blocks) must report hits on them
    out = tmp_path / "agentic"
    t0 = time.monotonic()
    rc, data = bench.run_sweep_against(url, out, workload="agentic", concurrency=(1, 2),
                                       num_requests=6, vocab_range=TINY_VOCAB_RANGE,
                                       shared_prefix_len=64, first_turn_len=96,
                                       turn_input_len=24, turn_output_len=8, turns=3,
                                       len_sigma=0, turns_sigma=0, think_time_scale=0,
                                       max_context=512, request_timeout=300)
    t_agentic = time.monotonic() - t0
    assert rc == 0, data and data["levels"]
    data = _check_outputs(out, (1, 2), 6)
    assert os.path.getsize(out / "pareto.png") > 0
    reqs = data["requests"]
    assert all(r["status"] == "ok" for r in reqs), [r["error"] for r in reqs]
    later = []
    for r in reqs:
        assert r["prompt_tokens"] == r["usage_prompt_tokens"]
        assert r["output_tokens"] == r["usage_completion_tokens"] == r["max_tokens"]
        if r["turn"] > 0:
            assert r["feedback"] == "returned"
            assert r["prefix_len"] > 128 and r["prompt_tokens"] > r["prefix_len"]
            later.append(r)
    assert later, "no session reached a second turn"
    for r in later:  # every full 64-token block of the previous turn's computed context
        full_blocks = (r["prefix_len"] - 1) // 64 * 64  # its last output token was never computed
        assert r["cached_tokens"] is not None and r["cached_tokens"] >= full_blocks, r
        assert r["cached_tokens"] % 64 == 0 and r["cached_tokens"] < r["prompt_tokens"], r
    for lv in data["levels"]:
        assert lv["failed"] == 0 and lv["cached_tokens"] > 0
        assert math.isfinite(lv["output_throughput_tok_s"])
    print(f"\nbench sweeps on the tiny server: random {t_random:.1f} s, agentic {t_agentic:.1f} s; "
          f"agentic later-turn hits: {[(r['prefix_len'], r['cached_tokens']) for r in later]}")
