"""``dsv41::fp8_gemm`` - a few tokens through an FP8 (32x32 UE8M0 tiles) weight, reading the FP8 bytes; and
``dsv41::fp8_rows_gemm`` - the same through the row-scaled E4M3 weights that ``w8a8`` keeps (end of this module).

Maths (the checkpoint's dense weights, architecture.md §6)::

    out[m, n] = sum_k x[m, k] * w[n, k] * 2^(s[n // 32, k // 32] - 127)      fp32 accumulation, bf16 out

Shapes: x [M, K] bf16 (M small: decode), w [N, K] E4M3 bytes (uint8 or float8_e4m3fn), s uint8 [N/32, K/32]
-> [M, N] in x's dtype (the kernel takes bf16 x; other dtypes go through the reference).  N and K multiples
of 32.  ``groups`` G > 1 is the grouped linear (``wo_a``): x [M, G*K], group
g's input slice x[:, gK:(g+1)K] through its N/G weight rows into out[:, g*N/G:(g+1)*N/G] (N/G a multiple of 32).

Why an op: at decode the dense GEMMs read their weights once per step and are bandwidth-bound; the default
fast path dequantises the FP8 weights to bf16 once (cuBLAS on twice the bytes), and vLLM's Marlin W8A16 on
the FP8 bytes was measured slower than that at 64 tokens (docs/benchmarks.md, session 8).  This kernel reads
the FP8 bytes and is built for few tokens:

* "swap AB": the weight is the MMA's M side (``BLOCK_N`` rows per program) and the tokens its N side
  (``BLOCK_M`` >= 16), so 1..64 tokens waste no MMA rows; the output tile is stored transposed.
* K steps of 32, one scale tile each: the E4M3 bytes convert exactly to bf16 (hardware ``cvt``) and go to the
  MMA unscaled; the step's fp32 partial is multiplied by its power-of-two scale (exact) and added (DeepGEMM's
  promotion, here per 32-wide tile).  No scale broadcast over the weight tile, no extra rounding.
* Split K (``SPLIT_K`` programs per row block, fp32 partials summed in a fixed order by a second small
  kernel) so that narrow weights (N = 1,792) still cover the SMs.

Numerics: the products and scales are exact; the sums are fp32 in another order than cuBLAS's, so results
match the bf16 path to fp32 summation rounding, then bf16.  Status (H200, docs/benchmarks.md session 10): 9-37% of
the bandwidth, slower than cuBLAS on the bf16 copy at every decode size (e.g. ``wo_b`` at 64 tokens 53.2 against
27.7 µs); the model uses it only with ``VLLM_DSV41_DENSE_GEMM=fp8``.
"""

from __future__ import annotations

import torch

from vllm_dsv41 import formats
from vllm_dsv41.ops import define_op
from vllm_dsv41.ops._triton import (
    HAS_TRITON, gdc_launch_dependents, gdc_wait, hw_fp8 as _hw_fp8, interpreting, pdl, pdl_launch, sm_count, tl, triton,
)

if HAS_TRITON:  # the record decoders of sparse_attn: E4M3 (hardware or bit by bit) and UE8M0
    from vllm_dsv41.ops.sparse_attn import _e4m3_to_f32, _e8m0_to_f32

TILE = 32
MAX_M = 64
"""Token counts the kernel serves (the model's decode steps); more go through the dequantised path."""


