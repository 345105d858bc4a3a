"""``dsv41::dequant_mxfp4`` - MXFP4 weights (packed E2M1 + UE8M0 per 32) -> bf16, written into a given buffer.

``dequant_mxfp4(w [..., R, C/2] uint8, s [..., R, C/32] uint8, out [..., R, C] bf16) -> ()``: ``out`` =
``formats.dequant_mxfp4(w, s)`` (low nibble = even input), rounded to ``out``'s dtype.  Exact in bf16: an
E2M1 value times a power of two is a 1-3 bit mantissa.

Why an op: prefill runs the routed experts through a bf16 grouped GEMM (vLLM's Triton fused-MoE kernel) on
one layer's experts decoded into a scratch buffer just before (``linear.bf16_moe``), because Marlin's W4A16
kernel, built for small batches, was 43% of a 16k-token prefill's GPU time on the H200 (docs/benchmarks.md);
the decode costs one pass over the layer's weights (566 MB of FP4 -> 2.3 GB of bf16 at the bench width),
which a long prefill amortises.  The torch reference materialises int64 indices per element (far too much
memory at that size), hence a Triton kernel: one program per ``BLOCK_R`` rows x ``BLOCK_C`` packed bytes.

``dequant_mxfp4_fp8(w, s, row_exp [..., R] int32, out [..., R, C] float8_e4m3fn) -> ()``: the same values divided
by each row's power of two ``formats.mxfp4_fp8_row_scale(row_exp)`` (``row_exp`` = ``formats.mxfp4_row_exponents(s)``,
computed once at load), i.e. ``formats.mxfp4_to_fp8_rows``' bytes: the FP8 prefill MoE (``linear.fp8_moe``) runs
vLLM's FP8 fused-MoE GEMMs on them with per-row weight and per-token activation scales, half the scratch bytes of
bf16 and twice the tensor-core rate.
"""

from __future__ import annotations

import functools

import torch

from vllm_dsv41 import formats
from vllm_dsv41.ops import define_op
from vllm_dsv41.ops._triton import jit_with_e2m1

__all__ = ["dequant_mxfp4", "dequant_mxfp4_ref", "dequant_mxfp4_fp8", "dequant_mxfp4_fp8_ref"]


