"""Engine settings the plugin's model needs, applied through vLLM's per-architecture config hook.

Owns :func:`register_engine_config`: our entry for ``DeepseekV41ForCausalLM`` in vLLM's
``MODELS_CONFIG_MAP`` (replacing the built-in model's entry while the plugin is active), run by
``VllmConfig`` before it settles compilation and scheduling.  It makes ``vllm serve`` /
``LLM(...)`` work with no extra flags:

* eager execution (``enforce_eager``): the model captures its own decode CUDA graphs
  (``model_executor/graphs.py``); vLLM's torch.compile / graph capture would trace through step
  metadata it does not own.  When the user asked for ``enforce_eager`` themselves, that is recorded
  (:func:`user_asked_eager`) and the model's own graphs stay off too unless named
  (``VLLM_DSV41_CUDAGRAPH=1`` / ``VLLM_DSV41_PREFILL_GRAPHS=1``);
* vLLM's choice of async scheduling stands (on by default on CUDA: the next step is prepared while the
  current one runs; the metadata builder reads nothing back from the device), Engram checkpoints
  included: the lookback ids the runner's host token table lacks under async scheduling (the generated
  ones) come from the model's device token history (``model_executor/step.py``, ``TokenHistory``);
* model runner V1 (``VLLM_USE_V2_MODEL_RUNNER=0`` unless the user set it; set to 1, the engine is refused
  with the reason): our runner hooks (``attention/runner_hooks.py``) patch V1.

Each override is logged once with its reason.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

ARCHITECTURE = "DeepseekV41ForCausalLM"
V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"
USER_EAGER_KEY = "vllm_dsv41_user_enforce_eager"  # in ``VllmConfig.additional_config``


def user_asked_eager(vllm_config) -> bool:
    """Whether the user set ``enforce_eager`` (the hook below sets it for every V4.1 engine, so the model cannot tell
    from the model config)."""
    extra = getattr(vllm_config, "additional_config", None)
    return bool(extra.get(USER_EAGER_KEY, False)) if isinstance(extra, dict) else False


def apply_engine_settings(vllm_config) -> list[str]:
    """Adjust ``vllm_config`` in place; returns what was changed (for logs and tests)."""
    changed = []
    mc, sc = vllm_config.model_config, vllm_config.scheduler_config
    extra = getattr(vllm_config, "additional_config", None)
    if mc is not None and isinstance(extra, dict) and USER_EAGER_KEY not in extra:  # the hook runs once; be sure
        extra[USER_EAGER_KEY] = bool(mc.enforce_eager)
    if mc is not None and not mc.enforce_eager:
        mc.enforce_eager = True
        changed.append("enforce_eager=True (the model captures its own decode CUDA graphs)")
    v2 = os.environ.get(V2_RUNNER_ENV)
    if v2 is None:
        os.environ[V2_RUNNER_ENV] = "0"
        changed.append(f"{V2_RUNNER_ENV}=0 (the plugin's runner hooks patch model runner V1)")
    elif v2.strip().lower() in ("1", "true", "yes", "on"):
        # without the hooks the step metadata would lack replay starts, Engram lookback ids and the rows that prompt
        # logprobs read: wrong answers with no error, so no engine
        raise ValueError(f"{V2_RUNNER_ENV}={v2!r}: vllm-dsv41 serves DeepSeek-V4.1 through model runner V1 only (its "
                         f"runner hooks carry per-request facts V2 would drop); unset it or set it to 0, or set "
                         f"VLLM_DSV41_DISABLE=1 for vLLM's built-in model")
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