def fp8_gemm_ref(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """Plain PyTorch (CPU implementation and test oracle): the dequantised weight, fp32 product, x's dtype out."""
    _check(x, w, scale, groups)
    return _grouped_product(x, formats.dequant_fp8_block(formats.as_uint8(w), formats.as_uint8(scale), TILE), groups)


def _grouped_product(x: torch.Tensor, wd: torch.Tensor, groups: int) -> torch.Tensor:
    """x [M, groups*K] through the dequantised weight wd [N, K], each group's slice through its N/groups rows; fp32,
    x's dtype out."""
    M, (N, K) = x.shape[0], wd.shape
    if groups == 1:
        return (x.float() @ wd.t()).to(x.dtype)
    xg = x.float().view(M, groups, K)
    return torch.einsum("mgk,gok->mgo", xg, wd.view(groups, N // groups, K)).reshape(M, N).to(x.dtype)


def _check(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, groups: int) -> None:
    if x.dim() != 2 or w.dim() != 2 or groups < 1 or x.shape[1] != groups * w.shape[1]:
        raise ValueError(f"fp8_gemm: x [M, {groups} x K] and w [N, K] expected, got {tuple(x.shape)} and "
                         f"{tuple(w.shape)}")
    N, K = w.shape
    if N % (TILE * groups) or K % TILE:
        raise ValueError(f"fp8_gemm: N={N} (per group {N // groups}) and K={K} must be multiples of {TILE}")
    if tuple(scale.shape) != (N // TILE, K // TILE):
        raise ValueError(f"fp8_gemm: scale must be [{N // TILE}, {K // TILE}], got {tuple(scale.shape)}")


@triton.jit
def _fp8_gemm_kernel(
    x_ptr,        # [M, K] bf16
    w_ptr,        # [N, K] uint8 E4M3
    s_ptr,        # [N/32, K/32] uint8 UE8M0
    part_ptr,     # [SPLIT_K, M, N] fp32 partials (SPLIT_K > 1) or the [M, N] bf16 output
    M, N, K, k_per_split, NG,     # NG: weight rows (output columns) per group
    stride_xm, stride_wn, stride_sn, stride_pm,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, SPLIT_K: tl.constexpr, HW_FP8: tl.constexpr,
    DOT_F32: tl.constexpr, PDL: tl.constexpr = False,
):
    if PDL:  # programmatic dependent launch: the previous kernel first
        gdc_wait()
        gdc_launch_dependents()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_g = tl.program_id(2)
    local_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = local_n < NG
    offs_n = pid_g * NG + local_n       # weight row = output column
    x_ptr += pid_g * K                  # the group's input slice
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, 32)
    m_ok = offs_m < M
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(k_begin, k_end, 32):
        wb = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (k0 + offs_k)[None, :], mask=n_ok[:, None],
                     other=0)
        wv = _e4m3_to_f32(wb.to(tl.int32), HW_FP8)
        xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + (k0 + offs_k)[:, None], mask=m_ok[None, :], other=0.0)
        if DOT_F32:
            part = tl.dot(wv, xt.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(wv.to(tl.bfloat16), xt)
        se = tl.load(s_ptr + (offs_n // 32) * stride_sn + k0 // 32, mask=n_ok, other=127).to(tl.int32)
        acc += part * _e8m0_to_f32(se)[:, None]
    out_ptrs = part_ptr + pid_k * M * N + offs_m[None, :] * stride_pm + offs_n[:, None]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(part_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])
    else:
        tl.store(out_ptrs, acc, mask=n_ok[:, None] & m_ok[None, :])


@triton.jit
def _split_sum_kernel(part_ptr, out_ptr, MN, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:  # programmatic dependent launch: the previous kernel first
        gdc_wait()
        gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):  # fixed order: the same bits on every run
        acc += tl.load(part_ptr + s * MN + offs, mask=ok, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def _sum_splits(part: torch.Tensor, out: torch.Tensor, split: int) -> torch.Tensor:
    """``out`` = the sum of the ``split`` fp32 partials in ``part`` (fixed order); with one split the kernel wrote
    ``out`` itself."""
    if split > 1:
        block = 1024
        _split_sum_kernel[(-(-out.numel() // block),)](part, out, out.numel(), SPLIT_K=split, BLOCK=block, num_warps=4,
                                                       **pdl_launch(pdl(part)))
    return out


def plan(M: int, N: int, K: int, sms: int, groups: int = 1) -> dict:
    """Launch parameters: 128 weight rows per program (64 when that leaves half the SMs idle), the token side
    padded to a power of two >= 16, K split (whole 32-wide steps, >= 256 per split) until the programs cover
    the SMs, and 6 pipeline stages: a 32-wide step moves only 4 KB of weight per 128 rows, so several must be in
    flight to keep HBM busy (sm_90 build: no spills, 104 registers, ~150 instructions per step at 128 x 64).
    Chosen by reasoning, not yet by measurement."""
    block_n = 128 if N // 128 >= sms // 2 else 64
    block_m = max(16, triton.next_power_of_2(M))
    n_blocks = groups * -(-(N // groups) // block_n)
    split = max(1, min(16, -(-sms // n_blocks), K // 256))
    k_per_split = -(-(K // 32) // split) * 32
    return dict(BLOCK_N=block_n, BLOCK_M=block_m, SPLIT_K=-(-K // k_per_split), k_per_split=k_per_split,
                num_warps=4 if block_n == 64 else 8, num_stages=6)


def _fp8_gemm_triton(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, groups: int = 1,
                     hw_fp8: bool | None = None, config: dict | None = None) -> torch.Tensor:
    """Launch the kernel (``config`` overrides :func:`plan`'s choices, for sweeps)."""
    _check(x, w, scale, groups)
    M = x.shape[0]
    N, K = w.shape
    if M > MAX_M or x.dtype != torch.bfloat16:
        return fp8_gemm_ref(x, w, scale, groups)
    x = x.contiguous()
    w8 = formats.as_uint8(w)
    s8 = formats.as_uint8(scale)
    if w8.stride(1) != 1:
        w8 = w8.contiguous()
    out = torch.empty(M, N, dtype=torch.bfloat16, device=x.device)
    if M == 0:
        return out
    p = {**plan(M, N, K, sm_count(x.device), groups), **(config or {})}
    split = p["SPLIT_K"]
    if hw_fp8 is None:
        hw_fp8 = _hw_fp8(x)
    part = out if split == 1 else torch.empty(split, M, N, dtype=torch.float32, device=x.device)
    _fp8_gemm_kernel[(-(-(N // groups) // p["BLOCK_N"]), split, groups)](
        x, w8, s8, part, M, N, K, p["k_per_split"], N // groups, x.stride(0), w8.stride(0), s8.stride(0), N,
        BLOCK_N=p["BLOCK_N"], BLOCK_M=p["BLOCK_M"], SPLIT_K=split, HW_FP8=bool(hw_fp8),
        DOT_F32=interpreting(), num_warps=p["num_warps"], num_stages=p["num_stages"], **pdl_launch(pdl(x)))
    return _sum_splits(part, out, split)


def _fp8_gemm_fake(x, w, scale, groups=1):
    return x.new_empty(x.shape[0], w.shape[0])


fp8_gemm = define_op("fp8_gemm", "(Tensor x, Tensor w, Tensor scale, int groups=1) -> Tensor", fp8_gemm_ref,
                     _fp8_gemm_triton if HAS_TRITON else None, _fp8_gemm_fake)


# --------------------------------------------------------------------------- per-row scales (the w8a8 weights)
#
# ``fp8_rows_gemm(x [M, G*K] bf16, w8 [N, K] E4M3, w_scale [N] or [N, 1] fp32, groups) -> [M, N] bf16``: the same
# swap-AB, split-K design on the weights as ``w8a8`` keeps them (``formats.fp8_block_to_rows``: the 32x32 tiles
# re-scaled once to one power of two per row), so the scale leaves the K loop: 128-wide K steps, E4M3 -> bf16 in the
# converter, bf16 MMAs, the row scale once in the epilogue.  Against the 32-wide steps above (9-37% of the bandwidth,
# session 10) a step moves 4x the bytes for the same loop overhead, and against ``w8a8`` (vLLM's per-token activation
# quantisation + CUTLASS FP8 GEMM: 0.85-2.4 TB/s on the dense shapes at 1-64 rows, session 14) it needs no
# quantisation launch, keeps the activations in bf16 (no E4M3 rounding of x) and splits K so that narrow weights
# (wq_a + wkv: N = 1,792) cover the SMs.  ``VLLM_DSV41_SMALL_GEMM=triton`` routes passes of at most ``MAX_M`` rows
# through it; not yet timed on a GPU.


def fp8_rows_gemm_ref(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """Plain PyTorch (CPU implementation and test oracle): x times the row-scaled E4M3 weight, fp32, x's dtype out."""
    _check_rows(x, w8, w_scale, groups)
    wd = formats.as_uint8(w8).view(torch.float8_e4m3fn).float() * w_scale.float().reshape(-1, 1)
    return _grouped_product(x, wd, groups)


def _check_rows(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, groups: int,
                op: str = "fp8_rows_gemm") -> None:
    """The shapes of a GEMM on the row-scaled E4M3 weights (``op`` names it in the error)."""
    if x.dim() != 2 or w8.dim() != 2 or groups < 1 or x.shape[1] != groups * w8.shape[1]:
        raise ValueError(f"{op}: x [M, {groups} x K] and w8 [N, K] expected, got {tuple(x.shape)} and "
                         f"{tuple(w8.shape)}")
    N = w8.shape[0]
    if N % groups:
        raise ValueError(f"{op}: N={N} rows do not split into {groups} groups")
    if w_scale.numel() != N:
        raise ValueError(f"{op}: w_scale must hold one scale per weight row ({N}), got {tuple(w_scale.shape)}")


@triton.jit
def _fp8_rows_kernel(
    x_ptr,        # [M, G*K] bf16
    w_ptr,        # [N, K] E4M3 (float8e4nv with HW_FP8, else its uint8 bytes)
    s_ptr,        # [N] fp32 row scales
    part_ptr,     # [SPLIT_K, M, N] fp32 partials (SPLIT_K > 1) or the [M, N] bf16 output
    M, N, K, k_per_split, NG,
    stride_xm, stride_wn, stride_pm,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    HW_FP8: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr = False,
):
    if PDL:  # programmatic dependent launch: the previous kernel first
        gdc_wait()
        gdc_launch_dependents()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_g = tl.program_id(2)
    local_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = local_n < NG
    offs_n = pid_g * NG + local_n       # weight row = output column
    x_ptr += pid_g * K                  # the group's input slice
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        # rows past NG are loaded unmasked-value (whatever the bytes) and never stored: each output row reads only
        # its own weight row
        wb = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (k0 + offs_k)[None, :], mask=n_ok[:, None])
        xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + (k0 + offs_k)[:, None], mask=m_ok[None, :], other=0.0)
        if DOT_F32:  # the interpreter: the bytes decoded bit by bit, fp32 products of the same values
            acc += tl.dot(_e4m3_to_f32(wb.to(tl.int32), False), xt.to(tl.float32), input_precision="ieee")
        elif HW_FP8:
            acc += tl.dot(wb.to(tl.bfloat16), xt)
        else:
            acc += tl.dot(_e4m3_to_f32(wb.to(tl.int32), False).to(tl.bfloat16), xt)
    acc = acc * tl.load(s_ptr + offs_n, mask=n_ok, other=0.0)[:, None]
    out_ptrs = part_ptr + pid_k * M * N + offs_m[None, :] * stride_pm + offs_n[:, None]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(part_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])
    else:
        tl.store(out_ptrs, acc, mask=n_ok[:, None] & m_ok[None, :])


def rows_plan(M: int, N: int, K: int, sms: int, groups: int = 1) -> dict:
    """Launch parameters of ``_fp8_rows_kernel``: 128 weight rows per program (64 when that leaves half the SMs
    idle), the token side padded to a power of two >= 16, 128-wide K steps (32 when K is not a multiple of 128), K
    split (whole steps, >= 512 per split) until about two programs per SM, 4 pipeline stages.  Chosen by reasoning,
    not yet by measurement."""
    block_n = 128 if groups * (N // groups) // 128 >= sms // 2 else 64
    block_m = max(16, 1 << (max(M, 1) - 1).bit_length())
    block_k = 128 if K % 128 == 0 else 32
    n_blocks = groups * -(-(N // groups) // block_n)
    split = max(1, min(16, -(-2 * sms // n_blocks), K // 512))
    k_per_split = -(-(K // block_k) // split) * block_k
    return dict(BLOCK_N=block_n, BLOCK_M=block_m, BLOCK_K=block_k, SPLIT_K=-(-K // k_per_split),
                k_per_split=k_per_split, num_warps=4 if block_n == 64 else 8, num_stages=4)


def _fp8_rows_gemm_triton(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, groups: int = 1,
                          hw_fp8: bool | None = None, config: dict | None = None) -> torch.Tensor:
    """Launch the kernel (``config`` overrides :func:`rows_plan`'s choices, for sweeps); more than ``MAX_M`` rows or a
    non-bf16 x go through the reference arithmetic."""
    _check_rows(x, w8, w_scale, groups)
    M = x.shape[0]
    N, K = w8.shape
    if M > MAX_M or x.dtype != torch.bfloat16:
        return fp8_rows_gemm_ref(x, w8, w_scale, groups)
    out = torch.empty(M, N, dtype=torch.bfloat16, device=x.device)
    if M == 0:
        return out
    x = x.contiguous()
    if hw_fp8 is None:
        hw_fp8 = _hw_fp8(x)
    w = formats.as_uint8(w8)
    if w.stride(1) != 1:
        w = w.contiguous()
    if hw_fp8 and not interpreting():
        w = w.view(torch.float8_e4m3fn)
    s = w_scale.float().reshape(N).contiguous()
    p = {**rows_plan(M, N, K, sm_count(x.device), groups), **(config or {})}
    split = p["SPLIT_K"]
    part = out if split == 1 else torch.empty(split, M, N, dtype=torch.float32, device=x.device)
    _fp8_rows_kernel[(-(-(N // groups) // p["BLOCK_N"]), split, groups)](
        x, w, s, part, M, N, K, p["k_per_split"], N // groups, x.stride(0), w.stride(0), N,
        BLOCK_N=p["BLOCK_N"], BLOCK_M=p["BLOCK_M"], BLOCK_K=p["BLOCK_K"], SPLIT_K=split,
        HW_FP8=bool(hw_fp8) and not interpreting(), DOT_F32=interpreting(), num_warps=p["num_warps"],
        num_stages=p["num_stages"], **pdl_launch(pdl(x)))
    return _sum_splits(part, out, split)


def _fp8_rows_gemm_fake(x, w8, w_scale, groups=1):
    return x.new_empty(x.shape[0], w8.shape[0])


fp8_rows_gemm = define_op("fp8_rows_gemm", "(Tensor x, Tensor w8, Tensor w_scale, int groups=1) -> Tensor",
                          fp8_rows_gemm_ref, _fp8_rows_gemm_triton if HAS_TRITON else None, _fp8_rows_gemm_fake)
