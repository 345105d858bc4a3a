"""The model's weight-holding layers: dequantised (the exact path) or kept quantised (the fast path).

Owns the choice ``VLLM_DSV41_WEIGHTS`` (:func:`weights_mode`) and the three layer kinds:

* :class:`Dense` - a checkpoint-bf16 weight (compressor, indexer keys, norms' neighbours, head),
  held in fp32 on the exact path and in bf16 on the fast path;
* :class:`QuantLinear` - an FP8 E4M3 weight with 32x32 UE8M0 tiles.  Dequantised on arrival on
  the exact path; on the fast path the FP8 bytes and tiles are kept and, on CUDA, turned once after
  loading into what ``VLLM_DSV41_DENSE_GEMM`` (:func:`dense_gemm_backend`) names: ``w8a8`` (default: FP8 x FP8
  through vLLM's CUTLASS GEMM, the weight under one power-of-two scale per row, the activations quantised per token
  on the fly, or taken already quantised from the norm before it, :class:`QuantRows`,
  ``VLLM_DSV41_FUSED_QUANT``; grouped layers as ``bf16``), ``bf16`` (the dequantised weight in bf16, exact since
  E4M3 x 2^k fits bf16, through cuBLAS), ``marlin``
  (vLLM's Marlin W8A16 MXFP8 GEMM; a 32x32 tile is 32 rows of one 1x32 MX scale, so the repack is
  exact) or ``fp8`` (the bytes and tiles kept for our ``dsv41::fp8_gemm`` at decode sizes); on CPU the fast
  path dequantises per call (the reference);
* :class:`Expert` - a routed expert (MXFP4, 1x32 UE8M0).  Quantised on CUDA, a layer's experts are
  stacked as ``w13 = [w1; w3]`` and ``w2`` and run, as ``VLLM_DSV41_MOE`` (:func:`moe_backend`,
  :func:`resolve_moe_backend`) chooses, through OpenAI's ``matmul_ogs`` from the ``triton_kernels`` that vLLM
  vendors (:func:`ogs_expert_stack`, :func:`ogs_moe`; the default where it imports and the shapes align), through
  vLLM's Marlin MXFP4 fused MoE (:func:`marlin_expert_stack`, :func:`marlin_moe`), or (experimental) through our
  ``dsv41::moe_mxfp4`` on the stacked bytes (:func:`mxfp4_expert_stack`), always with the clamped SwiGLU
  ``silu(min(a, L)) * clamp(b, -L, L)``; forwards of ``VLLM_DSV41_MOE_BF16_FROM`` tokens or more (prefill; by
  default only under Marlin) decode those bytes to bf16 for vLLM's Triton fused MoE (:func:`bf16_moe`);
  otherwise an expert loop over dequantised weights (:func:`loop_moe`, the reference; :func:`masked_moe` inside
  captured decode steps, where the host may not read the routing).

Why (docs/design.md, "Hopper path (CUDA)", Weights): Marlin is the W8A16 / W4A16 path vLLM 0.32 ships for SM90 that
takes the checkpoint's own scales without requantisation; for the FP8 dense weights the H200 measured
cuBLAS bf16 at about a third of Marlin's MXFP8 GEMM time at prefill sizes, for twice the bytes of those
weights (benchmarks/ops/bench_gemm.py, docs/benchmarks.md).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from vllm_dsv41 import formats
from vllm_dsv41.checkpoint import E8M0, FP8, I8

logger = logging.getLogger(__name__)

WEIGHTS_ENV = "VLLM_DSV41_WEIGHTS"
DENSE_GEMM_ENV = "VLLM_DSV41_DENSE_GEMM"
MOE_ENV = "VLLM_DSV41_MOE"
MOE_BF16_FROM_ENV = "VLLM_DSV41_MOE_BF16_FROM"
MOE_FP8_FROM_ENV = "VLLM_DSV41_MOE_FP8_FROM"
MOE_GEMV_ROWS_ENV = "VLLM_DSV41_MOE_GEMV_ROWS"
GROUPED_GEMM_ENV = "VLLM_DSV41_GROUPED_GEMM"
SMALL_GEMM_ENV = "VLLM_DSV41_SMALL_GEMM"
FP8_MOE_GEMM_ENV = "VLLM_DSV41_FP8_MOE_GEMM"
FUSED_QUANT_ENV = "VLLM_DSV41_FUSED_QUANT"
FUSED_ACT_QUANT_ENV = "VLLM_DSV41_FUSED_ACT_QUANT"
E8M0_ONE = 127  # UE8M0 byte of 2^0: the dummy loader's value for scales (weights stay finite)


def weights_mode(exact: bool, on_cuda: bool) -> str:
    """``VLLM_DSV41_WEIGHTS``: ``dequant`` (fp32 weights dequantised at load), ``quant`` (FP8 /
    MXFP4 kept, Marlin on CUDA) or ``auto`` (default: ``quant`` on CUDA unless exact mode)."""
    v = os.environ.get(WEIGHTS_ENV, "auto").strip().lower()
    if v in ("", "auto"):
        return "quant" if on_cuda and not exact else "dequant"
    if v not in ("dequant", "quant"):
        raise ValueError(f"{WEIGHTS_ENV}={v!r}: expected auto, dequant or quant")
    return v


DEFAULT_DENSE_GEMM = "w8a8"
"""Why (docs/benchmarks.md, session 14): vLLM's CUTLASS FP8 GEMM (per-token x per-row scales, the quantisation kernel
included) took 0.65-0.72x cuBLAS's bf16 time on wq_b, wo_b and the shared w1+w3 at 64 rows and 0.6-0.8x on every
ungrouped shape at 2k-16k rows; the grouped wo_a is faster on bf16.  FP8 activations are the checkpoint's own
``activation_scheme: dynamic``; they cost ~2.7e-2 relative error per GEMM on random data against ~1.7e-3 for bf16."""


def dense_gemm_backend() -> str:
    """``VLLM_DSV41_DENSE_GEMM``: how the fast CUDA path runs the FP8 dense weights - ``w8a8`` (default,
    :data:`DEFAULT_DENSE_GEMM`; :func:`w8a8_gemm`: FP8 activations per token x the FP8 weight per row, vLLM's
    CUTLASS kernel; the grouped ``wo_a`` stays on bf16), ``bf16`` (dequantised once, cuBLAS), ``marlin`` (vLLM's
    MXFP8 Marlin GEMM on the FP8 bytes) or ``fp8`` (the FP8 bytes kept: ``dsv41::fp8_gemm`` up to its ``MAX_M``
    tokens, a per-call bf16 dequantisation and cuBLAS above; measured slower than cuBLAS, session 10)."""
    v = os.environ.get(DENSE_GEMM_ENV, DEFAULT_DENSE_GEMM).strip().lower() or DEFAULT_DENSE_GEMM
    if v not in ("bf16", "w8a8", "marlin", "fp8"):
        raise ValueError(f"{DENSE_GEMM_ENV}={v!r}: expected bf16, w8a8, marlin or fp8")
    return v


def grouped_gemm_backend() -> str:
    """``VLLM_DSV41_GROUPED_GEMM``: the grouped ``wo_a`` under ``w8a8`` - ``bf16`` (default: one batched cuBLAS GEMM,
    faster than eight CUTLASS FP8 calls, session 14), ``fused_moe`` (:func:`grouped_w8a8`: the groups as the experts
    of vLLM's Triton fused-MoE FP8 kernel, one launch over half of bf16's weight bytes; not yet measured) or ``gemv``
    (passes of at most :func:`gemv_rows` rows through ``dsv41::fp8_gemv``, its groups in one launch on the FP8 bytes,
    longer ones through bf16, whatever ``VLLM_DSV41_SMALL_GEMM`` says of the other layers: at one row the batched
    bf16 GEMM took ~25 µs a layer in the step, the GEMV 20.2 alone, session 32; not yet measured end to end)."""
    v = os.environ.get(GROUPED_GEMM_ENV, "bf16").strip().lower() or "bf16"
    if v not in ("bf16", "fused_moe", "gemv"):
        raise ValueError(f"{GROUPED_GEMM_ENV}={v!r}: expected bf16, fused_moe or gemv")
    return v


def small_gemm_backend() -> str:
    """``VLLM_DSV41_SMALL_GEMM``: the FP8 dense GEMMs of few-row passes under ``w8a8`` - ``cutlass`` (default:
    :func:`w8a8_gemm`, the activations quantised per token), ``gemv`` (``dsv41::fp8_gemv``: the W8A8 GEMM in one launch,
    x quantised per token inside it, for passes of at most :func:`gemv_rows` rows; pre-quantised rows through
    ``dsv41::fp8_gemv_q``; the grouped ``wo_a`` keeps an FP8 copy beside its bf16 one for these passes) or ``triton``
    (``dsv41::fp8_rows_gemm``: bf16 activations against the same row-scaled E4M3 weight, split K, no quantisation
    launch, up to ``fp8_gemm.MAX_M`` rows; with it the grouped ``wo_a`` keeps its FP8 rows only and takes the same
    kernel up to that many rows, :func:`grouped_w8a8` above; session 19: slower than CUTLASS at every shape)."""
    v = os.environ.get(SMALL_GEMM_ENV, "cutlass").strip().lower() or "cutlass"
    if v not in ("cutlass", "gemv", "triton"):
        raise ValueError(f"{SMALL_GEMM_ENV}={v!r}: expected cutlass, gemv or triton")
    return v


GEMV_ROWS_ENV = "VLLM_DSV41_GEMV_ROWS"


def gemv_rows() -> int:
    """``VLLM_DSV41_GEMV_ROWS``: under ``VLLM_DSV41_SMALL_GEMM=gemv``, passes of at most this many rows take
    ``dsv41::fp8_gemv`` (default and at most ``fp8_gemv.MAX_M``, 16; 0: none)."""
    from vllm_dsv41.ops import env_rows, fp8_gemv

    n = env_rows(GEMV_ROWS_ENV, fp8_gemv.MAX_M)
    if n > fp8_gemv.MAX_M:
        raise ValueError(f"{GEMV_ROWS_ENV}={n}: fp8_gemv serves at most {fp8_gemv.MAX_M} rows")
    return n


def fused_quant() -> bool:
    """``VLLM_DSV41_FUSED_QUANT``: ``1`` (default) lets a norm whose every reader is a ``w8a8`` GEMM quantise its
    rows per token in the same launch (:func:`fused_rms_norm_quant`; the q norm, read by ``wq_b`` and the indexer's
    ``wq_b``), ``0`` keeps the bf16 norm and each GEMM's own quantisation (the comparison); ``0`` also turns off
    :func:`fused_act_quant`."""
    v = os.environ.get(FUSED_QUANT_ENV, "1").strip() or "1"
    if v not in ("1", "0"):
        raise ValueError(f"{FUSED_QUANT_ENV}={v!r}: expected 1 or 0")
    return v == "1"


DEFAULT_FUSED_ACT_QUANT = "0"
"""Why off (docs/benchmarks.md, session 21): the first kernels (one program a row) took more GPU time than the op +
vLLM's quantisation they replace, and the batch-64 decode step 0.24 ms more with them on; the collapses' codes from
their normalising epilogue (built after that run) are not yet measured."""


def fused_act_quant() -> bool:
    """``VLLM_DSV41_FUSED_ACT_QUANT`` (with :func:`fused_quant` on): ``1`` lets the ops that make a ``w8a8`` GEMM's
    input quantise it per token in their own launch, where the pass has at most :data:`FUSED_QUANT_MAX_ROWS` rows: at
    the split mHC boundary the collapses (``dsv41::mhc_collapse_quant`` for ``[wq_a; wkv]``,
    ``dsv41::mhc_post_collapse_quant`` for the shared expert's ``[w1; w3]``) and the shared expert's activation
    (``dsv41::swiglu_quant`` for ``w2``); ``0`` (default, :data:`DEFAULT_FUSED_ACT_QUANT`) leaves that to the GEMMs."""
    v = os.environ.get(FUSED_ACT_QUANT_ENV, DEFAULT_FUSED_ACT_QUANT).strip() or DEFAULT_FUSED_ACT_QUANT
    if v not in ("1", "0"):
        raise ValueError(f"{FUSED_ACT_QUANT_ENV}={v!r}: expected 1 or 0")
    return v == "1" and fused_quant()


def moe_backend() -> str:
    """``VLLM_DSV41_MOE``: the routed experts on the fast CUDA path - ``auto`` (default: :func:`resolve_moe_backend`),
    ``ogs`` (``triton_kernels``' ``matmul_ogs`` on the checkpoint's MXFP4 bytes, swizzled once at load), ``marlin``
    (vLLM's Marlin MXFP4 fused MoE) or ``triton`` (experimental: ``dsv41::moe_mxfp4`` on those bytes)."""
    v = os.environ.get(MOE_ENV, "auto").strip().lower() or "auto"
    if v not in ("auto", "marlin", "triton", "ogs"):
        raise ValueError(f"{MOE_ENV}={v!r}: expected auto, ogs, marlin or triton")
    return v


OGS_ALIGN = 256
"""``auto`` takes ``matmul_ogs`` for experts whose hidden and intermediate sizes are multiples of this (the bench and
full widths, 5120 and 2304; the sizes its Hopper layouts were measured at), Marlin for others."""

MARLIN_MOE_ALIGN = (128, 64)
"""(hidden, intermediate) multiples Marlin's MoE kernel tiles (vLLM's own check for MXFP4 MoE layers); narrower
experts (the tiny test model's 64 x 32) make its launch fail with "Invalid thread config" once a batch is large."""


def resolve_moe_backend(backend: str, hidden: int, inter: int) -> str:
    """``auto`` -> ``ogs`` where ``matmul_ogs`` imports and the expert shape aligns (:data:`OGS_ALIGN`), else
    ``marlin`` where Marlin tiles the shape (:data:`MARLIN_MOE_ALIGN`), else ``loop`` (the expert loop over weights
    dequantised per call: slow, but any width).  Why ogs: on the H200 it took 271 against Marlin's 298 µs for a
    batch-64 layer, 3.7 against Marlin's 6.9 ms (and bf16_moe's 4.6 ms) at 4,096 tokens; Marlin is 5 µs faster at one
    token (docs/benchmarks.md, session 11).  An explicit ``marlin`` on a shape it cannot tile is an error naming the
    widths; other values pass through."""
    marlin_fits = hidden % MARLIN_MOE_ALIGN[0] == 0 and inter % MARLIN_MOE_ALIGN[1] == 0
    if backend == "marlin" and not marlin_fits:
        raise ValueError(f"{MOE_ENV}=marlin: experts of hidden size {hidden} and intermediate size {inter} are not "
                         f"multiples of Marlin's tiles {MARLIN_MOE_ALIGN}; use auto")
    if backend != "auto":
        return backend
    if not (hidden % OGS_ALIGN or inter % OGS_ALIGN):
        try:
            _require_matmul_ogs()
            return "ogs"
        except (ImportError, RuntimeError):
            pass
    return "marlin" if marlin_fits else "loop"


@functools.cache
def log_moe_choice(backend: str, bf16_from: int, fp8_from: int = 0, gemv_rows: int = 0) -> None:
    """Say once per process which routed-expert path the fast path took (benchmark logs record it)."""
    logger.info("vllm-dsv41: routed experts through %s%s%s%s", backend,
                f", bf16_moe from {bf16_from} tokens" if bf16_from else "",
                f", fp8_moe from {fp8_from} tokens" if fp8_from else "",
                f", moe_gemv up to {gemv_rows} tokens" if gemv_rows else "")


def env_count(name: str, default: int, what: str) -> int:
    """A count >= 0 from environment variable ``name`` (unset or empty: ``default``); anything else fails naming
    the variable, its value and ``what`` was expected."""
    v = os.environ.get(name, "").strip()
    if not v:
        return default
    try:
        n = int(v)
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(f"{name}={v!r}: expected {what}")
    return n


def moe_bf16_from(backend: str = "marlin") -> int:
    """``VLLM_DSV41_MOE_BF16_FROM``: forward passes of at least this many tokens (prefill) run the routed experts
    as bf16 (:func:`bf16_moe`: the layer's MXFP4 experts decoded into a scratch buffer, vLLM's Triton fused-MoE
    GEMMs) instead of the decode backend; 0 turns that off.  Default for Marlin 2048 (its W4A16 kernel took ~0.8 µs
    per token and layer in a 16k-token prefill; break-even near 1k tokens, an estimate); for ``ogs`` 0, since
    ``matmul_ogs`` beat bf16_moe (its per-call decode of the experts included) at 4,096 tokens on the H200."""
    return env_count(MOE_BF16_FROM_ENV, 0 if backend == "ogs" else 2048, "a token count >= 0 (0: never)")


DEFAULT_MOE_GEMV_ROWS = 1
"""Default of ``VLLM_DSV41_MOE_GEMV_ROWS``: one-token passes (batch-1 decode).  On an H100 the op took 64.1 µs a layer
against ``matmul_ogs``' 79.0 (routing included) and a batch-1 decode step 9.77 ms against 10.77; it reads each token's
experts apart (no sort), so 2 or 4 tokens read up to 2 or 4 times the bytes and larger passes keep ``matmul_ogs``
(docs/benchmarks.md, sessions 26 and 28)."""


def moe_gemv_rows(device: torch.device) -> int:
    """``VLLM_DSV41_MOE_GEMV_ROWS``: forward passes of at most this many tokens run the routed experts through
    ``dsv41::moe_gemv`` (the few-token MXFP4 kernels on MXFP8 activations, no sort by expert; also inside captured
    decode steps); 0 turns that off.  Default :data:`DEFAULT_MOE_GEMV_ROWS` on GPUs with FP8 tensor cores
    (:func:`w8a8_supported`: the op's MMAs are FP8), else 0; at most ``moe_gemv.MAX_TOKENS``."""
    from vllm_dsv41.ops import env_rows, moe_gemv

    default = DEFAULT_MOE_GEMV_ROWS if w8a8_supported(device) else 0  # True off CUDA
    n = env_rows(MOE_GEMV_ROWS_ENV, default)
    if n > moe_gemv.MAX_TOKENS:
        raise ValueError(f"{MOE_GEMV_ROWS_ENV}={n}: moe_gemv serves at most {moe_gemv.MAX_TOKENS} tokens")
    return n


DEFAULT_MOE_FP8_FROM = 4096
"""Default of ``VLLM_DSV41_MOE_FP8_FROM`` where FP8 tensor cores exist: a prefill pass of 16k tokens runs its encoder
layers' experts on 16k rows and its decoder layers' on ~2k (batch 64 of 1k prompts); the FP8 path pays one pass over
the layer's experts per call (MXFP4 -> FP8), which many rows amortise."""


def moe_fp8_from(device: torch.device) -> int:
    """``VLLM_DSV41_MOE_FP8_FROM``: forward passes of at least this many tokens run the routed experts in FP8
    (:func:`fp8_moe`); 0 turns that off.  Default :data:`DEFAULT_MOE_FP8_FROM` on GPUs with FP8 tensor cores
    (:func:`w8a8_supported`), else 0."""
    default = DEFAULT_MOE_FP8_FROM if w8a8_supported(device) else 0  # True off CUDA
    return env_count(MOE_FP8_FROM_ENV, default, "a token count >= 0 (0: never)")


def fp8_moe_gemm_backend() -> str:
    """``VLLM_DSV41_FP8_MOE_GEMM``: the grouped GEMMs of :func:`fp8_moe` (the prefill experts in FP8) - ``triton``
    (default: vLLM's Triton fused-MoE kernel, :data:`FP8_MOE_TILES`) or ``cutlass`` (vLLM's CUTLASS grouped FP8 GEMM
    for SM90, ``cutlass_moe_mm``, on rows permuted by expert; :func:`_cutlass_moe_gemms`).  The same operands and
    scales either way.  Why ``triton`` (docs/benchmarks.md, session 23): on the H200 the CUTLASS GEMMs took 6.67
    against 5.44 ms a layer at 16k rows and 1.06 against 0.84 ms at 2k, for the same error."""
    v = os.environ.get(FP8_MOE_GEMM_ENV, "triton").strip().lower() or "triton"
    if v not in ("triton", "cutlass"):
        raise ValueError(f"{FP8_MOE_GEMM_ENV}={v!r}: expected triton or cutlass")
    return v


@dataclass(frozen=True)
class WeightFormat:
    """How the model holds checkpoint weights: ``quant`` keeps FP8 / MXFP4 bytes (else fp32
    dequantised), ``dense_dtype`` is the dtype of the checkpoint's bf16 weights (bf16 only on the
    fast CUDA path)."""

    quant: bool
    dense_dtype: torch.dtype
    cuda_fast: bool = False  # quantised on CUDA: vLLM's fused kernels (Marlin, rms_norm) replace references

    @staticmethod
    def choose(exact: bool) -> "WeightFormat":
        from vllm.platforms import current_platform

        on_cuda = current_platform.is_cuda()
        quant = weights_mode(exact, on_cuda) == "quant"
        fast = quant and on_cuda
        return WeightFormat(quant, torch.bfloat16 if fast else torch.float32, fast)


#: The activation dtype of the fast path's GEMMs: what vLLM's Marlin kernels take (and return), and the
#: dtype of the dequantised dense weights (``VLLM_DSV41_DENSE_GEMM=bf16``).
FAST_GEMM_DTYPE = torch.bfloat16


def on_fast_device(t: torch.Tensor) -> bool:
    """Whether a quantised weight on ``t``'s device is prepared for the fast GEMMs (CUDA; a CPU test
    emulates it by patching this and vLLM's Marlin entry points)."""
    return t.device.type == "cuda"


def fused_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """vLLM's one-kernel RMSNorm (``_C.rms_norm``; fp32 statistics) for the fast CUDA path; the
    reference ``rms_norm`` takes five kernels."""
    from vllm import _custom_ops

    x = x.contiguous()
    out = torch.empty_like(x)
    _custom_ops.rms_norm(out, x, w.to(x.dtype), eps)
    return out


def w8a8_supported(device: torch.device) -> bool:
    """Whether ``w8a8`` runs on ``device``: FP8 tensor cores (compute capability 8.9 or newer: Ada, Hopper and
    later); elsewhere the fast path keeps ``bf16`` (said once in the log).  Off CUDA (the CPU reference) always."""
    if device.type != "cuda":
        return True
    ok = torch.cuda.get_device_capability(device) >= (8, 9)
    if not ok:
        _log_w8a8_fallback(torch.cuda.get_device_name(device))
    return ok


@functools.cache
def _log_w8a8_fallback(name: str) -> None:
    logger.warning("vllm-dsv41: %s has no FP8 tensor cores; the FP8 dense weights run as bf16 (%s=bf16)", name,
                   DENSE_GEMM_ENV)


def w8a8_gemm(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] (bf16) @ (w8 [N, K] E4M3 x w_scale [N, 1] fp32).T -> [M, N] in x's dtype, the activations quantised to
    E4M3 per token on the fly (:func:`formats.quant_fp8_tokens`).  On CUDA vLLM's dynamic per-token quantisation and
    its CUTLASS FP8 GEMM; elsewhere the same arithmetic in fp32 (the reference the GPU test compares with)."""
    if x.shape[0] == 0:
        return x.new_empty(0, w8.shape[0])
    if x.is_cuda:
        from vllm import _custom_ops as vllm_ops

        q, sa = vllm_ops.scaled_fp8_quant(x.contiguous(), use_per_token_if_dynamic=True)
        return vllm_ops.cutlass_scaled_mm(q, w8.t(), sa, w_scale, x.dtype)
    return w8a8_ref(x, w8, w_scale).to(x.dtype)


def w8a8_ref(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """The arithmetic of a W8A8 GEMM in fp32 on any device: x [M, K] quantised to E4M3 per token
    (:func:`formats.quant_fp8_tokens`) times the E4M3 weight [N, K] under its per-row scales (w_scale [N, 1] or
    [N]) -> fp32 [M, N]."""
    return w8a8_quantised_ref(*formats.quant_fp8_tokens(x), w8, w_scale)


def w8a8_quantised_ref(q: torch.Tensor, sa: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """:func:`w8a8_ref` from activations already quantised: q E4M3 [M, K] under sa fp32 [M, 1] -> fp32 [M, N]."""
    return (q.float() @ w8.float().t()) * sa * w_scale.reshape(1, -1)


class QuantRows(NamedTuple):
    """Activations already quantised per token for the ``w8a8`` GEMMs (:func:`fused_rms_norm_quant`): ``q`` E4M3
    [M, K] under ``scale`` fp32 [M, 1] (the rule of :func:`formats.quant_fp8_tokens`), and ``dtype``, the dtype the
    activations had and the GEMMs return.  :class:`QuantLinear` under ``w8a8`` takes it in place of a tensor."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    def rows(self, take: Callable[[torch.Tensor], torch.Tensor]) -> "QuantRows":
        """The same row selection on the values and their scales (``take``: e.g. ``lambda t: step.take(t, rows)``)."""
        return QuantRows(take(self.q), take(self.scale), self.dtype)


def rms_norm_quant_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> QuantRows:
    """:func:`fused_rms_norm_quant`'s arithmetic in plain PyTorch: RMSNorm in fp32, the normalised rows and their
    product with the weight each rounded to x's dtype (where vLLM's kernel rounds them; no rounding for fp32 input),
    then :func:`formats.quant_fp8_tokens` (scale = max(amax / 448, ``FP8_TOKEN_SCALE_FLOOR``), as the kernel)."""
    from vllm_dsv41.reference.model import rms_norm

    y = rms_norm(x.float(), None, eps).to(x.dtype) * w.to(x.dtype)
    return QuantRows(*formats.quant_fp8_tokens(y), x.dtype)


def fused_rms_norm_quant(x: torch.Tensor, w: torch.Tensor, eps: float) -> QuantRows:
    """RMSNorm and per-token FP8 quantisation in one launch for the fast path's ``w8a8`` readers of a norm: vLLM's
    ``rms_norm_dynamic_per_token_quant`` (input and weight in one dtype, rows contiguous) on the fast device, else
    :func:`rms_norm_quant_ref`.  x [M, K] -> :class:`QuantRows` (dtype x's)."""
    if not on_fast_device(x):
        return rms_norm_quant_ref(x, w, eps)
    from vllm import _custom_ops

    q, s = _custom_ops.rms_norm_dynamic_per_token_quant(x.contiguous(), w.to(x.dtype), eps, FP8)
    return QuantRows(q, s, x.dtype)


def w8a8_gemm_rows(rows: QuantRows, w8: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """:func:`w8a8_gemm` on activations already quantised: vLLM's CUTLASS FP8 GEMM on CUDA, else
    :func:`w8a8_quantised_ref`; -> [M, N] in ``rows.dtype``."""
    q = rows.q
    if q.shape[0] == 0:
        return torch.empty(0, w8.shape[0], dtype=rows.dtype, device=q.device)
    if q.is_cuda:
        from vllm import _custom_ops as vllm_ops

        return vllm_ops.cutlass_scaled_mm(q, w8.t(), rows.scale, w_scale, rows.dtype)
    return w8a8_quantised_ref(q, rows.scale, w8, w_scale).to(rows.dtype)


FUSED_QUANT_MAX_ROWS = 1024
"""Passes of at most this many rows take the fused norm-quantisation (:func:`fused_quant`): its gain is a launch, which
counts at decode sizes; at prefill sizes vLLM's fused kernel is not measured against ours (session 20's only run with
it on in prefill had prefill_32k at 33,742 against session 19's 34,582-35,628 tok/s, not separated from noise), so those
passes keep the measured route."""


def reads_quantised_rows(layers: Iterable["QuantLinear"], dtype: torch.dtype, activation: bool = False) -> bool:
    """Whether activations of ``dtype`` may reach every one of ``layers`` as :class:`QuantRows`: the switch on
    (:func:`fused_quant`; for ``activation`` quantisations, those of the ops that make a GEMM's input, also
    :func:`fused_act_quant`), the activations in the fast GEMMs' dtype (what ``w8a8_gemm`` would quantise), and each
    layer an ungrouped ``w8a8`` weight that would quantise them per token itself (not ``VLLM_DSV41_SMALL_GEMM=triton``,
    which reads bf16; ``gemv`` reads them through ``dsv41::fp8_gemv_q``)."""
    return ((fused_act_quant() if activation else fused_quant()) and dtype == FAST_GEMM_DTYPE
            and small_gemm_backend() in ("cutlass", "gemv")
            and all(lin.w8 is not None and lin.groups == 1 for lin in layers))


GROUPED_W8A8_SMALL_TILES = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=128, GROUP_SIZE_M=1, num_warps=4,
                                num_stages=4)
""":func:`grouped_w8a8`'s fused-MoE tiles up to ``GROUPED_W8A8_SMALL_ROWS`` tokens (decode: a group's rows fill at most
a few 16-row tiles, the weight bytes set the time); above, :data:`FP8_MOE_TILES`.  Guesses until measured."""
GROUPED_W8A8_SMALL_ROWS = 256


def grouped_w8a8(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """A grouped W8A8 GEMM: x [T, G, K] (bf16), group g's slice through rows g * n .. (g + 1) * n of w8 [G * n, K] (E4M3
    under w_scale [G * n, 1] fp32) -> [T, G, n] in x's dtype, the activations quantised per (token, group) slice.  On
    CUDA one launch of vLLM's Triton fused-MoE FP8 kernel: each slice a row routed to its group, the groups the
    experts; elsewhere :func:`w8a8_ref` per group."""
    T, G, K = x.shape
    n = w8.shape[0] // G
    if T == 0:
        return x.new_empty(0, G, n)
    if not x.is_cuda:
        return torch.stack([w8a8_ref(x[:, g], w8[g * n:(g + 1) * n], w_scale[g * n:(g + 1) * n])
                            for g in range(G)], 1).to(x.dtype)
    import triton.language as tl
    from vllm import _custom_ops as vops
    from vllm.model_executor.layers.fused_moe.fused_moe import dispatch_fused_moe_kernel
    from vllm.model_executor.layers.fused_moe.moe_align_block_size import moe_align_block_size

    cfg = dict(config or (GROUPED_W8A8_SMALL_TILES if T <= GROUPED_W8A8_SMALL_ROWS else FP8_MOE_TILES))
    a, a_scale = vops.scaled_fp8_quant(x.reshape(T * G, K).to(FAST_GEMM_DTYPE).contiguous(),
                                       use_per_token_if_dynamic=True)
    group_of_row = torch.arange(G, dtype=torch.int32, device=x.device).repeat(T).unsqueeze(1)  # row t * G + g -> g
    sorted_ids, expert_ids, n_padded = moe_align_block_size(group_of_row, cfg["BLOCK_SIZE_M"], G)
    out = torch.empty(T * G, 1, n, dtype=FAST_GEMM_DTYPE, device=x.device)
    ones = torch.ones(T * G, 1, dtype=torch.float32, device=x.device)  # no routing weights (not multiplied in)
    dispatch_fused_moe_kernel(a, w8.view(G, n, K), out, a_scale, w_scale.reshape(G, n), None, ones,
                              mul_routed_weight=False, top_k=1, sorted_token_ids=sorted_ids, expert_ids=expert_ids,
                              num_tokens_post_padded=n_padded, config=cfg, compute_type=tl.bfloat16,
                              use_fp8_w8a8=True, use_int8_w8a8=False, use_int8_w8a16=False, use_int4_w4a16=False,
                              per_channel_quant=True)
    return out.view(T, G, n).to(x.dtype)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _frozen(t: torch.Tensor, dummy: int | None = None) -> nn.Parameter:
    p = nn.Parameter(t, requires_grad=False)
    if dummy is not None:
        p.dummy_weight_value = dummy  # read by vLLM's dummy loader (integer tensors are otherwise left alone)
    return p


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


class Dense(nn.Module):
    """``x @ weight.T`` for a weight stored in bf16 by the checkpoint.

    ``dtype`` fp32 (exact path: the reference's arithmetic) or bf16 (fast path: the checkpoint's own
    values, half the bytes, tensor cores); the result is returned in ``x``'s dtype."""

    def __init__(self, out_features: int, in_features: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = _frozen(torch.zeros(out_features, in_features, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if w.dtype == x.dtype:
            return x @ w.t()
        return torch.nn.functional.linear(x.to(w.dtype), w).to(x.dtype)


class _MarlinShim(nn.Module):
    """The attributes vLLM's Marlin preparation reads from a linear layer."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        self.output_size_per_partition, self.input_size_per_partition = weight.shape
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale = nn.Parameter(scale, requires_grad=False)
        self.params_dtype = torch.bfloat16


def marlin_mxfp8(weight: torch.Tensor, tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 [N, K] + UE8M0 32x32 tiles (uint8 [N/32, K/32]) -> Marlin (weight, scale) for bf16 inputs."""
    from vllm.model_executor.layers.quantization.utils.marlin_utils_fp8 import prepare_mxfp8_layer_for_marlin

    N, K = weight.shape
    row_scales = formats.as_uint8(tiles).repeat_interleave(32, 0)[:N].contiguous()  # [N, K/32]
    shim = _MarlinShim(weight, row_scales)
    with _default_dtype(torch.bfloat16):
        prepare_mxfp8_layer_for_marlin(shim)
    return shim.weight.data, shim.weight_scale.data


def grouped_by_all_pairs(gemm: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """A grouped linear (group g's input slice through group g's rows) as ONE ungrouped GEMM over all the
    rows: x [T, G, K] -> ``gemm`` [T*G, G*O] (every slice through every group) -> the diagonal blocks
    [T, G, O] (a view).  G times the FLOPs for the same weight bytes: one launch instead of G, the better
    trade while T*G rows are few (decode)."""
    T, G, K = x.shape
    y = gemm(x.reshape(T * G, K))
    return torch.diagonal(y.view(T, G, G, -1), dim1=1, dim2=2).transpose(1, 2)


class QuantLinear(nn.Module):
    """An FP8 (32x32 UE8M0 tiles) checkpoint weight.

    ``quant=False``: ``weight`` is the dequantised fp32 matrix (the loader dequantises on arrival).
    ``quant=True``: ``weight`` (FP8 [N, K]) and ``scale`` (uint8 [N/32, K/32]) keep the checkpoint's
    bytes; :meth:`finalize` turns them, on CUDA, into ``w16`` (the bf16 weight, :func:`dense_gemm_backend`
    ``bf16``) or Marlin's repacks (``marlin``).  ``groups`` > 1 splits the rows into that many independent
    blocks applied to the matching slices of the input (the grouped ``wo_a``: one batched GEMM on ``w16``;
    on Marlin, up to :attr:`ALL_PAIRS_MAX_ROWS` rows (T x groups) go through one GEMM over all the rows
    (:func:`grouped_by_all_pairs`), more through one GEMM per group)."""

    ALL_PAIRS_MAX_ROWS = 128

    def __init__(self, out_features: int, in_features: int, quant: bool, groups: int = 1):
        super().__init__()
        self.out_features, self.in_features, self.quant, self.groups = out_features, in_features, quant, groups
        self.marlin: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per group
        self.marlin_all: tuple[torch.Tensor, torch.Tensor] | None = None  # all rows (grouped layers)
        self.w16: torch.Tensor | None = None  # the dequantised weight [N, K] in FAST_GEMM_DTYPE (cuBLAS)
        self.fp8_kept = False  # ``fp8`` backend: weight and scale stay as loaded, dsv41::fp8_gemm reads them
        self.w8: torch.Tensor | None = None  # ``w8a8``: the weight in E4M3 [N, K] under one scale per row ...
        self.w8_scale: torch.Tensor | None = None  # ... fp32 [N, 1] (formats.fp8_block_to_rows)
        self.gemv_rows = 0  # ``VLLM_DSV41_SMALL_GEMM=gemv``: passes of 1 .. this many rows take dsv41::fp8_gemv on w8
        if not quant:
            self.weight = _frozen(torch.zeros(out_features, in_features, dtype=torch.float32))
            return
        self.weight = _frozen(torch.zeros(out_features, in_features, dtype=FP8))
        self.scale = _frozen(torch.full((_cdiv(out_features, 32), _cdiv(in_features, 32)), E8M0_ONE,
                                        dtype=torch.uint8), dummy=E8M0_ONE)

    def dequantized(self) -> torch.Tensor:
        if not self.quant:
            return self.weight
        return formats.dequant_fp8_block(self.weight, self.scale.view(E8M0), 32)

    def finalize(self) -> None:
        """After loading, when the weight lives on CUDA: dequantise it to ``w16``, repack it for Marlin, or keep the
        FP8 bytes for ``dsv41::fp8_gemm`` (:func:`dense_gemm_backend`)."""
        if not self.quant or getattr(self, "retired", False) or not on_fast_device(self.weight):
            return
        backend, small = dense_gemm_backend(), small_gemm_backend()
        grouped = grouped_gemm_backend()
        grouped_fp8 = self.groups == 1 or grouped in ("fused_moe", "gemv") or small in ("triton", "gemv")
        if backend == "w8a8" and not (grouped_fp8 and w8a8_supported(self.weight.device)):
            backend = "bf16"  # grouped layers stay on bf16 by default (one batched GEMM), as do pre-FP8 GPUs
        if backend == "w8a8":
            self.w8, self.w8_scale = formats.fp8_block_to_rows(self.weight.data, self.scale.data.view(E8M0))
            if small == "gemv" or (self.groups > 1 and grouped == "gemv"):
                from vllm_dsv41.ops import fp8_gemv

                self.gemv_rows = gemv_rows()
                if self.groups > 1 and grouped in ("bf16", "gemv"):  # longer passes: the batched bf16 GEMM
                    self.w16 = self.dequantized().to(FAST_GEMM_DTYPE)
                from vllm_dsv41.model_executor.overlap import side_streams

                # the split-K counters of every stream it may run on exist before any graph is captured
                fp8_gemv.reserve(self.w8.device, side_streams(self.w8.device))
            del self.weight, self.scale
            return
        if backend == "bf16":
            self.w16 = self.dequantized().to(FAST_GEMM_DTYPE)
            del self.weight, self.scale
            return
        rows = self.out_features // self.groups
        if rows % 32:
            raise ValueError(f"QuantLinear: {self.groups} groups of {rows} rows do not align with 32x32 tiles")
        if backend == "fp8":
            self.fp8_kept = True
            return
        self.marlin = [marlin_mxfp8(self.weight.data[g * rows:(g + 1) * rows],
                                    self.scale.data[g * rows // 32:(g + 1) * rows // 32])
                       for g in range(self.groups)]
        if self.groups > 1:
            self.marlin_all = marlin_mxfp8(self.weight.data, self.scale.data)
        del self.weight, self.scale  # the repacked copies replace them

    def retire(self) -> None:
        """Its rows now live in a :func:`concat_rows` layer: free them (``finalize`` then does nothing)."""
        self.retired = True
        for name in ("weight", "scale"):
            if hasattr(self, name):
                delattr(self, name)

    def _marlin_gemm(self, x: torch.Tensor, g: int | None) -> torch.Tensor:
        """x [M, K] through group ``g``'s rows (None: all the rows)."""
        from vllm.model_executor.layers.quantization.utils.marlin_utils_fp8 import apply_mxfp8_marlin_linear

        w, s = self.marlin_all if g is None else self.marlin[g]
        n = self.out_features if g is None else self.out_features // self.groups
        return apply_mxfp8_marlin_linear(input=x, weight=w, weight_scale=s, workspace=None, size_n=n,
                                         size_k=self.in_features)

    def _fp8_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The ``fp8`` backend: few tokens through ``dsv41::fp8_gemm`` on the kept FP8 bytes; more (prefill)
        through a bf16 dequantisation of this call (the FP8 bytes read once, the GEMM dominates) and cuBLAS."""
        from vllm_dsv41.ops import fp8_gemm

        G, T = self.groups, x.shape[0]
        xb = x.to(FAST_GEMM_DTYPE)
        if T <= fp8_gemm.MAX_M:
            out = fp8_gemm.fp8_gemm(xb.reshape(T, -1), self.weight, self.scale, G)
            return (out if G == 1 else out.view(T, G, -1)).to(x.dtype)
        return self._through(xb, self.dequantized().to(FAST_GEMM_DTYPE)).to(x.dtype)

    def _through(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x through the plain [N, K] matrix ``w`` (same dtype), each group's slice through its rows."""
        if self.groups == 1:
            return x @ w.t()
        return torch.einsum("tgk,gok->tgo", x, w.view(self.groups, -1, self.in_features))

    def weight_read(self, rows: int) -> torch.Tensor | None:
        """The tensor a fast-path pass of ``rows`` rows streams (as :meth:`forward` picks it): the E4M3 weight on
        the GEMV route, else the bf16 or E4M3 matrix; None where it is a repack or the plain path's."""
        if self.w8 is not None and 0 < rows <= self.gemv_rows:
            return self.w8
        return self.w16 if self.w16 is not None else self.w8

    def forward(self, x: torch.Tensor | QuantRows) -> torch.Tensor:
        """x [T, K] (or [T, groups, K] for grouped weights) -> [T, N] (or [T, groups, N/groups]); under ``w8a8`` x may
        be :class:`QuantRows` (ungrouped only; :func:`reads_quantised_rows`), which skip the quantisation."""
        if isinstance(x, QuantRows):
            if self.w8 is None or self.groups != 1:
                raise TypeError("QuantLinear: pre-quantised rows need an ungrouped w8a8 weight")
            if 0 < x.q.shape[0] <= self.gemv_rows:
                from vllm_dsv41.ops import fp8_gemv

                return fp8_gemv.fp8_gemv_q(x.q, x.scale, self.w8, self.w8_scale).to(x.dtype)
            return w8a8_gemm_rows(x, self.w8, self.w8_scale)
        G = self.groups
        if self.w8 is not None and 0 < x.shape[0] <= self.gemv_rows:
            from vllm_dsv41.ops import fp8_gemv

            T = x.shape[0]
            out = fp8_gemv.fp8_gemv(x.reshape(T, -1).to(FAST_GEMM_DTYPE), self.w8, self.w8_scale, G)
            return (out if G == 1 else out.view(T, G, -1)).to(x.dtype)
        if self.w16 is not None:  # before w8: a grouped layer under ``gemv`` keeps both, bf16 for longer passes
            return self._through(x.to(self.w16.dtype), self.w16).to(x.dtype)
        if self.w8 is not None:
            from vllm_dsv41.ops import fp8_gemm

            T = x.shape[0]
            if 0 < T <= fp8_gemm.MAX_M and small_gemm_backend() == "triton":
                out = fp8_gemm.fp8_rows_gemm(x.reshape(T, -1).to(FAST_GEMM_DTYPE), self.w8, self.w8_scale, G)
                return (out if G == 1 else out.view(T, G, -1)).to(x.dtype)
            if G > 1:
                return grouped_w8a8(x.to(FAST_GEMM_DTYPE), self.w8, self.w8_scale).to(x.dtype)
            return w8a8_gemm(x.to(FAST_GEMM_DTYPE), self.w8, self.w8_scale).to(x.dtype)
        if self.fp8_kept:
            return self._fp8_forward(x)
        if self.marlin is not None:
            xb = x.to(FAST_GEMM_DTYPE)
            if G == 1:
                return self._marlin_gemm(xb, 0).to(x.dtype)
            if x.shape[0] * G <= self.ALL_PAIRS_MAX_ROWS:
                return grouped_by_all_pairs(lambda a: self._marlin_gemm(a, None), xb).to(x.dtype)
            return torch.stack([self._marlin_gemm(xb[:, g].contiguous(), g) for g in range(G)], 1).to(x.dtype)
        return self._through(x, self.dequantized().to(x.dtype))


def concat_rows(*parts: QuantLinear) -> QuantLinear:
    """One quantised linear whose output rows are the parts' rows in order (layers that read the same input:
    one GEMM instead of several).  Each part's rows must fill whole 32-row tiles."""
    K = parts[0].in_features
    for p in parts:
        if not p.quant or p.groups != 1 or p.in_features != K or p.out_features % 32:
            raise ValueError("concat_rows: quantised, ungrouped parts of one input width and 32-row multiples")
    out = QuantLinear(sum(p.out_features for p in parts), K, quant=True)
    out.weight = _frozen(torch.cat([p.weight.data for p in parts]))
    out.scale = _frozen(torch.cat([p.scale.data for p in parts]))
    return out


def fuse_rows_on_cuda(*parts: QuantLinear) -> QuantLinear | None:
    """On the fast CUDA path (quantised parts on CUDA, whole 32-row tiles, before their own finalize): the
    parts as one repacked :func:`concat_rows` layer, the parts retired; otherwise None (parts unchanged)."""
    if not all(p.quant and not getattr(p, "retired", False) and on_fast_device(p.weight)
               and p.groups == 1 and p.out_features % 32 == 0 for p in parts):
        return None
    fused = concat_rows(*parts)
    fused.finalize()
    for p in parts:
        p.retire()
    return fused


class Expert(nn.Module):
    """One routed expert as the checkpoint stores it: w1, w3 [I, H] and w2 [H, I] (MXFP4 or dequantised)."""

    def __init__(self, hidden: int, inter: int, quant: bool):
        super().__init__()
        for name, (r, c) in (("w1", (inter, hidden)), ("w3", (inter, hidden)), ("w2", (hidden, inter))):
            sub = nn.Module()
            if quant:
                sub.weight = _frozen(torch.zeros(r, c // 2, dtype=I8))
                sub.scale = _frozen(torch.full((r, c // 32), E8M0_ONE, dtype=torch.uint8), dummy=E8M0_ONE)
            else:
                sub.weight = _frozen(torch.zeros(r, c, dtype=torch.float32))
            setattr(self, name, sub)
        self.quant = quant

    def weight(self, name: str) -> torch.Tensor:
        sub = getattr(self, name)
        if not self.quant:
            return sub.weight
        return formats.dequant_mxfp4(sub.weight, sub.scale.view(E8M0))


def mxfp4_expert_stack(experts: nn.ModuleList) -> tuple[torch.Tensor, ...]:
    """Quantised :class:`Expert` s -> their bytes stacked (w13 [E, 2I, H/2], w13 scales [E, 2I, H/32], w2
    [E, H, I/2], w2 scales [E, H, I/32]; uint8), w13 = [w1; w3]: the layout of ``dsv41::moe_mxfp4``."""
    w13 = torch.stack([torch.cat((e.w1.weight, e.w3.weight)) for e in experts]).view(torch.uint8)
    s13 = torch.stack([torch.cat((e.w1.scale, e.w3.scale)) for e in experts])
    w2 = torch.stack([e.w2.weight for e in experts]).view(torch.uint8)
    s2 = torch.stack([e.w2.scale for e in experts])
    return w13, s13, w2, s2


def marlin_expert_stack(experts: nn.ModuleList) -> tuple[torch.Tensor, ...]:
    """Quantised :class:`Expert` s on CUDA -> Marlin MXFP4 (w13, w2, w13 scales, w2 scales), w13 = [w1; w3]."""
    import types

    from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import (
        prepare_moe_mxfp4_layer_for_marlin)

    w13, s13, w2, s2 = mxfp4_expert_stack(experts)
    w13, w2, s13, s2, _, _ = prepare_moe_mxfp4_layer_for_marlin(types.SimpleNamespace(params_dtype=torch.bfloat16),
                                                                w13, w2, s13, s2, None, None)
    return w13, w2, s13, s2


def marlin_moe(x: torch.Tensor, stack: tuple[torch.Tensor, ...], idx: torch.Tensor, wts: torch.Tensor,
               limit: float) -> torch.Tensor:
    """Routed experts through vLLM's ``fused_marlin_moe``: x [T, H], idx [T, k], wts [T, k] -> [T, H]."""
    from vllm.model_executor.layers.fused_moe.activation import ApplyMoEActivationConfig, MoEActivation
    from vllm.model_executor.layers.fused_moe.experts.marlin_moe import fused_marlin_moe
    from vllm.scalar_type import scalar_types

    w13, w2, s13, s2 = stack
    y = fused_marlin_moe(x.to(FAST_GEMM_DTYPE).contiguous(), w13, w2, None, None, s13, s2,
                         wts.float().contiguous(), idx.to(torch.int32).contiguous(),
                         quant_type_id=scalar_types.float4_e2m1f.id, activation=MoEActivation.SILU,
                         activation_config=ApplyMoEActivationConfig(clamp_limit=limit))
    return y.to(x.dtype)


def _require_matmul_ogs() -> None:
    """Fail unless ``triton_kernels`` with ``matmul_ogs`` (the 3.5.1 / 3.6 API vLLM's CUDA wheel vendors under
    ``vllm/third_party``) imports; importing it through vLLM also registers it as ``triton_kernels``."""
    from vllm.utils import import_utils

    version = import_utils.get_triton_kernels_version()
    if version not in ("3.5.1", "3.6"):
        found = "it does not import" if version is None else f"found the {version} API, which has no matmul_ogs"
        raise RuntimeError(f"{MOE_ENV}=ogs needs the triton_kernels (matmul_ogs) that vLLM's CUDA wheel ships "
                           f"(vllm/third_party/triton_kernels); {found}")


def ogs_expert_stack(experts: nn.ModuleList) -> tuple:
    """Quantised :class:`Expert` s on CUDA -> (w13, w2, w13 precision, w2 precision) for ``matmul_ogs``: the stacked
    checkpoint bytes (:func:`mxfp4_expert_stack`, w13 = [w1; w3]) put into the Hopper value / scale layouts by
    vLLM's ``_swizzle_mxfp4`` (which also pins ``split_k=1`` on Hopper), the UE8M0 scales carried by
    ``PrecisionConfig``.  The bytes go in as stored: triton_kernels, like the checkpoint, packs the lower-indexed
    E2M1 element in the low nibble."""
    _require_matmul_ogs()
    from triton_kernels.matmul_ogs import FlexCtx, PrecisionConfig
    from vllm.model_executor.layers.quantization.utils.mxfp4_utils import _swizzle_mxfp4, mx_scale_kwargs

    w13, s13, w2, s2 = mxfp4_expert_stack(experts)
    w13, flex13, s13 = _swizzle_mxfp4(w13, s13)
    w2, flex2, s2 = _swizzle_mxfp4(w2, s2)
    return (w13, w2, PrecisionConfig(**mx_scale_kwargs(s13), flex_ctx=FlexCtx(rhs_data=flex13)),
            PrecisionConfig(**mx_scale_kwargs(s2), flex_ctx=FlexCtx(rhs_data=flex2)))


def ogs_moe(x: torch.Tensor, stack: tuple, idx: torch.Tensor, wts: torch.Tensor, limit: float) -> torch.Tensor:
    """Routed experts through ``matmul_ogs`` (:func:`ogs_expert_stack`): x [T, H], idx [T, k], wts [T, k] -> [T, H]
    in x's dtype.  vLLM's ``make_routing_data`` sorts the T*k rows by expert on the device (no host sync: the
    grids follow T and k only), the first GEMM gathers x's rows into that order, the clamped SwiGLU runs on those
    rows as they are, the second GEMM scales each row by its routing weight (bf16: vLLM's routing data casts
    them) and scatters it back to (token, slot) order, ``moe_sum`` adds the k slots."""
    from triton_kernels.matmul_ogs import matmul_ogs
    from vllm import _custom_ops as vops
    from vllm.model_executor.layers.fused_moe.activation import silu_and_mul_with_clamp
    from vllm.model_executor.layers.fused_moe.experts.gpt_oss_triton_kernels_moe import make_routing_data

    w13, w2, pc13, pc2 = stack
    T, k = idx.shape
    # importing vLLM's module above also patched triton_kernels' routing for a top-k that is not a power of 2 (6)
    routing, gather, scatter = make_routing_data(idx, wts, w13.shape[0])
    h = matmul_ogs(x.to(FAST_GEMM_DTYPE).contiguous(), w13, None, routing, gather_indx=gather,
                   precision_config=pc13)  # [T*k, 2I], rows grouped by expert
    act = h.new_empty(h.shape[0], h.shape[1] // 2)
    silu_and_mul_with_clamp(act, h, limit)
    routing.n_expts_act = 1  # each row lands in its own (token, slot) row; moe_sum reduces them
    y = matmul_ogs(act, w2, None, routing, scatter_indx=scatter, precision_config=pc2, gammas=routing.gate_scal)
    out = y.new_empty(T, y.shape[-1])
    vops.moe_sum(y.view(T, k, -1), out)
    return out.to(x.dtype)


_SCRATCH: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _scratch(w13: torch.Tensor, w2: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One pair of decoded-expert buffers per shape, dtype and device, shared by every layer (they run one at a
    time): [E, 2I, H] and [E, H, I] for the packed stacks w13 [E, 2I, H/2] and w2 [E, H, I/2]."""
    E, N, K2 = w13.shape
    H, I2 = w2.shape[1:]
    key = (E, N, K2, H, I2, dtype, w13.device)
    if key not in _SCRATCH:
        _SCRATCH[key] = (torch.empty(E, N, 2 * K2, dtype=dtype, device=w13.device),
                         torch.empty(E, H, 2 * I2, dtype=dtype, device=w13.device))
    return _SCRATCH[key]


BF16_MOE_TILES = dict(BLOCK_SIZE_M=128, BLOCK_SIZE_N=256, BLOCK_SIZE_K=64, GROUP_SIZE_M=1, num_warps=8, num_stages=4)
""":func:`bf16_moe`'s fused-MoE tiles where vLLM has no tuned file for the shape (it has none for 32 experts of 2304):
the fastest of ``kernel_times.py --only moe_bf16``'s sweep on the H200, 13.3 against 14.4 ms (vLLM's default tiles)
at 16,384 tokens and 4.6 against 4.9 ms at 4,096 (docs/benchmarks.md, session 11)."""


def _bf16_moe_tiles(w13_shape: tuple, w2_shape: tuple, k: int, T: int) -> dict:
    """vLLM's tuned tiles for this expert shape and batch where it ships a file, else :data:`BF16_MOE_TILES`."""
    from vllm.model_executor.layers.fused_moe import get_config
    from vllm.model_executor.layers.fused_moe.fused_moe import get_moe_configs, try_get_optimal_moe_config

    E, _, N = w2_shape
    if get_config() or get_moe_configs(E, N, None):
        return try_get_optimal_moe_config(w13_shape, w2_shape, k, None, T)
    return dict(BF16_MOE_TILES)


def bf16_moe(x: torch.Tensor, stack: tuple[torch.Tensor, ...], idx: torch.Tensor, wts: torch.Tensor,
             limit: float, config: dict | None = None) -> torch.Tensor:
    """Routed experts for a large batch (prefill): the MXFP4 stack (:func:`mxfp4_expert_stack`) decoded to bf16
    (``dsv41::dequant_mxfp4``), then vLLM's Triton fused-MoE GEMMs with the clamped SwiGLU between them.
    x [T, H], idx [T, k], wts [T, k] -> [T, H] (x's dtype).  ``config``: the GEMMs' tiles (``BLOCK_SIZE_M/N/K``,
    ``GROUP_SIZE_M``, ``num_warps``, ``num_stages``; sweeps), else :func:`_bf16_moe_tiles`."""
    from vllm_dsv41.ops import dequant_mxfp4  # noqa: F401

    w13q, s13, w2q, s2 = stack
    w13, w2 = _scratch(w13q, w2q, FAST_GEMM_DTYPE)
    torch.ops.dsv41.dequant_mxfp4(w13q, s13, w13)
    torch.ops.dsv41.dequant_mxfp4(w2q, s2, w2)
    config = dict(config) if config else _bf16_moe_tiles(tuple(w13.shape), tuple(w2.shape), idx.shape[1], x.shape[0])
    return _fused_moe_gemms(x, w13, w2, None, idx, wts, limit, config)


def _fused_moe_gemms(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, row_scales: tuple | None,
                     idx: torch.Tensor, wts: torch.Tensor, limit: float, config: dict) -> torch.Tensor:
    """vLLM's Triton fused-MoE kernel twice over a layer's decoded experts (w13 [E, 2I, H], w2 [E, H, I]) with the
    clamped SwiGLU between and ``moe_sum`` after: bf16 operands, or (``row_scales`` = (w13 [E, 2I], w2 [E, H]) fp32)
    FP8 weights under those per-row scales and both GEMMs' activations quantised per token (vLLM's dynamic FP8
    quantisation).  x [T, H], idx [T, k], wts [T, k] -> [T, H] (x's dtype)."""
    import triton.language as tl
    from vllm import _custom_ops as vops
    from vllm.model_executor.layers.fused_moe.activation import (ApplyMoEActivationConfig, MoEActivation,
                                                                apply_moe_activation)
    from vllm.model_executor.layers.fused_moe.fused_moe import dispatch_fused_moe_kernel
    from vllm.model_executor.layers.fused_moe.moe_align_block_size import moe_align_block_size

    fp8 = row_scales is not None

    def operand(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if fp8:
            return vops.scaled_fp8_quant(t, use_per_token_if_dynamic=True)
        return t, None

    T, k = idx.shape
    E, N, _ = w13.shape
    H = w2.shape[1]
    idx = idx.to(torch.int32).contiguous()
    wts = wts.float().contiguous()
    sorted_ids, expert_ids, n_padded = moe_align_block_size(idx, config["BLOCK_SIZE_M"], E)
    gemm = dict(sorted_token_ids=sorted_ids, expert_ids=expert_ids, num_tokens_post_padded=n_padded,
                config=config, compute_type=tl.bfloat16, use_fp8_w8a8=fp8, use_int8_w8a8=False,
                use_int8_w8a16=False, use_int4_w4a16=False, per_channel_quant=fp8)
    s13, s2 = row_scales if fp8 else (None, None)
    a, a_scale = operand(x.to(FAST_GEMM_DTYPE).contiguous())
    h = torch.empty(T, k, N, dtype=FAST_GEMM_DTYPE, device=x.device)
    dispatch_fused_moe_kernel(a, w13, h, a_scale, s13, None, wts, mul_routed_weight=False, top_k=k, **gemm)
    act = torch.empty(T * k, N // 2, dtype=FAST_GEMM_DTYPE, device=x.device)
    apply_moe_activation(MoEActivation.SILU, act, h.view(-1, N),
                         activation_config=ApplyMoEActivationConfig(clamp_limit=limit))
    act, act_scale = operand(act)
    y = torch.empty(T, k, H, dtype=FAST_GEMM_DTYPE, device=x.device)
    dispatch_fused_moe_kernel(act, w2, y, act_scale, s2, None, wts, mul_routed_weight=True, top_k=1, **gemm)
    out = torch.empty(T, H, dtype=FAST_GEMM_DTYPE, device=x.device)
    vops.moe_sum(y, out)
    return out.to(x.dtype)


def fp8_row_exponents(stack: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                 torch.Tensor]:
    """For :func:`fp8_moe`, once at load: (w13 row exponents int32 [E, 2I], w13 row scales fp32 [E, 2I], the same
    for w2 [E, H]) of an MXFP4 stack (:func:`mxfp4_expert_stack`; ``formats.mxfp4_row_exponents``)."""
    _, s13, _, s2 = stack
    e13, e2 = formats.mxfp4_row_exponents(s13).contiguous(), formats.mxfp4_row_exponents(s2).contiguous()
    return e13, formats.mxfp4_fp8_row_scale(e13), e2, formats.mxfp4_fp8_row_scale(e2)


FP8_MOE_TILES = dict(BLOCK_SIZE_M=128, BLOCK_SIZE_N=256, BLOCK_SIZE_K=128, GROUP_SIZE_M=1, num_warps=8, num_stages=3)
""":func:`fp8_moe`'s fused-MoE tiles (vLLM ships no tuned FP8 file for 32 experts of 2304): bf16_moe's measured
tiles with 128-wide K steps (an FP8 MMA takes K = 32 per instruction; 128 bytes a row per step, as bf16's 64)."""


def fp8_moe(x: torch.Tensor, stack: tuple[torch.Tensor, ...], rows: tuple[torch.Tensor, ...], idx: torch.Tensor,
            wts: torch.Tensor, limit: float, config: dict | None = None, gemm: str | None = None) -> torch.Tensor:
    """Routed experts in FP8 for a large batch (prefill): the MXFP4 stack (:func:`mxfp4_expert_stack`) turned into
    FP8 under one power of two per row (``dsv41::dequant_mxfp4_fp8``; ``rows`` = :func:`fp8_row_exponents`), the
    activations quantised per token (vLLM's dynamic FP8 quantisation, as ``w8a8_gemm``), then two grouped GEMMs
    with per-token x per-channel scales and the clamped SwiGLU between them: vLLM's Triton fused-MoE kernel
    (``config``: its tiles) or its CUTLASS grouped GEMM (``gemm``, default :func:`fp8_moe_gemm_backend`).  x [T, H],
    idx [T, k], wts [T, k] -> [T, H] (x's dtype).  CUDA only (the CPU reference of its arithmetic is
    :func:`fp8_moe_ref`)."""
    from vllm_dsv41.ops import dequant_mxfp4  # noqa: F401

    w13q, s13, w2q, s2 = stack
    e13, r13, e2, r2 = rows
    w13, w2 = _scratch(w13q, w2q, torch.float8_e4m3fn)
    torch.ops.dsv41.dequant_mxfp4_fp8(w13q, s13, e13, w13)
    torch.ops.dsv41.dequant_mxfp4_fp8(w2q, s2, e2, w2)
    if (gemm or fp8_moe_gemm_backend()) == "cutlass":
        return _cutlass_moe_gemms(x, w13, w2, (r13, r2), idx, wts, limit)
    return _fused_moe_gemms(x, w13, w2, (r13, r2), idx, wts, limit, dict(config) if config else dict(FP8_MOE_TILES))


_CUTLASS_STRIDES: dict[tuple, tuple[torch.Tensor, ...]] = {}


def _cutlass_strides(E: int, H: int, I: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """``cutlass_moe_mm``'s per-expert row strides (int64 [E] each): (x and w13 rows: H, h rows: 2I, act and w2
    rows: I, y rows: H), made once per shape and device (a captured pass must not allocate them anew)."""
    key = (E, H, I, device)
    if key not in _CUTLASS_STRIDES:
        _CUTLASS_STRIDES[key] = tuple(torch.full((E,), n, dtype=torch.int64, device=device) for n in (H, 2 * I, I))
    return _CUTLASS_STRIDES[key]


def _cutlass_moe_gemms(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, row_scales: tuple[torch.Tensor, ...],
                       idx: torch.Tensor, wts: torch.Tensor, limit: float) -> torch.Tensor:
    """:func:`_fused_moe_gemms`' FP8 arithmetic through vLLM's CUTLASS grouped GEMM (SM90): x quantised per token,
    its (token, slot) rows permuted into expert order (``moe_permute``, the scales with them), ``cutlass_moe_mm``
    against w13 [E, 2I, H] under the per-row scales, the clamped SwiGLU, the activations quantised per token,
    ``cutlass_moe_mm`` against w2 [E, H, I], then ``moe_unpermute`` weights each row by its routing weight and sums
    the k slots of a token.  The routing weight multiplies the bf16 GEMM output here (the Triton route multiplies
    in the GEMM's fp32 epilogue): one more bf16 rounding, within the test's bound.  -> [T, H] (x's dtype)."""
    from vllm import _custom_ops as vops
    from vllm.model_executor.layers.fused_moe.activation import (ApplyMoEActivationConfig, MoEActivation,
                                                                apply_moe_activation)
    from vllm.model_executor.layers.fused_moe.moe_permute_unpermute import moe_permute, moe_unpermute

    T, k = idx.shape
    E, N, H = w13.shape
    I = N // 2
    s13, s2 = row_scales
    rows_h, rows_n, rows_i = _cutlass_strides(E, H, I, x.device)
    a, a_scale = vops.scaled_fp8_quant(x.to(FAST_GEMM_DTYPE).contiguous(), use_per_token_if_dynamic=True)
    a, a_scale, first, inverse, _ = moe_permute(a, a_scale, idx.to(torch.int32).contiguous(), E, E)
    sizes1 = torch.empty(E, 3, dtype=torch.int32, device=x.device)
    sizes2 = torch.empty(E, 3, dtype=torch.int32, device=x.device)
    vops.get_cutlass_moe_mm_problem_sizes_from_expert_offsets(first, sizes1, sizes2, I, H, T * k <= 64)
    offsets = first[:-1]
    h = torch.empty(T * k, N, dtype=FAST_GEMM_DTYPE, device=x.device)
    vops.cutlass_moe_mm(h, a, w13, a_scale, s13, offsets, sizes1, rows_h, rows_h, rows_n, True, True)
    act = torch.empty(T * k, I, dtype=FAST_GEMM_DTYPE, device=x.device)
    apply_moe_activation(MoEActivation.SILU, act, h, activation_config=ApplyMoEActivationConfig(clamp_limit=limit))
    act, act_scale = vops.scaled_fp8_quant(act, use_per_token_if_dynamic=True)
    y = torch.empty(T * k, H, dtype=FAST_GEMM_DTYPE, device=x.device)
    vops.cutlass_moe_mm(y, act, w2, act_scale, s2, offsets, sizes2, rows_i, rows_i, rows_h, True, True)
    out = torch.empty(T, H, dtype=FAST_GEMM_DTYPE, device=x.device)
    moe_unpermute(out, y, wts.float().contiguous(), inverse, first)
    return out.to(x.dtype)


def fp8_moe_ref(x: torch.Tensor, stack: tuple[torch.Tensor, ...], idx: torch.Tensor, wts: torch.Tensor,
                limit: float) -> torch.Tensor:
    """:func:`fp8_moe`'s arithmetic in fp32 (any device): FP8 weights under per-row scales
    (``formats.mxfp4_to_fp8_rows``), activations quantised per token before each GEMM, the clamped SwiGLU, a loop
    over the experts hit; the GEMM outputs and the activation rounded to x's dtype where the kernels store them (bf16
    on the GPU: that rounding moves ~1 in 30 FP8 codes of the activation by one step, ~1.3e-2 of the output against
    fp32 intermediates on the H200).  The GPU test's reference for the kernels' part of the error."""
    from vllm_dsv41.reference.model import clamped_swiglu_act

    w13q, s13, w2q, s2 = stack
    w13, r13 = formats.mxfp4_to_fp8_rows(w13q, s13)
    w2, r2 = formats.mxfp4_to_fp8_rows(w2q, s2)
    I = w13.shape[1] // 2
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    for e in idx.unique().tolist():
        t, slot = (idx == e).nonzero(as_tuple=True)
        h = w8a8_ref(x[t], w13[e], r13[e]).to(x.dtype).float()
        act = clamped_swiglu_act(h[:, :I], h[:, I:], limit).to(x.dtype)
        y = w8a8_ref(act, w2[e], r2[e])
        out.index_add_(0, t, y * wts[t, slot].float()[:, None])
    return out.to(x.dtype)


def _expert_out(x: torch.Tensor, ex: "Expert", limit: float) -> torch.Tensor:
    from vllm_dsv41.reference.model import swiglu_clamped

    return swiglu_clamped(x, ex.weight("w1").to(x.dtype), ex.weight("w3").to(x.dtype), ex.weight("w2").to(x.dtype),
                          limit)


def loop_moe(x: torch.Tensor, experts: nn.ModuleList, idx: torch.Tensor, wts: torch.Tensor,
             limit: float) -> torch.Tensor:
    """Routed experts one by one over their (dequantised) weights, each on the rows that chose it: the
    reference path (host-synchronising: the chosen experts and their rows are read on the host)."""
    idx = idx.long()
    y = torch.zeros_like(x)
    for e in idx.unique().tolist():
        t, slot = (idx == e).nonzero(as_tuple=True)
        y.index_add_(0, t, _expert_out(x[t], experts[e], limit) * wts[t, slot, None].to(x.dtype))
    return y


def masked_moe(x: torch.Tensor, experts: nn.ModuleList, idx: torch.Tensor, wts: torch.Tensor,
               limit: float) -> torch.Tensor:
    """``loop_moe`` without a host sync, for captured decode steps on the dequantised path: every expert
    runs on every row and is weighted by that row's routing weight for it (0 when not chosen), in the
    same expert order, so each row sums the same products (plus exact zeros).  E/k times the FLOPs."""
    idx = idx.long()
    y = torch.zeros_like(x)
    for e, ex in enumerate(experts):
        g = (wts * (idx == e)).sum(1, keepdim=True).to(x.dtype)
        y += _expert_out(x, ex, limit) * g
    return y
