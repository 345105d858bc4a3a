"""``benchmarks/e2e/host_overhead.py`` runs end to end on CPU (its own process: it wraps the runner's methods) and
prints its per-step figures, the static decode steps among the timed calls."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "e2e" / "host_overhead.py"


def test_host_overhead_tool_prints_its_figures(tmp_path):
    cmd = [sys.executable, str(SCRIPT), "--ckpt", str(tmp_path / "ckpt"), "--batch", "2", "--prompt", "40", "--steps", "4"]
    got = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert got.returncode == 0, got.stderr[-3000:]
    out = got.stdout
    calls = re.search(r"DecodeGraphs\.run\s+(\d+) calls", out)
    assert calls and int(calls.group(1)) == 3, out  # 4 tokens: the prefill step, then 3 static decode steps
    host = re.search(r"host work outside the forward .*: median ([0-9.]+) ms a step", out)
    assert host and float(host.group(1)) > 0, out
    assert (tmp_path / "ckpt" / "config.json").exists()
