"""Triton, or a stand-in that lets kernel modules import (and their references run) without it.

``from vllm_dsv41.ops._triton import triton, tl, HAS_TRITON``: with the stand-in, ``@triton.jit`` leaves
the function undecorated and ``tl.constexpr`` is a plain value, so a module defines its kernels either way
and registers its Triton path only when ``HAS_TRITON``.
"""

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only wheels
    class _TritonStandIn:
        @staticmethod
        def jit(fn=None, **kwargs):
            return fn if fn is not None else (lambda f: f)

    class _LanguageStandIn:
        @staticmethod
        def constexpr(value=None):
            return value

    triton, tl = _TritonStandIn(), _LanguageStandIn()
    HAS_TRITON = False
else:
    HAS_TRITON = True

__all__ = ["triton", "tl", "HAS_TRITON"]
