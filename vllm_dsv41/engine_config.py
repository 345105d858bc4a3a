"""Engine settings the plugin's model needs, applied through vLLM's per-architecture config hook.

Owns :func:`register_engine_config`: our entry for ``DeepseekV41ForCausalLM`` in vLLM's
``MODELS_CONFIG_MAP`` (replacing the built-in model's entry while the plugin is active), run by
``VllmConfig`` before it settles compilation and scheduling.  It makes ``vllm serve`` /
``LLM(...)`` work with no extra flags:

* eager execution (``enforce_eager``): the model captures its own decode CUDA graphs
  (``model_executor/graphs.py``); vLLM's torch.compile / graph capture would trace through step
  metadata it does not own;
* no async scheduling for a checkpoint with Engram layers: their lookback ids are read from the
  runner's token history, which under async scheduling holds placeholders for the tokens just
  sampled.  Without Engram, vLLM's choice stands (async by default: the next step is prepared while
  the current one runs; the metadata builder reads nothing back from the device);
* model runner V1 (``VLLM_USE_V2_MODEL_RUNNER=0`` unless the user set it): our runner hooks
  (``attention/runner_hooks.py``) patch V1.

Each override is logged once with its reason.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

ARCHITECTURE = "DeepseekV41ForCausalLM"
V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"


def has_engram(vllm_config) -> bool:
    """The checkpoint's config.json lists Engram layers."""
    mc = vllm_config.model_config
    for cfg in (getattr(mc, "hf_text_config", None), getattr(mc, "hf_config", None),
                getattr(getattr(mc, "hf_config", None), "text_config", None)):
        ids = cfg.get("engram_layer_ids") if isinstance(cfg, dict) else getattr(cfg, "engram_layer_ids", None)
        if ids:
            return True
    return False


def apply_engine_settings(vllm_config) -> list[str]:
    """Adjust ``vllm_config`` in place; returns what was changed (for logs and tests)."""
    changed = []
    mc, sc = vllm_config.model_config, vllm_config.scheduler_config
    if mc is not None and not mc.enforce_eager:
        mc.enforce_eager = True
        changed.append("enforce_eager=True (the model captures its own decode CUDA graphs)")
    if sc.async_scheduling is not False and has_engram(vllm_config):
        sc.async_scheduling = False
        changed.append("async_scheduling=False (Engram lookback ids need the sampled tokens)")
    if os.environ.get(V2_RUNNER_ENV) is None:
        os.environ[V2_RUNNER_ENV] = "0"
        changed.append(f"{V2_RUNNER_ENV}=0 (the plugin's runner hooks patch model runner V1)")
    for c in changed:
        logger.info("vllm-dsv41: %s", c)
    return changed


def register_engine_config() -> None:
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP, VerifyAndUpdateConfig

    class DSV41EngineConfig(VerifyAndUpdateConfig):
        @staticmethod
        def verify_and_update_config(vllm_config) -> None:
            apply_engine_settings(vllm_config)

    MODELS_CONFIG_MAP[ARCHITECTURE] = DSV41EngineConfig
