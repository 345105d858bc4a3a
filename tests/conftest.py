"""Shared fixtures: one tiny checkpoint per test session, written in the official format."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> str:
    from vllm_dsv41.tools.make_checkpoint import make_checkpoint

    out = tmp_path_factory.mktemp("tiny")
    make_checkpoint(str(out), preset="tiny", seed=0)
    return str(out)


@pytest.fixture(scope="session")
def tiny_model(tiny_ckpt):
    import torch

    from vllm_dsv41.reference import Transformer

    torch.set_grad_enabled(False)
    return Transformer(tiny_ckpt)
