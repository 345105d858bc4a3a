"""Tests of ``benchmarks/e2e/side_by_side.py``: a real plugin run on the tiny checkpoint (driver ->
worker subprocess -> JSON + table) and the table's ratios / met column from synthetic records."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "e2e" / "side_by_side.py"


def _load_module():
    spec = importlib.util.spec_from_file_location("side_by_side", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["side_by_side"] = mod
    spec.loader.exec_module(mod)
    return mod


sbs = _load_module()


@pytest.mark.engine
def test_plugin_tiny_run(tiny_ckpt, tmp_path):
    from vllm_dsv41.attention.specs import kv_bytes, model_cache_specs
    from vllm_dsv41.config import load_config

    out = tmp_path / "sbs"
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
               TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "run", "--model", tiny_ckpt, "--impls", "plugin", "--scale", "tiny",
         "--only", "decode_b1,prefill_32k", "--out", str(out), "--timeout-per-impl", "240"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rec = json.loads((out / "plugin.json").read_text())
    assert rec["status"] == "done", rec.get("log_tail")
    assert list(rec["workloads"]) == ["decode_b1", "prefill_32k"]
    for name, w in rec["workloads"].items():
        assert w["status"] == "ok", (name, w.get("error"))
        assert w["tok_s"] > 0 and w["wall_s"] > 0 and w["warmup_s"] > 0  # timed after an untimed warm-up run
    assert rec["workloads"]["decode_b1"]["output_tokens"] == 8
    # the engine settles async scheduling (the plugin's config hook turns it off for Engram checkpoints)
    assert "async_scheduling" not in rec["llm_kwargs"] and rec["llm_kwargs"]["max_num_seqs"] == 64
    assert rec["async_scheduling"] is False  # the CPU platform runs synchronously
    assert rec["env"]["VLLM_USE_V2_MODEL_RUNNER"] == "0" and "VLLM_DSV41_DISABLE" not in rec["env"]

    want = kv_bytes(model_cache_specs(load_config(tiny_ckpt)))["global_bytes_per_token"]
    kv = rec["kv_cache"]
    assert kv["global_bytes_per_token"] == pytest.approx(want)
    assert kv["source"] == "worker.model_runner.kv_cache_config"
    assert kv["num_blocks"] > 0 and kv["pool_bytes"] > 0
    assert {g["kind"] for g in kv["groups"]} == {"sliding", "global", "per_request"}

    results = json.loads((out / "results.json").read_text())
    assert set(results["impls"]) == {"plugin"}
    table = (out / "table.md").read_text()
    assert f"| global KV B/token | — | {want:,.1f} |" in table


@pytest.mark.engine
def test_fresh_engine_after_a_failed_workload(tiny_ckpt, tmp_path):
    """A workload that raises stops its engine (its state is unknown after an error); the driver starts a
    fresh one that keeps the finished results and runs the rest.  Here max_model_len 1000 makes the
    1024-token stress prompt fail validation."""
    out = tmp_path / "sbs"
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
               TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "run", "--model", tiny_ckpt, "--impls", "plugin", "--scale", "tiny",
         "--only", "decode_b1,stress", "--out", str(out), "--timeout-per-impl", "400",
         "--plugin-llm-args", '{"max_model_len": 1000}'],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=450)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rec = json.loads((out / "plugin.json").read_text())
    status = {name: w["status"] for name, w in rec["workloads"].items()}
    assert status == {"decode_b1": "ok", "stress_1x1024": "error", "stress_8x256": "ok", "stress_64x16": "ok"}, rec
    assert "1024" in rec["workloads"]["stress_1x1024"]["error"]
    assert rec["status"] == "done" and rec["restarts"] == 1 and len(rec["engine_starts_s"]) == 2
    assert (out / "plugin.1.log").exists()
    table = (out / "table.md").read_text()
    assert "| stress 1x1024 | — | error:" in table and table.count("| no crash (plugin) | no |") == 1


def _rec(impl: str, tok_s: dict[str, float], kv: float, stress: dict[str, str]) -> dict:
    workloads = {n: {"kind": "decode", "status": "ok", "tok_s": v, "wall_s": 1.0} for n, v in tok_s.items()}
    workloads["prefill_32k"]["kind"] = "prefill"
    workloads["prefill_32k"]["wall_s"] = 32768 / tok_s["prefill_32k"]
    for name, status in stress.items():
        workloads[name] = {"kind": "stress", "status": status}
    return {"impl": impl, "status": "done", "date_utc": "2026-01-01 00:00:00 UTC", "gpu": "NVIDIA H200",
            "vllm_version": "0.32.0", "command": f"run {impl}", "llm_kwargs": {"model": "m"},
            "engine_start_s": 100.0, "kv_cache": {"global_bytes_per_token": kv, "groups": []},
            "workloads": workloads}


def _row(table: str, metric: str) -> list[str]:
    line = next(ln for ln in table.splitlines() if ln.startswith(f"| {metric} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_table_ratios_and_targets(tmp_path):
    builtin = _rec("builtin", {"decode_b1": 100.0, "decode_b16": 800.0, "decode_b64": 2000.0,
                               "prefill_32k": 10000.0}, 1200.0,
                   {"stress_1x65536": "crashed", "stress_8x16384": "not_run"})
    plugin = _rec("plugin", {"decode_b1": 250.0, "decode_b16": 900.0, "decode_b64": 2400.0,
                             "prefill_32k": 12000.0}, 890.0,
                  {"stress_1x65536": "ok", "stress_8x16384": "crashed"})
    files = []
    for rec in (plugin, builtin):
        files.append(tmp_path / f"{rec['impl']}.json")
        files[-1].write_text(json.dumps(rec))
    out = tmp_path / "table.md"
    assert sbs.main(["table", *map(str, files), "--out", str(out)]) == 0
    table = out.read_text()
    assert _row(table, "decode_b1 tok/s") == ["decode_b1 tok/s", "100.0", "250.0", "2.50x", "≥ 2.0x", "yes"]
    assert _row(table, "decode_b16 tok/s")[3:] == ["1.12x", "—", "—"]
    assert _row(table, "decode_b64 tok/s")[3:] == ["1.20x", "≥ 1.5x", "no"]
    assert _row(table, "prefill_32k tok/s (s)")[1:] == ["10,000 (3.28 s)", "12,000 (2.73 s)", "1.20x",
                                                        "≥ 1.0x", "yes"]
    assert _row(table, "stress 1x65536")[1:] == ["crashed", "ok", "—", "no crash (plugin)", "yes"]
    assert _row(table, "stress 8x16384")[1:] == ["not_run", "crashed", "—", "no crash (plugin)", "no"]
    assert _row(table, "global KV B/token")[1:] == ["1,200.0", "890.0", "0.74x", "≤ 900 (plugin)", "yes"]
    assert "NVIDIA H200" in table and "`run plugin`" in table

    only_plugin = sbs.render_table({"plugin": plugin})
    assert _row(only_plugin, "decode_b1 tok/s")[1:] == ["—", "250.0", "—", "≥ 2.0x", "—"]
    assert "- builtin: — (no results)" in only_plugin


def test_finalize_marks_running_workload_crashed(tmp_path):
    path, log = tmp_path / "builtin.json", tmp_path / "builtin.log"
    log.write_text("...\nCUDA error: an illegal memory access was encountered\n")
    workloads = {n: {"kind": "stress", "status": s} for n, s in
                 [("stress_1x65536", "ok"), ("stress_8x16384", "running"), ("stress_32x8192", "pending")]}
    sbs.save_json(path, {"impl": "builtin", "status": "running", "workloads": workloads})
    rec = sbs.finalize(path, "builtin", -6, None, log)
    assert rec["status"] == "crashed" and rec["exit"]["description"] == "killed by signal SIGABRT"
    got = json.loads(path.read_text())["workloads"]
    assert [w["status"] for w in got.values()] == ["ok", "crashed", "not_run"]
    assert "illegal memory access" in got["stress_8x16384"]["log_tail"]
