"""The vLLM plugin entry point: declared, idempotent, cheap, and switchable back to the built-in."""

import importlib.metadata
import os
import subprocess
import sys

import pytest


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
from vllm.model_executor.models.config import MODELS_CONFIG_MAP
print("CONFIG_HOOK", MODELS_CONFIG_MAP["DeepseekV41ForCausalLM"].__module__)
import logging
from vllm.config import LoggingConfig
from vllm.logger import configure_logging
configure_logging(LoggingConfig())  # what the engine does at start
ours = logging.getLogger("vllm_dsv41.model_executor.linear")
print("LOG_SHARED", ours.getEffectiveLevel() == logging.INFO and ours.hasHandlers()
      and logging.getLogger("vllm_dsv41").parent is logging.getLogger("vllm"))
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
    assert out["CONFIG_HOOK"] == "vllm_dsv41.engine_config"
    assert out["LOG_SHARED"] == "True"  # our INFO lines reach vLLM's log


def test_disable_switch_keeps_builtin():
    out = _probe({"VLLM_DSV41_DISABLE": "1", "VLLM_PLUGINS": ""})
    assert out["MODULE"].startswith("vllm.models.deepseek_v41"), out
    assert out["MLA_DISABLE"] == "None"
    assert out["CONFIG_HOOK"] != "vllm_dsv41.engine_config"


def test_engine_settings_applied_by_the_config_hook(tiny_ckpt, monkeypatch):
    """Asked for graphs and async scheduling, the engine config of a V4.1 checkpoint still comes out eager and on
    model runner V1 (engine_config.py says why), and synchronous (the CPU platform's rule)."""
    from vllm.engine.arg_utils import EngineArgs

    import vllm_dsv41

    vllm_dsv41.register()
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "")  # recorded, so the hook's value is undone afterwards
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER")
    from vllm_dsv41.engine_config import user_asked_eager

    cfg = EngineArgs(model=tiny_ckpt, enforce_eager=False, async_scheduling=True, dtype="float32",
                     max_model_len=1024).create_engine_config()
    assert cfg.model_config.enforce_eager is True
    assert cfg.scheduler_config.async_scheduling is False
    assert os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "0"
    # eager either way; the user's own enforce_eager is remembered (the model's graphs then stay off unless named)
    assert not user_asked_eager(cfg)
    asked = EngineArgs(model=tiny_ckpt, enforce_eager=True, dtype="float32", max_model_len=1024).create_engine_config()
    assert asked.model_config.enforce_eager is True and user_asked_eager(asked)


def test_async_scheduling_left_to_vllm_with_and_without_engram(monkeypatch):
    """Async scheduling stays vLLM's choice (None: async by default on CUDA) with Engram layers too: their lookback
    ids that the host lacks come from the model's token history (tests/e2e: test_engram_lookback_from_history)."""
    from types import SimpleNamespace

    from vllm_dsv41.engine_config import apply_engine_settings

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")

    def config(engram_layer_ids):
        text = SimpleNamespace(engram_layer_ids=engram_layer_ids)
        return SimpleNamespace(model_config=SimpleNamespace(enforce_eager=True, hf_text_config=text, hf_config=None),
                               scheduler_config=SimpleNamespace(async_scheduling=None))

    for c in (config([1, 14]), config([])):
        assert apply_engine_settings(c) == []
        assert c.scheduler_config.async_scheduling is None


def test_model_runner_v2_is_refused_by_name(monkeypatch):
    """Asked for model runner V2, the engine config of a V4.1 checkpoint fails with the variable named: our runner
    hooks patch V1, and without them replay starts, Engram lookback ids and prompt-logprobs rows would be lost
    without an error."""
    from types import SimpleNamespace

    from vllm_dsv41.engine_config import apply_engine_settings

    cfg = SimpleNamespace(model_config=SimpleNamespace(enforce_eager=True), scheduler_config=None,
                          additional_config={})
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(ValueError, match="VLLM_USE_V2_MODEL_RUNNER='1'.*model runner V1"):
        apply_engine_settings(cfg)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    assert apply_engine_settings(cfg) == [] and cfg.additional_config == {"vllm_dsv41_user_enforce_eager": True}
