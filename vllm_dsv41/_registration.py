"""What the ``vllm.general_plugins`` entry point registers (run once per process).

- the model for ``DeepseekV41ForCausalLM`` (replacing vLLM's built-in one) as a lazy
  ``"module:Class"`` string (the DSpark draft ``DSparkV41DraftModel`` stays vLLM's until our drafter
  runs inside the engine: registering a placeholder would break the built-in one);
- a quantisation config that claims V4.1 checkpoints (FP8 32x32 E8M0 + MXFP4 experts), so the engine
  accepts them on every platform while our model loads the tensors itself;
- the engine settings the model needs (eager, no async scheduling with Engram, model runner V1:
  ``engine_config.py``) through vLLM's per-architecture config hook;
- our loggers (``vllm_dsv41.*``) write through vLLM's handlers and level, so that our INFO lines (the chosen
  expert path, a switched-off prefill kernel) appear in the server log beside vLLM's;
- ``VLLM_MLA_DISABLE=1``: vLLM's CPU platform turns prefix caching and chunked prefill off for MLA
  models other than ``deepseek_v4``; our caches are not vLLM's MLA layers, so the MLA flag must be off.

``VLLM_DSV41_DISABLE=1`` leaves vLLM's built-in V4.1 in place and registers nothing.
"""

from __future__ import annotations

import os

DISABLE_ENV = "VLLM_DSV41_DISABLE"
MODEL_CLASS = "vllm_dsv41.model_executor.model:DeepseekV41ForCausalLM"

_done = False


def disabled() -> bool:
    return os.environ.get(DISABLE_ENV, "0") not in ("", "0", "false", "False")


def share_vllm_logging() -> None:
    """Hang the ``vllm_dsv41`` logger under vLLM's ``vllm`` logger: vLLM configures (when the engine starts) only
    its own logger's handlers and level, so ours would print WARNING and above through Python's last-resort handler
    and drop INFO; as a child of ``vllm`` our records take vLLM's level, format and stream."""
    import logging

    logging.getLogger("vllm_dsv41").parent = logging.getLogger("vllm")


def register() -> None:
    global _done
    if _done:
        return
    _done = True
    if disabled():
        return
    os.environ.setdefault("VLLM_MLA_DISABLE", "1")
    from vllm import ModelRegistry

    share_vllm_logging()
    ModelRegistry.register_model("DeepseekV41ForCausalLM", MODEL_CLASS)
    from vllm_dsv41.model_executor.quant import register_quant_config

    register_quant_config()
    from vllm_dsv41.engine_config import register_engine_config

    register_engine_config()