def _check(w: torch.Tensor, s: torch.Tensor, out: torch.Tensor) -> tuple[int, int]:
    C2 = w.shape[-1]
    want_s = (*w.shape[:-1], C2 // 16)
    want_out = (*w.shape[:-1], 2 * C2)
    if C2 % 16 or tuple(s.shape) != want_s:
        raise ValueError(f"dequant_mxfp4: scales {tuple(s.shape)} do not match packed weight {tuple(w.shape)} "
                         f"(expected {want_s}; rows of a multiple of 32 inputs)")
    if tuple(out.shape) != want_out:
        raise ValueError(f"dequant_mxfp4: out {tuple(out.shape)}, expected {want_out} for packed weight "
                         f"{tuple(w.shape)}")
    if not (w.is_contiguous() and s.is_contiguous() and out.is_contiguous()):
        raise ValueError("dequant_mxfp4: w, s and out must be contiguous")
    return w.numel() // C2, C2


def _check_fp8(w: torch.Tensor, s: torch.Tensor, row_exp: torch.Tensor, out: torch.Tensor) -> tuple[int, int]:
    R, C2 = _check(w, s, out)
    if out.dtype != torch.float8_e4m3fn:
        raise ValueError(f"dequant_mxfp4_fp8: out is {out.dtype}, expected torch.float8_e4m3fn")
    if tuple(row_exp.shape) != tuple(w.shape[:-1]) or row_exp.dtype != torch.int32 or not row_exp.is_contiguous():
        raise ValueError(f"dequant_mxfp4_fp8: row_exp {tuple(row_exp.shape)} {row_exp.dtype}, expected contiguous "
                         f"int32 {tuple(w.shape[:-1])} (formats.mxfp4_row_exponents of the scales)")
    return R, C2


def dequant_mxfp4_ref(w: torch.Tensor, s: torch.Tensor, out: torch.Tensor) -> None:
    _check(w, s, out)
    out.copy_(formats.dequant_mxfp4(w.view(torch.uint8), s.view(torch.uint8)))


def dequant_mxfp4_fp8_ref(w: torch.Tensor, s: torch.Tensor, row_exp: torch.Tensor, out: torch.Tensor) -> None:
    _check_fp8(w, s, row_exp, out)
    row_scale = formats.mxfp4_fp8_row_scale(row_exp).unsqueeze(-1)
    out.copy_(formats._to_e4m3(formats.dequant_mxfp4(w.view(torch.uint8), s.view(torch.uint8)) / row_scale))


def _dequant_kernel(w_ptr, s_ptr, r_ptr, out_ptr, R, C2, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                    ROW_EXP: tl.constexpr, HEADROOM: tl.constexpr):
    """Rows [BLOCK_R] x packed bytes [BLOCK_C] -> 2 * BLOCK_C outputs per row (even: low nibble, odd: high); with
    ROW_EXP each row divided by 2**(row_exp - 127 - HEADROOM) (exact powers of two; the FP8 store rounds, RNE)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < R)[:, None] & (cols < C2)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    b = tl.load(w_ptr + r64 * C2 + cols[None, :], mask=mask, other=0).to(tl.int32)
    e = tl.load(s_ptr + r64 * (C2 // 16) + (cols // 16)[None, :], mask=mask, other=127).to(tl.float32)
    if ROW_EXP:
        re = tl.load(r_ptr + rows, mask=rows < R, other=127).to(tl.float32)
        half_scale = tl.exp2(e - re[:, None] + (HEADROOM - 1.0))  # _e2m1_twice returns 2 * value
    else:
        half_scale = tl.exp2(e - 128.0)
    lo = _e2m1_twice(b & 15) * half_scale
    hi = _e2m1_twice(b >> 4) * half_scale
    # even and odd outputs interleaved in registers, then one contiguous store per row (two stores at a stride of two
    # elements ran the FP8 conversion at ~1 TB/s on the H200, docs/benchmarks.md session 15)
    v = tl.reshape(tl.join(lo, hi), [BLOCK_R, 2 * BLOCK_C])
    ocols = 2 * tl.program_id(1) * BLOCK_C + tl.arange(0, 2 * BLOCK_C)
    omask = (rows < R)[:, None] & (ocols < 2 * C2)[None, :]
    # round to nearest even: Triton's default for an fp32 -> fp8 cast is towards zero (exact values are unaffected;
    # those of blocks more than 14 binades below the row's largest round, as formats.mxfp4_to_fp8_rows does)
    tl.store(out_ptr + r64 * (2 * C2) + ocols[None, :], v.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
             mask=omask)


@functools.lru_cache(maxsize=None)
def _kernels():
    return jit_with_e2m1(globals(), "_dequant_kernel")


BLOCK_R, BLOCK_C = 16, 128


def _launch(w: torch.Tensor, s: torch.Tensor, row_exp: torch.Tensor | None, out: torch.Tensor, R: int, C2: int,
            tiles: tuple[int, int, int] | None = None):
    block_r, block_c, warps = tiles or (BLOCK_R, BLOCK_C, 4)
    grid = (-(-R // block_r), -(-C2 // block_c))
    _kernels()[grid](w.view(torch.uint8), s.view(torch.uint8), row_exp if row_exp is not None else s, out, R, C2,
                     BLOCK_R=block_r, BLOCK_C=block_c, ROW_EXP=row_exp is not None,
                     HEADROOM=formats.MXFP4_FP8_HEADROOM, num_warps=warps)


def _dequant_mxfp4_triton(w: torch.Tensor, s: torch.Tensor, out: torch.Tensor) -> None:
    _launch(w, s, None, out, *_check(w, s, out))


def _dequant_mxfp4_fp8_triton(w: torch.Tensor, s: torch.Tensor, row_exp: torch.Tensor, out: torch.Tensor,
                              tiles: tuple[int, int, int] | None = None) -> None:
    """``tiles`` = (BLOCK_R, BLOCK_C packed bytes, warps) for sweeps (default: the module's)."""
    _launch(w, s, row_exp, out, *_check_fp8(w, s, row_exp, out), tiles=tiles)


dequant_mxfp4 = define_op("dequant_mxfp4", "(Tensor w, Tensor s, Tensor(a!) out) -> ()",
                          dequant_mxfp4_ref, _dequant_mxfp4_triton)
dequant_mxfp4_fp8 = define_op("dequant_mxfp4_fp8", "(Tensor w, Tensor s, Tensor row_exp, Tensor(a!) out) -> ()",
                              dequant_mxfp4_fp8_ref, _dequant_mxfp4_fp8_triton)
