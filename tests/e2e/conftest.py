"""Helpers for tests that start the real vLLM engine on CPU (single process, eager)."""

from __future__ import annotations

import contextlib
import gc
import os

import pytest


@contextlib.contextmanager
def engine(model: str, *, exact: bool, **kwargs):
    """A vLLM ``LLM`` over our plugin; ``exact`` sets VLLM_DSV41_EXACT for the engine's lifetime."""
    from vllm import LLM
    from vllm.distributed import cleanup_dist_env_and_memory

    old = os.environ.get("VLLM_DSV41_EXACT")
    os.environ["VLLM_DSV41_EXACT"] = "1" if exact else "0"
    args = dict(model=model, enforce_eager=True, dtype="float32", max_model_len=1024, max_num_seqs=8, seed=0)
    args.update(kwargs)
    llm = LLM(**args)
    try:
        yield llm
    finally:
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()
        if old is None:
            os.environ.pop("VLLM_DSV41_EXACT", None)
        else:
            os.environ["VLLM_DSV41_EXACT"] = old


@pytest.fixture(scope="session")
def prompts():
    import torch

    g = torch.Generator().manual_seed(0)
    lens = [5, 17, 40, 64, 90, 100, 130, 33, 200]  # several past the window (16) and top-k (12) entries
    return [[0] + torch.randint(3, 990, (n - 1,), generator=g).tolist() for n in lens]


# The session's OpenAI server over the tiny checkpoint (defined in server.py, shared with
# tests/test_bench.py).  `python -m pytest` has the repository root on sys.path; plain `pytest` does not.
try:
    from tests.e2e.server import tiny_server  # noqa: E402,F401
except ModuleNotFoundError:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.e2e.server import tiny_server  # noqa: E402,F401
