"""``dsv41::swiglu_quant`` - the clamped SwiGLU of the shared expert with its output quantised to E4M3 per row.

``swiglu_quant(y [T, 2I], limit) -> (h [T, I] in y's dtype, codes [T, I] float8_e4m3fn, scales [T, 1] fp32)``::

    h     = silu(min(a, L)) * clamp(b, -L, L)      a = y[:, :I] (gate), b = y[:, I:] (up); fp32, rounded to y's dtype
    codes = e4m3(h / scale), scale = max(amax(h) / 448, formats.FP8_TOKEN_SCALE_FLOOR)   (formats.quant_fp8_tokens)

Why an op: on the fast path the shared expert's ``w2`` is a ``w8a8`` GEMM, which quantises its input per token in a
launch of its own; here the activation and that quantisation are one launch (vLLM's ``silu_and_mul_with_clamp``
and ``scaled_fp8_quant`` were two), the codes those two would make of the same h.  One program per row (I = 2,304 in
the target): the row held in registers, one read of y and one write of h and the codes (rows wider than
``MAX_ONE_PASS``: two passes, h recomputed rather than re-read, so no barrier between them).  h is returned too (the
tests hold the codes to it bit for bit).
"""

from __future__ import annotations

import functools

import torch

from vllm_dsv41 import formats
from vllm_dsv41.ops import define_op
from vllm_dsv41.ops._triton import ROW_COUNT_ARGS, gdc_launch_dependents, gdc_wait, pdl, pdl_launch
from vllm_dsv41.reference.model import clamped_swiglu_act

__all__ = ["swiglu_quant", "swiglu_quant_ref"]

MAX_ONE_PASS = 8192  # rows up to this many columns stay in registers (one pass) ...
BLOCK_I = 1024  # ... wider ones take two passes of this many columns a step


def _check(y: torch.Tensor) -> None:
    if y.dim() != 2 or y.shape[1] % 2:
        raise ValueError(f"swiglu_quant: y must be [T, 2I], got {tuple(y.shape)}")


def swiglu_quant_ref(y: torch.Tensor, limit: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain PyTorch: the clamped SwiGLU in fp32 rounded to y's dtype, then ``formats.quant_fp8_tokens``."""
    _check(y)
    n = y.shape[1] // 2
    h = clamped_swiglu_act(y[:, :n].float(), y[:, n:].float(), limit).to(y.dtype)
    return (h, *formats.quant_fp8_tokens(h))


tl = None  # triton.language, bound by _kernels()


def _swiglu_quant_kernel(y_ptr, h_ptr, q_ptr, s_ptr, T, I, limit, floor, stride_yt, stride_ht, stride_qt,
                         BLOCK: tl.constexpr, ONE_PASS: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:  # programmatic dependent launch: the previous kernel first
        gdc_wait()
        gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    yrow, hrow, qrow = y_ptr + t * stride_yt, h_ptr + t * stride_ht, q_ptr + t * stride_qt
    if ONE_PASS:  # BLOCK >= I: the row stays in registers
        cols = tl.arange(0, BLOCK)
        m = cols < I
        h = _act(yrow, cols, m, I, limit).to(h_ptr.dtype.element_ty)
        mx = tl.max(tl.abs(h.to(tl.float32)), axis=0)
        scale = _fp8_token_scale(mx, floor)
        tl.store(s_ptr + t, scale)
        _codes_out(qrow, cols, m, h, scale, BLOCK)
        tl.store(hrow + cols, h, mask=m)
    else:  # two passes: the amax, then h recomputed (not re-read: no barrier) with its codes
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for c0 in range(0, I, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            m = cols < I
            h = _act(yrow, cols, m, I, limit).to(h_ptr.dtype.element_ty)
            amax = tl.maximum(amax, tl.abs(h.to(tl.float32)))
        mx = tl.max(amax, axis=0)
        scale = _fp8_token_scale(mx, floor)
        tl.store(s_ptr + t, scale)
        for c0 in range(0, I, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            m = cols < I
            h = _act(yrow, cols, m, I, limit).to(h_ptr.dtype.element_ty)
            _codes_out(qrow, cols, m, h, scale, BLOCK)
            tl.store(hrow + cols, h, mask=m)


def _act(yrow, cols, m, I, limit):
    # silu(min(a, L)) * clamp(b, -L, L) in fp32 for gate a = y[:I], up b = y[I:]
    a = tl.minimum(tl.load(yrow + cols, mask=m, other=0.0).to(tl.float32), limit)
    b = tl.minimum(tl.maximum(tl.load(yrow + I + cols, mask=m, other=0.0).to(tl.float32), -limit), limit)
    return a / (1.0 + tl.exp(-a)) * b


def _codes_out(qrow, cols, m, h, scale, BLOCK: tl.constexpr):
    # E4M3 bytes of h / scale, the division correctly rounded (formats.quant_fp8_tokens)
    v = tl.math.div_rn(h.to(tl.float32), tl.full([BLOCK], 1.0, tl.float32) * scale)
    tl.store(qrow + cols, _e4m3_byte(v).to(tl.uint8), mask=m)


@functools.lru_cache(maxsize=None)
def _kernels():
    import triton
    import triton.language

    from vllm_dsv41.ops import compressor

    compressor._kernels()  # its E4M3 helpers become JIT functions
    module = globals()
    module["tl"] = triton.language
    module.update(_e4m3_byte=compressor._e4m3_byte, _fp8_token_scale=compressor._fp8_token_scale)
    module["_act"] = triton.jit(_act)
    module["_codes_out"] = triton.jit(_codes_out)
    module["_swiglu_quant_kernel"] = triton.jit(_swiglu_quant_kernel, do_not_specialize=ROW_COUNT_ARGS)
    return module["_swiglu_quant_kernel"]


def _swiglu_quant_triton(y: torch.Tensor, limit: float, block: int | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The launch: one row a program, the row in registers up to :data:`MAX_ONE_PASS` columns (``block`` forces a
    width, the tests' two-pass case)."""
    _check(y)
    if y.stride(1) != 1:
        raise ValueError("swiglu_quant (Triton): y's rows must be contiguous")
    T, n = y.shape[0], y.shape[1] // 2
    h = torch.empty(T, n, dtype=y.dtype, device=y.device)
    q = torch.empty(T, n, dtype=torch.float8_e4m3fn, device=y.device)
    s = torch.empty(T, 1, dtype=torch.float32, device=y.device)
    if T:
        q8 = q.view(torch.uint8)
        pow2 = 1 << max(0, (n - 1).bit_length())
        block = block or (pow2 if pow2 <= MAX_ONE_PASS else BLOCK_I)
        _kernels()[(T,)](y, h, q8, s, T, n, float(limit), formats.FP8_TOKEN_SCALE_FLOOR,
                         y.stride(0), h.stride(0), q8.stride(0), BLOCK=block, ONE_PASS=block >= n,
                         num_warps=max(4, min(16, block // 512)), **pdl_launch(pdl(y)))
    return h, q, s


def _swiglu_quant_fake(y: torch.Tensor, limit: float):
    T, n = y.shape[0], y.shape[1] // 2
    return (y.new_empty(T, n), y.new_empty(T, n, dtype=torch.float8_e4m3fn),
            y.new_empty(T, 1, dtype=torch.float32))


swiglu_quant = define_op("swiglu_quant", "(Tensor y, float limit) -> (Tensor, Tensor, Tensor)",
                         swiglu_quant_ref, _swiglu_quant_triton, _swiglu_quant_fake)
