"""Custom ops of vllm-dsv41: one op name each, ``torch.ops.dsv41.<op>``.

Every op module (``ops/<op>.py``) holds, in this order: a docstring (maths, shapes, why it is an op,
where its specification lives) -> ``<op>_ref`` in plain PyTorch (the CPU implementation and the
test oracle) -> the Triton kernel(s) -> the ``_<op>_triton`` launch wrapper -> registration through
:func:`define_op`, which binds the reference to CPU and the Triton wrapper to CUDA under one name.

This package imports without vLLM (the GPU kernel tests run on a bare torch + Triton image) and
without Triton (CPU wheels): Triton is imported only inside the CUDA implementations.
"""

from __future__ import annotations

import os
from typing import Callable

import torch

NAMESPACE = "dsv41"
_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")
_DEFINED: set[str] = set()


def define_op(name: str, schema: str, cpu_impl: Callable, cuda_impl: Callable | None = None,
              fake_impl: Callable | None = None) -> Callable:
    """Define ``dsv41::name`` once per process; CPU -> reference, CUDA -> Triton (or the reference)."""
    if name not in _DEFINED:
        _LIB.define(f"{name}{schema}")
        _LIB.impl(name, cpu_impl, "CPU")
        _LIB.impl(name, cuda_impl or cpu_impl, "CUDA")
        if fake_impl is not None:
            torch.library.register_fake(f"{NAMESPACE}::{name}", fake_impl, lib=_LIB)
        _DEFINED.add(name)
    return getattr(getattr(torch.ops, NAMESPACE), name)


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def env_flag(env: str, default: str) -> bool:
    """A 0/1 switch from ``env`` (unset or blank: ``default``); anything else fails naming the variable and its
    value."""
    v = os.environ.get(env, default).strip() or default
    if v not in ("0", "1"):
        raise ValueError(f"{env}={v!r}: expected 1 or 0")
    return v == "1"


def env_rows(env: str, default: int) -> int:
    """A row count >= 0 from ``env`` (unset or empty: ``default``; 0 conventionally "never"); anything else fails
    naming the variable and its value."""
    v = os.environ.get(env, "").strip()
    try:
        n = int(v) if v else default
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(f"{env}={v!r}: expected a row count >= 0 (0 = never)")
    return n
