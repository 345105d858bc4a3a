"""The vLLM plugin entry point: declared, idempotent, cheap, and switchable back to the built-in."""

import importlib.metadata
import os
import subprocess
import sys


def test_entry_point_declared():
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    ours = [e for e in eps if e.value == "vllm_dsv41:register"]
    assert ours, f"no vllm.general_plugins entry point for vllm_dsv41:register in {list(eps)}"


_PROBE = r"""
import os, sys, time
t = time.perf_counter()
import vllm_dsv41
vllm_dsv41.register(); vllm_dsv41.register()
from vllm import ModelRegistry
m = ModelRegistry.models["DeepseekV41ForCausalLM"]
print("MODULE", getattr(m, "module_name", type(m).__name__))
print("CUDA_INIT", "torch.cuda" in sys.modules and __import__("torch").cuda.is_initialized())
print("MLA_DISABLE", os.environ.get("VLLM_MLA_DISABLE"))
"""


def _probe(env_extra):
    env = dict(os.environ, **env_extra)
    env.pop("VLLM_MLA_DISABLE", None)
    r = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return dict(line.split(" ", 1) for line in r.stdout.splitlines() if " " in line)


def test_register_replaces_builtin_and_is_idempotent():
    out = _probe({"VLLM_DSV41_DISABLE": "0", "VLLM_PLUGINS": ""})
    assert out["MODULE"] == "vllm_dsv41.model_executor.model"
    assert out["CUDA_INIT"] == "False"
    assert out["MLA_DISABLE"] == "1"


def test_disable_switch_keeps_builtin():
    out = _probe({"VLLM_DSV41_DISABLE": "1", "VLLM_PLUGINS": ""})
    assert out["MODULE"].startswith("vllm.models.deepseek_v41"), out
    assert out["MLA_DISABLE"] == "None"
