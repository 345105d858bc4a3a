"""Triton, or a stand-in that lets kernel modules import (and their references run) without it.

``from vllm_dsv41.ops._triton import triton, tl, HAS_TRITON``: with the stand-in, ``@triton.jit`` leaves
the function undecorated and ``tl.constexpr`` is a plain value, so a module defines its kernels either way
and registers its Triton path only when ``HAS_TRITON``.

Also :func:`interpreting` (Triton's interpreter is on), :func:`jit_with_e2m1` (an MXFP4 op's kernel with the
E2M1 decoder bound) and :func:`launch_fitting`: a launch config that does not fit the GPU (shared memory,
registers) steps down to the next smaller one instead of failing the request.

And programmatic dependent launch (PDL, ``VLLM_DSV41_PDL``): :func:`pdl` says whether a launch on a tensor's
device takes it, :func:`pdl_launch` gives the launch keywords.  Every kernel that can be launched so takes a
``PDL`` constexpr and begins ``if PDL: gdc_wait(); gdc_launch_dependents()``, before any early return.  A kernel
launched with ``launch_pdl=True`` may start while the kernel before it on the stream is still running; its
programs wait (``griddepcontrol.wait``) for that kernel's completion and memory before touching anything, then
let the next kernel launch.  What overlaps is the launch and scheduling of a kernel with the tail of the one
before: at batch-1 decode, ~2,000 launches a step of a few µs each.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Iterable

from vllm_dsv41.ops import env_flag

logger = logging.getLogger(__name__)

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

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    HAS_GDC = True
except ImportError:  # no Triton, or one without the griddepcontrol intrinsics (before 3.4)
    gdc_wait = gdc_launch_dependents = None
    HAS_GDC = False

PDL_ENV = "VLLM_DSV41_PDL"
DEFAULT_PDL = "0"


ROW_COUNT_ARGS = ("T",)
"""The kernel argument that carries a step's row count, for ``triton.jit(do_not_specialize=...)``.  Triton compiles
a variant per class of each integer argument (equal to 1, divisible by 16, other); our kernels use the row count
only as a bound, so one variant serves every batch (a fresh H200 compiled ~100 variants of our kernels as shapes
arrived: docs/benchmarks.md, session 10)."""


def sm_count(device) -> int:
    """Multiprocessors of ``device``'s GPU (launch heuristics); 132, an H200's, for the interpreter's CPU
    tensors, so tests there take the same tiling decisions."""
    if device.type != "cuda":
        return 132
    import torch

    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_sm_count(index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(index).multi_processor_count


def hw_fp8(t) -> bool:
    """Whether ``t`` lives on a GPU that converts E4M3 in hardware (sm_89 and later): the kernels' ``HW_FP8``."""
    if not t.is_cuda:
        return False
    import torch

    return torch.cuda.get_device_capability(t.device) >= (8, 9)


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET``, read as Triton reads it): there
    ``tl.dot`` takes no bf16 operands, so the kernels multiply in fp32."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def pdl_setting() -> bool:
    """``VLLM_DSV41_PDL``: 1 launches the decode path's Triton kernels with programmatic dependent launch, 0 (the
    default until a GPU measures it) without; anything else fails naming the variable."""
    return env_flag(PDL_ENV, DEFAULT_PDL)


def pdl(t) -> bool:
    """Whether kernels launched on ``t``'s device take PDL: the setting, a CUDA tensor of sm_90 or later, a Triton
    with the intrinsics, and not the interpreter (which has no grids to overlap)."""
    if not (HAS_GDC and t.is_cuda) or interpreting() or not pdl_setting():
        return False
    return _cuda_capability(t.device.index if t.device.index is not None else 0) >= (9, 0)


@functools.cache
def _cuda_capability(index: int) -> tuple[int, int]:
    import torch

    return torch.cuda.get_device_capability(index)


def pdl_launch(on: bool) -> dict:
    """The launch keywords for a kernel taking ``PDL=on``: ``launch_pdl`` only when on, so the interpreter and
    Triton releases without the option never see it."""
    return {"PDL": on, "launch_pdl": True} if on else {"PDL": False}


def jit_with_e2m1(module: dict, name: str):
    """Bind ``tl`` and sparse_attn's E2M1 decoder ``_e2m1_twice`` (the NVFP4 keys' codes are the MXFP4 weights'
    too) into an op module's globals and JIT its kernel ``name`` there; returns the JIT function."""
    import triton.language

    from vllm_dsv41.ops import sparse_attn

    module["tl"] = triton.language
    module["_e2m1_twice"] = sparse_attn._e2m1_twice
    module[name] = triton.jit(module[name])
    return module[name]


_FITTED: dict[tuple, dict] = {}  # (kernel, wanted config, constexpr flags) -> the config that fits


def launch_fitting(name: str, launch: Callable[[dict], None], configs: Iterable[dict], key: tuple) -> None:
    """``launch(config)`` with the first of ``configs`` (best first) whose compiled kernel fits the GPU.

    Triton compiles before it checks the kernel's shared memory against the device, so the same source
    and config can fit under one Triton release and not under another, or with fp32 operands and not
    bf16.  A config that raises ``OutOfResources`` (before anything runs) is skipped with a warning; the
    winner is remembered per ``key`` (everything that changes the compiled kernel: shapes' constexprs,
    dtypes, flags), so only the first launch of a key pays for the search.
    """
    configs = list(configs)
    fitted = _FITTED.get((name, key))
    if fitted is not None:
        launch(fitted)
        return
    error = None
    for cfg in configs:
        try:
            launch(cfg)
        except Exception as e:
            # triton.runtime.errors.OutOfResources, matched by name: this module imports without Triton
            if type(e).__name__ != "OutOfResources":
                raise
            error = error or e
            continue
        _FITTED[(name, key)] = cfg
        if cfg is not configs[0]:
            logger.warning("vllm-dsv41: %s config %s does not fit this GPU (%s); using %s", name, configs[0],
                           error, cfg)
        return
    raise RuntimeError(f"{name}: no launch config fits this GPU (tried {configs}): {error}") from error


__all__ = ["triton", "tl", "HAS_TRITON", "gdc_launch_dependents", "gdc_wait", "hw_fp8", "interpreting", "jit_with_e2m1",
           "launch_fitting", "pdl", "pdl_launch", "sm_count"]
