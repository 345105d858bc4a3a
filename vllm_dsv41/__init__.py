"""vllm-dsv41: an out-of-tree vLLM plugin serving DeepSeek-V4.1-Flash.

``register()`` is the ``vllm.general_plugins`` entry point.  It runs in every
vLLM process, so it is idempotent, imports nothing heavy and touches no CUDA.
"""

__version__ = "0.1.0"


def register() -> None:
    """Entry point; filled in by the vLLM integration (model, backend, ops)."""
    from vllm_dsv41._registration import register as _register

    _register()
