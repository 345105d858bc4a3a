"""mHC boundary ops: ``dsv41::mhc_pre``, ``dsv41::mhc_post`` and the fused ``dsv41::mhc_post_pre``.

Specification: architecture.md §2.3 (boundary math, delayed pre-mix) and §7.4; the oracle is
``reference/model.py`` (``hc_coefficients``, ``sinkhorn``, ``hc_collapse``, ``hc_post``, ``rms_norm``),
and each ``*_ref`` below returns the same numbers as composing those helpers.

Maths (one boundary; S is the stream [T, C, H], v = S flattened to [T, C*H] in fp32, NMIX = (2+C)*C)::

    m    = (v @ fn^T) * rsqrt(mean(v^2) + eps)                       [T, NMIX]
    pre  = sigmoid(scale[0] * m[:, :C] + base[:C]) + hc_eps          [T, C]   carried to the next boundary
    post = 2 * sigmoid(scale[1] * m[:, C:2C] + base[C:2C])           [T, C]
    comb = sinkhorn(scale[2] * m[:, 2C:] + base[2C:], as [C, C])     [T, C, C] row i = source stream
    x    = RMSNorm_w(sum_j pre_prev[j] * S[j])                       [T, H]   sublayer input (delayed pre-mix)

    mhc_post:      S_new[t, j] = sum_i comb[t, i, j] * S[t, i] + post[t, j] * y[t]
                   (y = y + y2 first when given: the MoE's routed and shared parts, one add fewer a layer)
    mhc_post_pre:  mhc_pre(mhc_post(S, y, post, comb), next boundary's fn/base/scale, pre_prev = pre, ...)

``mhc_post_pre`` ("Mega-mHC") is the post-mix of sublayer k followed by the pre of boundary k+1; it
writes the new stream and reuses it from registers for the projection, which saves one read of S.

``mhc_collapse_quant`` / ``mhc_post_collapse_quant``: the same x and, from the launch that normalises it, x quantised
to E4M3 per row (``formats.quant_fp8_tokens``: the quantisation a ``w8a8`` GEMM would launch on x itself), for layers
whose every FP8 reader of x takes pre-quantised rows (``linear.QuantRows``; ``VLLM_DSV41_FUSED_QUANT``).

The same boundary split in two (decode sizes, :func:`split_rows`): ``mhc_collapse`` / ``mhc_post_collapse`` give
the new stream and x, all the sublayer needs, since x takes the previous boundary's ``pre``; ``mhc_coeffs`` gives
this boundary's pre / post / comb, first read at its post-mix, so it runs on the side stream beside the sublayer and
the projection and the Sinkhorn leave the critical path (SGLang's overlap of the mHC statistics with the sublayer,
docs/design.md).  The same two kernels run with flags: the pre kernel without the projection (``PROJECT`` off) or
without the collapse (``COLLAPSE`` off), the epilogue with only its normalising columns or only its coefficient
column.  The references compose bitwise to the fused ones.

Why these are ops: in eager PyTorch a boundary is ~100 small kernels (the 20-round Sinkhorn alone is
~80 launches on a [T, 4, 4] tensor) and several full passes over S, while the whole boundary is memory
bound on S.  As custom ops, torch.compile sees one opaque node each (the fake impls give the shapes) and
the launch heuristics, which depend on the token count, run at call time.

Kernel design (CUDA, Triton):

* ``_mhc_pre_kernel`` (grid: token blocks x H splits) reads S once.  A program owns BLOCK_T tokens and a
  slice of H, and walks the slice in BLOCK_H chunks; for every stream j the projection partial
  ``S[:, j, chunk] @ fn[:, j*H + chunk]^T`` goes through ``tl.dot`` (NMIX padded to NP), and sum(v^2) and
  the collapse ``h = sum_j pre_prev[j] * S[j]`` (plus sum(h^2)) are computed from the same registers.
  The partial projection and both sums of squares go to a small fp32 buffer [SPLIT, T, NP] (columns
  NMIX and NMIX+1 hold the sums); h goes, unnormalised, into the x output.  With FUSE_POST the program
  first forms stream j of the post-mixed stream from the C source tiles, y, post and comb (the source
  tiles are re-read per j, from L1: a [BLOCK_T, C, BLOCK_H] tile held in registers spills), stores it
  rounded to S's dtype and goes on with the rounded values, so the fused op equals the composition.
  ``_mhc_post_kernel`` does the same arithmetic in the same order, so both give bitwise equal streams.
* ``_mhc_pre_epilogue_kernel`` (grid: token blocks x (H blocks + 1)) adds the partials over the splits,
  ``EPILOGUE_SPLITS`` at a time (one wide load per round into per-thread sums, and one tree sum across threads
  after the last round: the sm_90 build of a tree sum per round had 10 barriers in each round).
  The last program column computes the sigmoids and the Sinkhorn for its tokens in registers
  ([BLOCK_T, C, C]); the others scale their slice of x by rsqrt(mean(h^2) + eps) * w in place.
* The ``*_quant`` collapses: the pre kernel also keeps each split's max |h * w| (``AMAX``, partial column NMIX+2);
  normalising multiplies a row by rx = rsqrt(mean(h^2) + eps) > 0, so x's amax is rx times the splits' maximum
  (rounded to x's dtype, as x is: equal to x's own amax but where the fp32 products straddle a rounding point of that
  dtype), and each normalising program writes its block's E4M3 codes beside x (``QUANT``; scale = max(amax / 448,
  floor), integer RNE on a correctly rounded division, as ``formats.quant_fp8_tokens``).
* Why two kernels: x needs mean(h^2) over all of H before any element can be written, while the
  projection needs many tokens per program to reuse fn (2 MB fp32 at C=4, H=5120): at small T one token
  block is split over ~100+ programs to read fn and S at full bandwidth; at T=8192, 64-token blocks make
  fn's re-reads hit L2.  Parking h in x (T*H elements, a quarter of S) is cheaper than reading S twice.
  The split count is chosen so that token blocks x splits is about two programs per SM; the partials are
  deterministic (no atomics), so results do not depend on the launch order.
* From ``gemm_from()`` rows (``VLLM_DSV41_MHC_GEMM_FROM``, default 1,024; prefill) the projection leaves the
  kernel (``PROJECT`` off): the kernel streams S (post-mix, collapse h, both sums of squares) and one cuBLAS fp32
  GEMM ``v @ fn^T`` fills split 0's projection columns, which the epilogue then sums as before.  At these sizes
  the in-kernel MMA ran at ~23% of the bandwidth whatever the tile or split count (its S tiles change layout
  through shared memory for the MMA); measured on an H200 at 16k rows with fp32 streams: ``mhc_pre`` 1.50 ->
  1.29 ms, ``mhc_post_pre`` 2.87 -> 1.86 ms (docs/benchmarks.md, session 12).  The GEMM reads S a second time,
  which is why small T keeps the projection inside.  bf16 streams (the fast path's default since session 15) go to
  cuBLAS as they are, against fn split once into bf16 hi + lo rows, with fp32 output (``_bf16_projection``: no fp32
  copy of S, the kernel's BF16_SPLIT arithmetic).
* Numerics: fp32 accumulation throughout.  For bf16 S the operands of ``tl.dot`` are S (exact in bf16)
  and fn split into bf16 hi + lo parts (two MMAs, ~2^-17 relative error per product, i.e. fp32-level);
  for other dtypes ``input_precision="tf32x3"``.  h is parked in x's dtype, so a bf16 x is rounded twice
  (h, then the normalised value): at most one extra bf16 ulp against the reference.
* ``_mhc_collapse_rows_kernel`` (grid: tokens x programs a token; :func:`collapse_rows`) is the split boundary's
  collapse in one launch, for a few tokens.  The two-launch collapse exists because x needs sum(h^2) over all of H
  before any element is written; at one token the whole row (S: C x H values, ~40 KB in bf16) is small enough for
  every program to compute h for every column from L2 and sum the squares itself, keeping only its own columns'
  stream and h (parked in x), then normalise and quantise its columns after a CTA barrier.  The stream is bitwise
  ``_mhc_post_kernel``'s; x differs from the two-launch route's only by the order of the sum of squares.  The
  measured ends of the other route at T=1: the pre kernel and the epilogue, two launches of ~5-7 µs each on an H100
  (docs/benchmarks.md, session 31, averaged over the collapse and coefficient launches).
* ``_mhc_post_kernel`` (grid: token blocks x H blocks) is a plain streaming kernel: read S and y once,
  write S_new once.
* Launch tiles (``_pre_config``) are chosen by measured kernel time, not by register counts: built for sm_90
  with Triton 3.9's ptxas, the 64-token non-fused tiles with bf16 streams keep everything in registers, while
  the model's fp32 streams and the fused 16-token tiles spill 80-1,128 bytes per thread (the previous tiles
  spilled too with fp32 streams); the interpreter tests run all kernels on CPU tensors.  Its dot cannot take
  bf16 operands, hence the BF16_MMA flag (off only under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import functools
import os
from types import SimpleNamespace

import torch

from vllm_dsv41 import formats
from vllm_dsv41.ops import define_op, env_rows
from vllm_dsv41.ops._triton import (
    ROW_COUNT_ARGS, gdc_launch_dependents, gdc_wait, interpreting, pdl, pdl_launch, sm_count,
)
from vllm_dsv41.reference.model import sinkhorn

# Bound to ``triton.language`` by ``_triton()`` on first CUDA use, so this module imports without Triton.
# The kernels below are plain functions until ``_kernels()`` wraps them with ``triton.jit``; their
# annotations are strings (``from __future__ import annotations``), which Triton reads as written.
tl = None


def _triton():
    global tl
    import triton
    import triton.language as tl  # noqa: F811  (rebinds the module-level placeholder)

    return triton


# --------------------------------------------------------------------------- references (CPU path, oracle)




def mhc_coeffs_ref(stream: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, eps: float,
                   hc_eps: float, iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """stream [T, C, H] -> the boundary's pre [T, C], post [T, C], comb [T, C, C] (fp32)."""
    T, C, _ = stream.shape
    v = stream.float().flatten(1)
    m = (v @ fn.float().t()) * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    pre = torch.sigmoid(scale[0] * m[:, :C] + base[:C]) + hc_eps
    post = 2.0 * torch.sigmoid(scale[1] * m[:, C:2 * C] + base[C:2 * C])
    comb = sinkhorn((scale[2] * m[:, 2 * C:] + base[2 * C:]).view(T, C, C), hc_eps, iters)
    return pre, post, comb


def mhc_collapse_ref(stream: torch.Tensor, pre_prev: torch.Tensor, norm_w: torch.Tensor, eps: float) -> torch.Tensor:
    """stream [T, C, H], pre_prev [T, C] -> x = RMSNorm_w(sum_j pre_prev[j] * S[j]) [T, H] (stream's dtype)."""
    h = (pre_prev.float().unsqueeze(-1) * stream.float()).sum(1)
    x = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * norm_w.float()
    return x.to(stream.dtype)


def mhc_pre_ref(stream: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                pre_prev: torch.Tensor, norm_w: torch.Tensor, eps: float, hc_eps: float,
                iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """stream [T, C, H] -> x [T, H] (stream's dtype), pre [T, C], post [T, C], comb [T, C, C] (fp32)."""
    return (mhc_collapse_ref(stream, pre_prev, norm_w, eps),
            *mhc_coeffs_ref(stream, fn, base, scale, eps, hc_eps, iters))


def mhc_post_ref(stream: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                 y2: torch.Tensor | None = None) -> torch.Tensor:
    """stream [T, C, H], y [T, H], post [T, C], comb [T, C, C] -> new stream [T, C, H] (stream's dtype).  ``y2``
    [T, H]: a second part of the sublayer output (the MoE's shared expert beside its routed experts), added to y in
    y's dtype first, as ``y + y2`` would be."""
    if y2 is not None:
        y = y + y2
    mixed = torch.einsum("tij,tih->tjh", comb.float(), stream.float())
    return (mixed + post.float().unsqueeze(-1) * y.float().unsqueeze(1)).to(stream.dtype)


def mhc_post_pre_ref(stream: torch.Tensor, y: torch.Tensor, post_prev: torch.Tensor, comb_prev: torch.Tensor,
                     fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, pre_prev: torch.Tensor,
                     norm_w: torch.Tensor, eps: float, hc_eps: float, iters: int, y2: torch.Tensor | None = None):
    """Post-mix of the previous sublayer (y + y2, as :func:`mhc_post_ref`), then the next boundary's pre -> (new
    stream, x, pre, post, comb)."""
    new_stream = mhc_post_ref(stream, y, post_prev, comb_prev, y2)
    return (new_stream, *mhc_pre_ref(new_stream, fn, base, scale, pre_prev, norm_w, eps, hc_eps, iters))


def mhc_post_collapse_ref(stream: torch.Tensor, y: torch.Tensor, post_prev: torch.Tensor, comb_prev: torch.Tensor,
                          pre_prev: torch.Tensor, norm_w: torch.Tensor, eps: float,
                          y2: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Post-mix of the previous sublayer (y + y2, as :func:`mhc_post_ref`), then the next boundary's collapse -> (new
    stream, x); the boundary's coefficients come from ``mhc_coeffs`` on the new stream."""
    new_stream = mhc_post_ref(stream, y, post_prev, comb_prev, y2)
    return new_stream, mhc_collapse_ref(new_stream, pre_prev, norm_w, eps)


def mhc_collapse_quant_ref(stream: torch.Tensor, pre_prev: torch.Tensor, norm_w: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`mhc_collapse_ref`'s x, and x quantised to E4M3 per row as a ``w8a8`` GEMM would quantise it
    (:func:`formats.quant_fp8_tokens`): (x [T, H], codes [T, H] float8_e4m3fn, scales [T, 1] fp32)."""
    x = mhc_collapse_ref(stream, pre_prev, norm_w, eps)
    return (x, *formats.quant_fp8_tokens(x))


def mhc_post_collapse_quant_ref(stream: torch.Tensor, y: torch.Tensor, post_prev: torch.Tensor,
                                comb_prev: torch.Tensor, pre_prev: torch.Tensor, norm_w: torch.Tensor, eps: float,
                                y2: torch.Tensor | None = None):
    """:func:`mhc_post_collapse_ref` plus x's per-row E4M3 quantisation -> (new stream, x, codes, scales)."""
    new_stream, x = mhc_post_collapse_ref(stream, y, post_prev, comb_prev, pre_prev, norm_w, eps, y2)
    return (new_stream, x, *formats.quant_fp8_tokens(x))


# --------------------------------------------------------------------------- Triton kernels


def _mhc_pre_kernel(
    s_ptr,          # [T, C, H] stream entering the boundary; with FUSE_POST the stream before the post-mix
    y_ptr,          # [T, H]    sublayer output (FUSE_POST only)
    y2_ptr,         # [T, H]    its second part, y's dtype (ADD_Y2 only)
    post_prev_ptr,  # [T, C]    fp32 post-mix of the previous boundary (FUSE_POST only)
    comb_prev_ptr,  # [T, C, C] fp32 comb of the previous boundary, row = source (FUSE_POST only)
    snew_ptr,       # [T, C, H] out: post-mixed stream, S's dtype (FUSE_POST only)
    fn_ptr,         # [NMIX, C*H] fp32, column j*H + h multiplies S[:, j, h]
    pre_prev_ptr,   # [T, C]    fp32 carried pre-mix
    h_ptr,          # [T, H]    out: sum_j pre_prev[j] * S[j], unnormalised (x's buffer)
    part_ptr,       # [SPLIT, T, NP] out: fp32 partial projection; column NMIX = sum v^2, NMIX+1 = sum h^2,
                    # NMIX+2 = max |h * w| (AMAX only)
    w_ptr,          # [H]       norm weight (AMAX only)
    T, H, HS,       # tokens, hidden size, H covered by one split (a multiple of BLOCK_H)
    stride_st, stride_sc, stride_sh,
    stride_yt, stride_yh,
    stride_y2t, stride_y2h,
    stride_pot, stride_poc,
    stride_cot, stride_coi, stride_coj,
    stride_nt, stride_nc, stride_nh,
    stride_fn, stride_fk,
    stride_ppt, stride_ppc,
    stride_ht, stride_hh,
    stride_ps, stride_pt, stride_pn,
    C: tl.constexpr, NMIX: tl.constexpr, NP: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
    FUSE_POST: tl.constexpr, BF16_SPLIT: tl.constexpr, BF16_MMA: tl.constexpr, PROJECT: tl.constexpr,
    COLLAPSE: tl.constexpr = True, AMAX: tl.constexpr = False, ADD_Y2: tl.constexpr = False, PDL: tl.constexpr = False,
):
    if PDL:  # programmatic dependent launch: the previous kernel first
        gdc_wait()
        gdc_launch_dependents()
    pid_t = tl.program_id(0)
    pid_s = tl.program_id(1)
    # Move every token-indexed pointer to this block's first token in 64-bit scalar arithmetic (T*C*H
    # overflows int32 past ~100k tokens); the per-element offsets below stay 32-bit and small.
    t0 = (pid_t * BLOCK_T).to(tl.int64)
    s_ptr += t0 * stride_st
    y_ptr += t0 * stride_yt
    y2_ptr += t0 * stride_y2t
    post_prev_ptr += t0 * stride_pot
    comb_prev_ptr += t0 * stride_cot
    snew_ptr += t0 * stride_nt
    pre_prev_ptr += t0 * stride_ppt
    h_ptr += t0 * stride_ht
    part_ptr += t0 * stride_pt + pid_s * stride_ps
    offs_t = tl.arange(0, BLOCK_T)
    mask_t = offs_t < T - pid_t * BLOCK_T
    offs_c = tl.arange(0, C)
    offs_n = tl.arange(0, NP)
    mask_n = offs_n < NMIX

    if COLLAPSE:
        pp = tl.load(pre_prev_ptr + offs_t[:, None] * stride_ppt + offs_c[None, :] * stride_ppc,
                     mask=mask_t[:, None], other=0.0).to(tl.float32)                  # [BLOCK_T, C]

    acc = tl.zeros([BLOCK_T, NP], dtype=tl.float32)
    ssq_v = tl.zeros([BLOCK_T], dtype=tl.float32)
    ssq_h = tl.zeros([BLOCK_T], dtype=tl.float32)
    amax_hw = tl.zeros([BLOCK_T], dtype=tl.float32)
    for k in range(0, HS, BLOCK_H):
        h0 = pid_s * HS + k
        offs_h = h0 + tl.arange(0, BLOCK_H)
        mask_h = offs_h < H
        mask_th = mask_t[:, None] & mask_h[None, :]                                       # [BLOCK_T, BLOCK_H]
        if FUSE_POST:
            y = tl.load(y_ptr + offs_t[:, None] * stride_yt + offs_h[None, :] * stride_yh,
                        mask=mask_th, other=0.0).to(tl.float32)                      # [BLOCK_T, BLOCK_H]
            if ADD_Y2:  # y + y2 rounded to y's dtype, as mhc_post's ADD_Y2 (bitwise the same streams)
                y2 = tl.load(y2_ptr + offs_t[:, None] * stride_y2t + offs_h[None, :] * stride_y2h,
                             mask=mask_th, other=0.0).to(tl.float32)
                y = (y + y2).to(y_ptr.dtype.element_ty).to(tl.float32)
        if COLLAPSE:  # else only the projection and sum(v^2) (``mhc_coeffs``)
            h = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
        for j in tl.static_range(C):
            if FUSE_POST:
                # new stream j = sum_i comb[i, j] * S[i] + post[j] * y, rounded to S's dtype before use.
                # The C source tiles are re-read for every j (L1 hits): cheaper in registers than
                # holding a [BLOCK_T, C, BLOCK_H] tile.
                s_j = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
                for i in tl.static_range(C):
                    c_ij = tl.load(comb_prev_ptr + offs_t * stride_cot + i * stride_coi + j * stride_coj,
                                   mask=mask_t, other=0.0).to(tl.float32)              # [BLOCK_T]
                    s_i = tl.load(s_ptr + offs_t[:, None] * stride_st + i * stride_sc + offs_h[None, :] * stride_sh,
                                  mask=mask_th, other=0.0).to(tl.float32)
                    s_j += c_ij[:, None] * s_i
                post_j = tl.load(post_prev_ptr + offs_t * stride_pot + j * stride_poc,
                                 mask=mask_t, other=0.0).to(tl.float32)
                s_j = (s_j + post_j[:, None] * y).to(snew_ptr.dtype.element_ty)
                tl.store(snew_ptr + offs_t[:, None] * stride_nt + j * stride_nc + offs_h[None, :] * stride_nh,
                         s_j, mask=mask_th)
            else:
                s_j = tl.load(s_ptr + offs_t[:, None] * stride_st + j * stride_sc + offs_h[None, :] * stride_sh,
                              mask=mask_th, other=0.0)                               # [BLOCK_T, BLOCK_H]
            if PROJECT:  # else the caller projects the whole stream through cuBLAS (large T)
                f_j = tl.load(fn_ptr + offs_n[None, :] * stride_fn + (j * H + offs_h)[:, None] * stride_fk,
                              mask=mask_n[None, :] & mask_h[:, None], other=0.0)         # [BLOCK_H, NP] fp32
                if BF16_SPLIT:
                    # S is exact in bf16; fn = hi + lo in bf16 keeps ~16 mantissa bits: two bf16 MMAs
                    f_hi = f_j.to(tl.bfloat16)
                    f_lo = (f_j - f_hi.to(tl.float32)).to(tl.bfloat16)
                    if BF16_MMA:
                        acc = tl.dot(s_j, f_hi, acc)
                        acc = tl.dot(s_j, f_lo, acc)
                    else:  # the interpreter's dot cannot take bf16: same bf16 values, fp32 products
                        acc = tl.dot(s_j.to(tl.float32), f_hi.to(tl.float32), acc, input_precision="ieee")
                        acc = tl.dot(s_j.to(tl.float32), f_lo.to(tl.float32), acc, input_precision="ieee")
                else:
                    acc = tl.dot(s_j.to(tl.float32), f_j, acc, input_precision="tf32x3")
            s_j = s_j.to(tl.float32)
            ssq_v += tl.sum(s_j * s_j, axis=1)
            if COLLAPSE:
                pp_j = tl.sum(tl.where(offs_c[None, :] == j, pp, 0.0), axis=1)            # [BLOCK_T]
                h += pp_j[:, None] * s_j
        if COLLAPSE:
            ssq_h += tl.sum(h * h, axis=1)
            h_parked = h.to(h_ptr.dtype.element_ty)
            tl.store(h_ptr + offs_t[:, None] * stride_ht + offs_h[None, :] * stride_hh, h_parked, mask=mask_th)
            if AMAX:  # the row's amax after normalisation is rsqrt(mean h^2) (> 0) times max |h * w|
                w = tl.load(w_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)
                amax_hw = tl.maximum(amax_hw, tl.max(tl.abs(h_parked.to(tl.float32) * w[None, :]), axis=1))

    acc = tl.where(offs_n[None, :] == NMIX, ssq_v[:, None], acc)
    acc = tl.where(offs_n[None, :] == NMIX + 1, ssq_h[:, None], acc)
    if AMAX:
        acc = tl.where(offs_n[None, :] == NMIX + 2, amax_hw[:, None], acc)
    tl.store(part_ptr + offs_t[:, None] * stride_pt + offs_n[None, :] * stride_pn, acc, mask=mask_t[:, None])


def _mhc_pre_epilogue_kernel(
    part_ptr,   # [SPLIT, T, NP] fp32 partials from _mhc_pre_kernel
    base_ptr,   # [NMIX] fp32
    scale_ptr,  # [3] fp32
    w_ptr,      # [H] norm weight
    x_ptr,      # [T, H] in: unnormalised collapse h; out: RMSNorm_w(h)
    pre_ptr,    # [T, C] out fp32
    post_ptr,   # [T, C] out fp32
    comb_ptr,   # [T, C, C] out fp32
    q_ptr,      # [T, H] uint8 out: E4M3 bytes of x / scale (QUANT only)
    qs_ptr,     # [T] fp32 out: x's per-row scale (QUANT only)
    T, H, SPLIT, NHB,            # NHB: H blocks; program column NHB computes the coefficients
    inv_ch, inv_h, eps, hc_eps, iters, floor,
    stride_ps, stride_pt, stride_pn,
    stride_xt, stride_xh,
    stride_pret, stride_prec,
    stride_pot, stride_poc,
    stride_ct, stride_ci, stride_cj,
    stride_qt, stride_qh,
    C: tl.constexpr, NMIX: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, QUANT: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    if PDL:  # programmatic dependent launch: the previous kernel first
        gdc_wait()
        gdc_launch_dependents()
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < T
    offs_t = offs_t.to(tl.int64)
    row = part_ptr + offs_t * stride_pt                                                  # [BLOCK_T] pointers
    offs_s = tl.arange(0, BLOCK_S)

    if pid_h == NHB:
        offs_c = tl.arange(0, C)
        a_pre = tl.zeros([BLOCK_S, BLOCK_T, C], dtype=tl.float32)
        a_post = tl.zeros([BLOCK_S, BLOCK_T, C], dtype=tl.float32)
        a_comb = tl.zeros([BLOCK_S, BLOCK_T, C, C], dtype=tl.float32)
        a_ssq = tl.zeros([BLOCK_S, BLOCK_T], dtype=tl.float32)
        cols_comb = 2 * C + offs_c[None, :, None] * C + offs_c[None, None, :]           # [1, C, C]
        # BLOCK_S splits per round, each thread adding its own lanes; the cross-thread sums (shared memory and
        # barriers) come once, after the last round
        for s0 in range(0, SPLIT, BLOCK_S):
            ss = s0 + offs_s
            r = row[None, :] + ss.to(tl.int64)[:, None] * stride_ps                          # [BLOCK_S, BLOCK_T]
            m2 = (ss < SPLIT)[:, None] & mask_t[None, :]
            a_pre += tl.load(r[:, :, None] + offs_c[None, None, :] * stride_pn, mask=m2[:, :, None], other=0.0)
            a_post += tl.load(r[:, :, None] + (C + offs_c)[None, None, :] * stride_pn, mask=m2[:, :, None],
                              other=0.0)
            a_comb += tl.load(r[:, :, None, None] + cols_comb[None] * stride_pn, mask=m2[:, :, None, None], other=0.0)
            a_ssq += tl.load(r + NMIX * stride_pn, mask=m2, other=0.0)
        m_pre = tl.sum(a_pre, axis=0)
        m_post = tl.sum(a_post, axis=0)
        m_comb = tl.sum(a_comb, axis=0)
        ssq = tl.sum(a_ssq, axis=0)
        rv = tl.rsqrt(ssq * inv_ch + eps)
        scale_pre = tl.load(scale_ptr)
        scale_post = tl.load(scale_ptr + 1)
        scale_comb = tl.load(scale_ptr + 2)
        pre = tl.sigmoid(scale_pre * (m_pre * rv[:, None]) + tl.load(base_ptr + offs_c)[None, :]) + hc_eps
        post = 2.0 * tl.sigmoid(scale_post * (m_post * rv[:, None]) + tl.load(base_ptr + C + offs_c)[None, :])
        logits = scale_comb * (m_comb * rv[:, None, None]) + tl.load(base_ptr + cols_comb)
        # Sinkhorn on the C x C matrix of every token, in registers (axis 1 = row i, axis 2 = column j)
        e = tl.exp(logits - tl.max(logits, axis=2)[:, :, None])
        a = e / tl.sum(e, axis=2)[:, :, None] + hc_eps
        a = a / (tl.sum(a, axis=1)[:, None, :] + hc_eps)
        for _it in range(iters - 1):
            a = a / (tl.sum(a, axis=2)[:, :, None] + hc_eps)
            a = a / (tl.sum(a, axis=1)[:, None, :] + hc_eps)
        tl.store(pre_ptr + offs_t[:, None] * stride_pret + offs_c[None, :] * stride_prec, pre, mask=mask_t[:, None])
        tl.store(post_ptr + offs_t[:, None] * stride_pot + offs_c[None, :] * stride_poc, post, mask=mask_t[:, None])
        tl.store(comb_ptr + offs_t[:, None, None] * stride_ct + offs_c[None, :, None] * stride_ci
                 + offs_c[None, None, :] * stride_cj, a, mask=mask_t[:, None, None])
    else:
        a_ssq = tl.zeros([BLOCK_S, BLOCK_T], dtype=tl.float32)
        a_max = tl.zeros([BLOCK_S, BLOCK_T], dtype=tl.float32)
        for s0 in range(0, SPLIT, BLOCK_S):
            ss = s0 + offs_s
            r = row[None, :] + ss.to(tl.int64)[:, None] * stride_ps
            m2 = (ss < SPLIT)[:, None] & mask_t[None, :]
            a_ssq += tl.load(r + (NMIX + 1) * stride_pn, mask=m2, other=0.0)
            if QUANT:
                a_max = tl.maximum(a_max, tl.load(r + (NMIX + 2) * stride_pn, mask=m2, other=0.0))
        rx = tl.rsqrt(tl.sum(a_ssq, axis=0) * inv_h + eps)
        offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
        mask_h = offs_h < H
        mask = mask_t[:, None] & mask_h[None, :]
        ptrs = x_ptr + offs_t[:, None] * stride_xt + offs_h[None, :] * stride_xh
        h = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)
        x = (h * rx[:, None] * w[None, :]).to(x_ptr.dtype.element_ty)
        tl.store(ptrs, x, mask=mask)
        if QUANT:
            # the row's scale from the splits' max |h * w| times rx, rounded to x's dtype as x is: the amax of x itself
            # but where the products' fp32 roundings straddle a rounding point of x's dtype (then one ulp apart)
            amax = (tl.max(a_max, axis=0) * rx).to(x_ptr.dtype.element_ty).to(tl.float32)
            qs = _fp8_token_scale(amax, floor)                                                           # [BLOCK_T]
            code = _e4m3_byte(tl.math.div_rn(x.to(tl.float32), tl.broadcast_to(qs[:, None], [BLOCK_T, BLOCK_H])))
            tl.store(q_ptr + offs_t[:, None] * stride_qt + offs_h[None, :] * stride_qh, code.to(tl.uint8), mask=mask)
            if pid_h == 0:
                tl.store(qs_ptr + offs_t, qs, mask=mask_t)


def _mhc_post_kernel(
    s_ptr,     # [T, C, H] stream before the post-mix
    y_ptr,     # [T, H] sublayer output
    y2_ptr,    # [T, H] its second part, y's dtype (ADD_Y2 only)
    post_ptr,  # [T, C] fp32
    comb_ptr,  # [T, C, C] fp32, row = source stream
    out_ptr,   # [T, C, H] out: new stream, S's dtype
    T, H,
    stride_st, stride_sc, stride_sh,
    stride_yt, stride_yh,
    stride_y2t, stride_y2h,
    stride_pot, stride_poc,
    stride_cot, stride_coi, stride_coj,
    stride_ot, stride_oc, stride_oh,
    C: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, ADD_Y2: tl.constexpr, PDL: tl.constexpr = False,
):
    if PDL:  # programmatic dependent launch: the previous kernel first
        gdc_wait()
        gdc_launch_dependents()
    t0 = (tl.program_id(0) * BLOCK_T).to(tl.int64)
    s_ptr += t0 * stride_st
    y_ptr += t0 * stride_yt
    y2_ptr += t0 * stride_y2t
    post_ptr += t0 * stride_pot
    comb_ptr += t0 * stride_cot
    out_ptr += t0 * stride_ot
    offs_t = tl.arange(0, BLOCK_T)
    mask_t = offs_t < T - tl.program_id(0) * BLOCK_T
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_th = mask_t[:, None] & (offs_h < H)[None, :]                                     # [BLOCK_T, BLOCK_H]
    y = tl.load(y_ptr + offs_t[:, None] * stride_yt + offs_h[None, :] * stride_yh,
                mask=mask_th, other=0.0).to(tl.float32)
    if ADD_Y2:  # y + y2 rounded to y's dtype, as the separate add would store it
        y2 = tl.load(y2_ptr + offs_t[:, None] * stride_y2t + offs_h[None, :] * stride_y2h,
                     mask=mask_th, other=0.0).to(tl.float32)
        y = (y + y2).to(y_ptr.dtype.element_ty).to(tl.float32)
    # Same arithmetic, in the same order, as the FUSE_POST path of _mhc_pre_kernel (bitwise equal streams)
    for j in tl.static_range(C):
        out_j = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
        for i in tl.static_range(C):
            c_ij = tl.load(comb_ptr + offs_t * stride_cot + i * stride_coi + j * stride_coj,
                           mask=mask_t, other=0.0).to(tl.float32)                      # [BLOCK_T]
            s_i = tl.load(s_ptr + offs_t[:, None] * stride_st + i * stride_sc + offs_h[None, :] * stride_sh,
                          mask=mask_th, other=0.0).to(tl.float32)                      # [BLOCK_T, BLOCK_H]
            out_j += c_ij[:, None] * s_i
        post_j = tl.load(post_ptr + offs_t * stride_pot + j * stride_poc, mask=mask_t, other=0.0).to(tl.float32)
        out_j = out_j + post_j[:, None] * y
        tl.store(out_ptr + offs_t[:, None] * stride_ot + j * stride_oc + offs_h[None, :] * stride_oh,
                 out_j.to(out_ptr.dtype.element_ty), mask=mask_th)


def _mhc_collapse_rows_kernel(
    s_ptr,          # [T, C, H] stream entering the boundary; with FUSE_POST the stream before the post-mix
    y_ptr,          # [T, H]    sublayer output (FUSE_POST only)
    y2_ptr,         # [T, H]    its second part, y's dtype (ADD_Y2 only)
    post_prev_ptr,  # [T, C]    fp32 post-mix of the previous boundary (FUSE_POST only)
    comb_prev_ptr,  # [T, C, C] fp32 comb of the previous boundary, row = source (FUSE_POST only)
    snew_ptr,       # [T, C, H] out: post-mixed stream, S's dtype (FUSE_POST only)
    pre_prev_ptr,   # [T, C]    fp32 carried pre-mix
    w_ptr,          # [H]       norm weight
    x_ptr,          # [T, H]    out: RMSNorm_w(sum_j pre_prev[j] * S[j]); holds the unnormalised h in between
    q_ptr,          # [T, H]    uint8 out: E4M3 bytes of x / scale (QUANT only)
    qs_ptr,         # [T]       fp32 out: x's per-row scale (QUANT only)
    H, HP,          # hidden size, columns a program writes (a multiple of BLOCK_H)
    inv_h, eps, floor,
    stride_st, stride_sc, stride_sh,
    stride_yt, stride_yh,
    stride_y2t, stride_y2h,
    stride_pot, stride_poc,
    stride_cot, stride_coi, stride_coj,
    stride_nt, stride_nc, stride_nh,
    stride_ppt, stride_ppc,
    stride_xt, stride_xh,
    stride_qt, stride_qh,
    C: tl.constexpr, BLOCK_H: tl.constexpr,
    FUSE_POST: tl.constexpr, ADD_Y2: tl.constexpr, QUANT: tl.constexpr, PDL: tl.constexpr = False,
):
    if PDL:  # programmatic dependent launch: the previous kernel first
        gdc_wait()
        gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    s_ptr += t * stride_st
    y_ptr += t * stride_yt
    y2_ptr += t * stride_y2t
    post_prev_ptr += t * stride_pot
    comb_prev_ptr += t * stride_cot
    snew_ptr += t * stride_nt
    pre_prev_ptr += t * stride_ppt
    x_ptr += t * stride_xt
    q_ptr += t * stride_qt
    lo = p * HP
    hi = lo + HP

    # Pass 1, the whole row: every program needs sum(h^2) (and max |h * w|) over all of H, so each one computes h
    # for every column (S is a few tens of KB a token, read from L2) and keeps only its own columns' stream and h.
    ssq_h = tl.zeros([BLOCK_H], dtype=tl.float32)
    amax_hw = tl.zeros([BLOCK_H], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        mask_h = offs_h < H
        mine = mask_h & (offs_h >= lo) & (offs_h < hi)
        if FUSE_POST:
            y = tl.load(y_ptr + offs_h * stride_yh, mask=mask_h, other=0.0).to(tl.float32)
            if ADD_Y2:  # y + y2 rounded to y's dtype, as mhc_post's ADD_Y2 (bitwise the same streams)
                y2 = tl.load(y2_ptr + offs_h * stride_y2h, mask=mask_h, other=0.0).to(tl.float32)
                y = (y + y2).to(y_ptr.dtype.element_ty).to(tl.float32)
        h = tl.zeros([BLOCK_H], dtype=tl.float32)
        for j in tl.static_range(C):
            if FUSE_POST:  # the arithmetic of _mhc_post_kernel, in its order: bitwise the same stream
                s_j = tl.zeros([BLOCK_H], dtype=tl.float32)
                for i in tl.static_range(C):
                    c_ij = tl.load(comb_prev_ptr + i * stride_coi + j * stride_coj).to(tl.float32)
                    s_i = tl.load(s_ptr + i * stride_sc + offs_h * stride_sh, mask=mask_h, other=0.0).to(tl.float32)
                    s_j += c_ij * s_i
                post_j = tl.load(post_prev_ptr + j * stride_poc).to(tl.float32)
                s_j = (s_j + post_j * y).to(snew_ptr.dtype.element_ty)
                tl.store(snew_ptr + j * stride_nc + offs_h * stride_nh, s_j, mask=mine)
            else:
                s_j = tl.load(s_ptr + j * stride_sc + offs_h * stride_sh, mask=mask_h, other=0.0)
            h += tl.load(pre_prev_ptr + j * stride_ppc).to(tl.float32) * s_j.to(tl.float32)
        ssq_h += h * h
        h_parked = h.to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + offs_h * stride_xh, h_parked, mask=mine)
        if QUANT:
            w = tl.load(w_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)
            amax_hw = tl.maximum(amax_hw, tl.abs(h_parked.to(tl.float32) * w))
    rx = tl.rsqrt(tl.sum(ssq_h, axis=0) * inv_h + eps)
    if QUANT:
        # as the two-kernel collapse: x's amax is rx times max |h * w|, rounded to x's dtype as x is
        amax = (tl.max(amax_hw, axis=0) * rx).to(x_ptr.dtype.element_ty).to(tl.float32)
        qs = _fp8_token_scale(amax, floor)
        if p == 0:
            tl.store(qs_ptr + t, qs)
    tl.debug_barrier()  # pass 2 reads back the h this program's threads parked in x

    # Pass 2, this program's columns: normalise h in place (and quantise x)
    for h0 in range(lo, hi, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        mask_h = offs_h < H
        h = tl.load(x_ptr + offs_h * stride_xh, mask=mask_h, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)
        x = (h * rx * w).to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + offs_h * stride_xh, x, mask=mask_h)
        if QUANT:
            code = _e4m3_byte(tl.math.div_rn(x.to(tl.float32), tl.broadcast_to(qs, [BLOCK_H])))
            tl.store(q_ptr + offs_h * stride_qh, code.to(tl.uint8), mask=mask_h)


@functools.cache
def _kernels() -> SimpleNamespace:
    """``triton.jit`` the kernels once per process (and Triton mode: compiled or TRITON_INTERPRET=1)."""
    triton = _triton()
    from vllm_dsv41.ops import compressor

    compressor._kernels()  # its E4M3 helpers become JIT functions, called by the epilogue's QUANT columns
    globals().update(_e4m3_byte=compressor._e4m3_byte, _fp8_token_scale=compressor._fp8_token_scale)
    rows = dict(do_not_specialize=ROW_COUNT_ARGS)
    return SimpleNamespace(pre=triton.jit(_mhc_pre_kernel, **rows),
                           # the H split count follows the row count too; the epilogue only loops over it
                           pre_epilogue=triton.jit(_mhc_pre_epilogue_kernel,
                                                   do_not_specialize=ROW_COUNT_ARGS + ("SPLIT",)),
                           post=triton.jit(_mhc_post_kernel, **rows),
                           collapse_rows=triton.jit(_mhc_collapse_rows_kernel))


# --------------------------------------------------------------------------- launch wrappers


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pre_config(T: int, H: int, fuse_post: bool, device: torch.device) -> dict:
    """Launch parameters of ``_mhc_pre_kernel``: token block, H chunk, warps, stages, H split count.

    16-token blocks up to T = 64 and 64-token blocks above (fn is re-read from L2 once per block, so large T
    wants 64); 64-wide H chunks up to 16 tokens (half the splits of narrower chunks, so the epilogue sums
    half the partials), 16-wide above (register pressure of the fp32 stream tile and of the fused post-mix);
    4 warps.  The split count makes token blocks x splits about two programs per SM, so that at small T the
    programs share the read of fn.  Chosen from CUPTI kernel times on an H200 with fp32 streams under the
    Triton that vLLM 0.32 ships (docs/benchmarks.md, session 8, ``benchmarks/ops/kernel_times.py --only
    mhc``): against the previous tiles (8 warps from 64 tokens), ``mhc_pre`` 38.8 -> 19.3 µs and
    ``mhc_post_pre`` 53.1 -> 35.2 µs at T = 64, 662 -> 380 and 1,257 -> 698 µs at T = 4096.
    """
    block_t = 16 if T <= 64 else 64
    block_h = 64 if T <= 16 else 16
    split = max(1, min(2 * sm_count(device) // _cdiv(T, block_t), _cdiv(H, block_h)))
    return dict(block_t=block_t, block_h=block_h, split=split, num_warps=4, num_stages=2)


GEMM_FROM_ENV = "VLLM_DSV41_MHC_GEMM_FROM"
GEMM_FROM_DEFAULT = 1024


def gemm_from() -> int:
    """Rows from which the boundary's projection leaves the kernel for one cuBLAS fp32 GEMM
    (``VLLM_DSV41_MHC_GEMM_FROM``, default 1024; 0 = never)."""
    v = os.environ.get(GEMM_FROM_ENV, "")
    try:
        n = int(v) if v else GEMM_FROM_DEFAULT
    except ValueError:
        raise ValueError(f"{GEMM_FROM_ENV}={v!r}: expected a row count (0 = never)") from None
    return n if n > 0 else 1 << 62


SPLIT_ROWS_ENV = "VLLM_DSV41_MHC_SPLIT_ROWS"
SPLIT_ROWS_DEFAULT = 64


def split_rows() -> int:
    """Rows up to which the model takes the deferred-coefficient boundary (``VLLM_DSV41_MHC_SPLIT_ROWS``, default
    64; 0 = never): ``mhc_collapse`` / ``mhc_post_collapse`` before the sublayer, ``mhc_coeffs`` beside it on the
    side stream (``model_executor/overlap.py``).  The sublayer needs only x, which the previous boundary's pre-mix
    coefficients give; this boundary's own coefficients are first read at its post-mix."""
    return env_rows(SPLIT_ROWS_ENV, SPLIT_ROWS_DEFAULT)


def _stream_config(T: int, H: int, fuse_post: bool, device: torch.device) -> dict:
    """Launch parameters of ``_mhc_pre_kernel`` without the projection (a streaming kernel: no MMA, so no
    16-row minimum and no shared-memory layout changes), and enough H splits for about four programs per SM.
    Tiles from CUPTI kernel times on an H200 at 1k-16k rows with fp32 streams (docs/benchmarks.md, session 12,
    ``kernel_times.py --only mhc_sweep``): 2 tokens x 1,024 columns for ``mhc_pre``, 16 x 128 with the post-mix
    (its C source tiles per stream); the five other tiles tried took up to 27% longer."""
    block_t, block_h = (16, 128) if fuse_post else (2, 1024)
    split = max(1, min(_cdiv(4 * sm_count(device), _cdiv(T, block_t)), _cdiv(H, block_h)))
    return dict(block_t=block_t, block_h=block_h, split=split, num_warps=4, num_stages=2)


def _fp32_projection(v: torch.Tensor, fn: torch.Tensor) -> torch.Tensor:
    """v [T, C*H] @ fn^T in fp32 through cuBLAS, TF32 off for the call whatever the process chose (the
    reference is an fp32 product; TF32 would keep 10 mantissa bits of the stream)."""
    if not torch.backends.cuda.matmul.allow_tf32:
        return torch.mm(v, fn.t())
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return torch.mm(v, fn.t())
    finally:
        torch.backends.cuda.matmul.allow_tf32 = True


def _fn_split(fn: torch.Tensor) -> torch.Tensor:
    """fn fp32 [N, K] -> bf16 [2N, K]: the hi parts, then the lo parts (fn - hi).  Kept on the tensor object itself
    with its version counter (a cache keyed by address handed a freed tensor's split to the next tensor allocated
    there: the CUDA tests of session 15), and not kept when made inside a CUDA-graph capture, where nothing runs
    until the graph replays."""
    held = getattr(fn, "_dsv41_bf16_split", None)
    if held is not None and held[0] == fn._version:
        return held[1]
    hi = fn.to(torch.bfloat16)
    both = torch.cat((hi, (fn - hi.float()).to(torch.bfloat16))).contiguous()
    if not (fn.is_cuda and torch.cuda.is_current_stream_capturing()):
        fn._dsv41_bf16_split = (fn._version, both)
    return both


def _bf16_projection(v: torch.Tensor, fn: torch.Tensor) -> torch.Tensor:
    """v [T, C*H] bf16 @ fn^T in fp32 without an fp32 copy of v: fn split into bf16 hi + lo rows once (the kernel's
    BF16_SPLIT, ~2^-17 relative error per product; v is exact in bf16), one bf16 GEMM with fp32 output (cuBLAS) over
    both, the halves added."""
    both = _fn_split(fn)
    n = fn.shape[0]
    if v.is_cuda:
        m = torch.mm(v, both.t(), out_dtype=torch.float32)
    else:  # the interpreter tests: the same products in fp32
        m = v.float() @ both.float().t()
    return m[:, :n] + m[:, n:]


def _check_pre_args(stream, fn, base, scale, pre_prev, norm_w) -> tuple[int, int, int, int]:
    assert stream.dim() == 3 and stream.stride(2) == 1, "stream must be [T, C, H] with H contiguous"
    T, C, H = stream.shape
    nmix = (2 + C) * C
    assert C & (C - 1) == 0, f"hc_mult C={C} must be a power of two"
    assert fn.dtype == torch.float32 and fn.shape == (nmix, C * H) and fn.stride(1) == 1, "fn: fp32 [(2+C)*C, C*H]"
    assert base.shape == (nmix,) and base.is_contiguous() and base.dtype == torch.float32
    assert scale.shape == (3,) and scale.is_contiguous() and scale.dtype == torch.float32
    if pre_prev is not None:  # mhc_coeffs takes neither
        assert pre_prev.shape == (T, C) and norm_w.shape == (H,) and norm_w.is_contiguous()
    return T, C, H, nmix


#: Partials the epilogue reads per round.  At batch 1 the pre kernel splits H = 5120 into 160 slices, and reading
#: them one after the other (``EPILOGUE_SPLITS = 1``, the previous kernel) is the likely reason the epilogue took
#: 13 µs per boundary at T=1 in the H200 decode profile; the gain of 16 per round is not profiled yet.
EPILOGUE_SPLITS = 16


def _partials(T: int, H: int, nmix: int, cfg: dict, dev: torch.device) -> tuple[int, int, int, torch.Tensor]:
    """(H per split in whole chunks, split count, padded NMIX, the [split, T, NP] fp32 partials) for ``cfg``."""
    hs = _cdiv(_cdiv(H, cfg["split"]), cfg["block_h"]) * cfg["block_h"]
    split = _cdiv(H, hs)
    np_ = _next_pow2(nmix + 3)  # the projection columns, then sum v^2, sum h^2 and max |h * w|
    return hs, split, np_, torch.empty(split, T, np_, dtype=torch.float32, device=dev)


def _post_sources(stream, pre_prev, post_inputs, new_stream, T: int, C: int, H: int) -> tuple[tuple, tuple, bool]:
    """The pre kernel's (y, y2, post_prev, comb_prev, new stream) pointers, their 12 strides and ADD_Y2; placeholders
    that are never dereferenced without the post-mix (or without y2).  ``post_inputs`` = (y, post_prev, comb_prev) or
    (y, post_prev, comb_prev, y2); a y2 of another dtype than y is added to it here first, as the reference does."""
    if post_inputs is None:
        return (stream, stream, pre_prev, pre_prev, stream), (0,) * 12, False
    y, post_prev, comb_prev, *rest = post_inputs
    y2 = rest[0] if rest else None
    assert y.shape == (T, H) and post_prev.shape == (T, C) and comb_prev.shape == (T, C, C)
    if y2 is not None:
        assert y2.shape == (T, H), f"y2 {tuple(y2.shape)} for y {tuple(y.shape)}"
        if y2.dtype != y.dtype:
            y, y2 = y + y2, None
    y2_ = y if y2 is None else y2
    return ((y, y2_, post_prev, comb_prev, new_stream),
            (*y.stride(), *y2_.stride(), *post_prev.stride(), *comb_prev.stride(), *new_stream.stride()), y2 is not None)


def _launch_pre(stream, fn, base, scale, pre_prev, norm_w, eps, hc_eps, iters, post_inputs, config):
    """Shared by mhc_pre and mhc_post_pre; ``post_inputs`` = (y, post_prev, comb_prev) or None."""
    T, C, H, nmix = _check_pre_args(stream, fn, base, scale, pre_prev, norm_w)
    dev = stream.device
    x = torch.empty(T, H, dtype=stream.dtype, device=dev)
    pre = torch.empty(T, C, dtype=torch.float32, device=dev)
    post = torch.empty(T, C, dtype=torch.float32, device=dev)
    comb = torch.empty(T, C, C, dtype=torch.float32, device=dev)
    fuse = post_inputs is not None
    new_stream = torch.empty_like(stream) if fuse else None
    if T == 0:
        return new_stream, x, pre, post, comb

    project = (config or {}).get("project", T < gemm_from())  # the projection inside the kernel
    cfg = {**(_pre_config(T, H, fuse, dev) if project else _stream_config(T, H, fuse, dev)), **(config or {})}
    block_h = cfg["block_h"]
    hs, split, np_, part = _partials(T, H, nmix, cfg, dev)
    src, src_strides, add_y2 = _post_sources(stream, pre_prev, post_inputs, new_stream, T, C, H)
    k = _kernels()
    on = pdl(stream)
    k.pre[(_cdiv(T, cfg["block_t"]), split)](
        stream, *src, fn, pre_prev, x, part, part,  # w: unused (no AMAX)
        T, H, hs,
        *stream.stride(), *src_strides, *fn.stride(), *pre_prev.stride(), *x.stride(), *part.stride(),
        C=C, NMIX=nmix, NP=np_, BLOCK_T=cfg["block_t"], BLOCK_H=block_h,
        FUSE_POST=fuse, BF16_SPLIT=stream.dtype == torch.bfloat16, BF16_MMA=not interpreting(), PROJECT=project,
        ADD_Y2=add_y2, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **pdl_launch(on),
    )
    if not project:  # the kernel left the projection columns 0: split 0 takes the whole product
        v = (new_stream if fuse else stream).reshape(T, C * H)
        part[0, :, :nmix] = _bf16_projection(v, fn) if v.dtype == torch.bfloat16 else _fp32_projection(v.float(), fn)

    ep_t, ep_h = 8, 512
    nhb = _cdiv(H, ep_h)
    k.pre_epilogue[(_cdiv(T, ep_t), nhb + 1)](
        part, base, scale, norm_w, x, pre, post, comb, part, part,  # q, qs: unused (no QUANT)
        T, H, split, nhb,
        1.0 / (C * H), 1.0 / H, eps, hc_eps, iters, 0.0,
        *part.stride(), *x.stride(), *pre.stride(), *post.stride(), *comb.stride(), 0, 0,
        C=C, NMIX=nmix, BLOCK_T=ep_t, BLOCK_H=ep_h, BLOCK_S=EPILOGUE_SPLITS, num_warps=4,
        **pdl_launch(on),
    )
    return new_stream, x, pre, post, comb


def _collapse_config(T: int, H: int, fuse_post: bool, device: torch.device) -> dict:
    """Launch parameters of ``_mhc_pre_kernel`` as the collapse of ``mhc_collapse`` / ``mhc_post_collapse`` (no
    projection: a streaming kernel): 2-token blocks and 256-wide H chunks, split until about four programs per SM.
    Decode sizes only (see :func:`split_rows`).  Not yet timed on a GPU; chosen because they build for sm_90 without
    spills with bf16 streams (40 registers, 168 with the post-mix), where the prefill's fused 16 x 128 tile spills
    4,952 bytes a thread (``tests/ops/test_mhc.py::test_split_boundary_kernels_build_for_sm90``)."""
    block_t, block_h = 2, 256
    split = max(1, min(_cdiv(4 * sm_count(device), _cdiv(T, block_t)), _cdiv(H, block_h)))
    return dict(block_t=block_t, block_h=block_h, split=split, num_warps=4, num_stages=2)


def _launch_collapse(stream, pre_prev, norm_w, eps, post_inputs, config, quant: bool = False):
    """``mhc_collapse`` (``post_inputs`` None) and ``mhc_post_collapse``: the pre kernel without the projection
    (post-mix, collapse and both sums of squares), then only the epilogue's normalising columns; with ``quant`` (the
    ``*_quant`` ops) the pre kernel also keeps each split's max |h * w| (AMAX) and the normalising columns write x's
    codes beside x (QUANT) -> (new stream, x, codes, scales)."""
    assert stream.dim() == 3 and stream.stride(2) == 1, "stream must be [T, C, H] with H contiguous"
    T, C, H = stream.shape
    assert C & (C - 1) == 0, f"hc_mult C={C} must be a power of two"
    assert pre_prev.shape == (T, C) and norm_w.shape == (H,) and norm_w.is_contiguous()
    dev = stream.device
    x = torch.empty(T, H, dtype=stream.dtype, device=dev)
    fuse = post_inputs is not None
    new_stream = torch.empty_like(stream) if fuse else None
    codes = torch.empty(T, H, dtype=torch.float8_e4m3fn, device=dev) if quant else None
    scales = torch.empty(T, 1, dtype=torch.float32, device=dev) if quant else None
    if T == 0:
        return (new_stream, x, codes, scales) if quant else (new_stream, x)
    if (config or {}).get("rows", T <= collapse_rows()):
        _launch_collapse_rows(stream, pre_prev, norm_w, eps, post_inputs, config, x, new_stream, codes, scales)
        return (new_stream, x, codes, scales) if quant else (new_stream, x)
    nmix = (2 + C) * C
    cfg = {**_collapse_config(T, H, fuse, dev), **(config or {})}
    block_h = cfg["block_h"]
    hs, split, np_, part = _partials(T, H, nmix, cfg, dev)
    src, src_strides, add_y2 = _post_sources(stream, pre_prev, post_inputs, new_stream, T, C, H)
    k = _kernels()
    on = pdl(stream)
    k.pre[(_cdiv(T, cfg["block_t"]), split)](
        stream, *src, stream, pre_prev, x, part, norm_w,  # fn: a placeholder (PROJECT off)
        T, H, hs,
        *stream.stride(), *src_strides, 0, 0, *pre_prev.stride(), *x.stride(), *part.stride(),
        C=C, NMIX=nmix, NP=np_, BLOCK_T=cfg["block_t"], BLOCK_H=block_h,
        FUSE_POST=fuse, BF16_SPLIT=False, BF16_MMA=False, PROJECT=False, COLLAPSE=True, AMAX=quant, ADD_Y2=add_y2,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **pdl_launch(on),
    )
    ep_t, ep_h = 8, 512
    nhb = _cdiv(H, ep_h)
    q8 = codes.view(torch.uint8) if quant else part
    # program columns 0 .. nhb-1 only: the coefficient column (NHB) is left to mhc_coeffs
    k.pre_epilogue[(_cdiv(T, ep_t), nhb)](
        part, part, part, norm_w, x, part, part, part,  # base, scale, pre, post, comb: never dereferenced
        q8, scales if quant else part,
        T, H, split, nhb,
        1.0 / (C * H), 1.0 / H, eps, 0.0, 1, formats.FP8_TOKEN_SCALE_FLOOR,
        *part.stride(), *x.stride(), 0, 0, 0, 0, 0, 0, 0, *(q8.stride() if quant else (0, 0)),
        C=C, NMIX=nmix, BLOCK_T=ep_t, BLOCK_H=ep_h, BLOCK_S=EPILOGUE_SPLITS, QUANT=quant, num_warps=4,
        **pdl_launch(on),
    )
    return (new_stream, x, codes, scales) if quant else (new_stream, x)


COLLAPSE_ROWS_ENV = "VLLM_DSV41_MHC_COLLAPSE_ROWS"
COLLAPSE_ROWS_DEFAULT = 0


def collapse_rows() -> int:
    """Rows up to which ``mhc_collapse`` / ``mhc_post_collapse`` (and their ``_quant``) take the one-launch kernel
    (``VLLM_DSV41_MHC_COLLAPSE_ROWS``, default 0 = never): each token's programs compute the whole row's sum of squares
    themselves, so the normalisation needs no second launch."""
    return env_rows(COLLAPSE_ROWS_ENV, COLLAPSE_ROWS_DEFAULT)


def _rows_config(H: int, fuse_post: bool) -> dict:
    """Launch parameters of ``_mhc_collapse_rows_kernel``: the H chunk, the programs a token (each writes H / programs
    columns, and every one reads the token's whole stream) and the warps."""
    block_h = min(2048, _next_pow2(H))
    if fuse_post:
        return dict(block_h=block_h, programs=max(1, min(3, _cdiv(H, block_h))), num_warps=8)
    return dict(block_h=block_h, programs=1, num_warps=16)


def _launch_collapse_rows(stream, pre_prev, norm_w, eps, post_inputs, config, x, new_stream, codes, scales):
    """The one-launch collapse (:func:`collapse_rows`) into the outputs ``_launch_collapse`` allocated: grid (tokens,
    programs a token); the same x, stream, codes and scales as the two-kernel collapse but for the order of the sum
    of squares."""
    T, C, H = stream.shape
    cfg = {**_rows_config(H, post_inputs is not None), **(config or {})}
    block_h = cfg["block_h"]
    hp = _cdiv(_cdiv(H, cfg["programs"]), block_h) * block_h
    src, src_strides, add_y2 = _post_sources(stream, pre_prev, post_inputs, new_stream, T, C, H)
    quant = codes is not None
    q8 = codes.view(torch.uint8) if quant else x
    _kernels().collapse_rows[(T, _cdiv(H, hp))](
        stream, *src, pre_prev, norm_w, x, q8, scales if quant else x,
        H, hp, 1.0 / H, eps, formats.FP8_TOKEN_SCALE_FLOOR,
        *stream.stride(), *src_strides, *pre_prev.stride(), *x.stride(), *q8.stride(),
        C=C, BLOCK_H=block_h, FUSE_POST=post_inputs is not None, ADD_Y2=add_y2, QUANT=quant,
        num_warps=cfg["num_warps"], **pdl_launch(pdl(stream)),
    )


def _launch_coeffs(stream, fn, base, scale, eps, hc_eps, iters, config):
    """``mhc_coeffs``: the pre kernel without the collapse (the projection and sum(v^2); cuBLAS from ``gemm_from()``
    rows), then only the epilogue's coefficient column."""
    T, C, H, nmix = _check_pre_args(stream, fn, base, scale, None, None)
    dev = stream.device
    pre = torch.empty(T, C, dtype=torch.float32, device=dev)
    post = torch.empty(T, C, dtype=torch.float32, device=dev)
    comb = torch.empty(T, C, C, dtype=torch.float32, device=dev)
    if T == 0:
        return pre, post, comb
    project = (config or {}).get("project", T < gemm_from())
    cfg = {**(_pre_config(T, H, False, dev) if project else _stream_config(T, H, False, dev)), **(config or {})}
    block_h = cfg["block_h"]
    hs, split, np_, part = _partials(T, H, nmix, cfg, dev)
    k = _kernels()
    on = pdl(stream)
    k.pre[(_cdiv(T, cfg["block_t"]), split)](
        stream, stream, stream, pre, comb, stream, fn, pre, part, part, part,  # y .. snew, pre_prev, h, w: unused
        T, H, hs,
        *stream.stride(), *(0,) * 12, *fn.stride(), 0, 0, 0, 0, *part.stride(),
        C=C, NMIX=nmix, NP=np_, BLOCK_T=cfg["block_t"], BLOCK_H=block_h,
        FUSE_POST=False, BF16_SPLIT=stream.dtype == torch.bfloat16, BF16_MMA=not interpreting(), PROJECT=project,
        COLLAPSE=False, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **pdl_launch(on),
    )
    if not project:
        v = stream.reshape(T, C * H)
        part[0, :, :nmix] = _bf16_projection(v, fn) if v.dtype == torch.bfloat16 else _fp32_projection(v.float(), fn)
    ep_t = 8
    # one program column, the coefficient one (NHB = 0): x and the norm weight are never touched
    k.pre_epilogue[(_cdiv(T, ep_t), 1)](
        part, base, scale, base, part, pre, post, comb, part, part,
        T, H, split, 0,
        1.0 / (C * H), 1.0 / H, eps, hc_eps, iters, 0.0,
        *part.stride(), 0, 0, *pre.stride(), *post.stride(), *comb.stride(), 0, 0,
        C=C, NMIX=nmix, BLOCK_T=ep_t, BLOCK_H=512, BLOCK_S=EPILOGUE_SPLITS, num_warps=4,
        **pdl_launch(on),
    )
    return pre, post, comb


def _mhc_collapse_triton(stream, pre_prev, norm_w, eps: float, config: dict | None = None):
    """CUDA (or interpreter) path of ``mhc_collapse``."""
    return _launch_collapse(stream, pre_prev, norm_w, eps, None, config)[1]


def _mhc_post_collapse_triton(stream, y, post_prev, comb_prev, pre_prev, norm_w, eps: float, y2=None,
                              config: dict | None = None):
    """CUDA (or interpreter) path of ``mhc_post_collapse``: the post-mix arithmetic of ``mhc_post`` (bitwise)."""
    return _launch_collapse(stream, pre_prev, norm_w, eps, (y, post_prev, comb_prev, y2), config)


def _mhc_collapse_quant_triton(stream, pre_prev, norm_w, eps: float, config: dict | None = None):
    """CUDA (or interpreter) path of ``mhc_collapse_quant``: ``mhc_collapse``'s x (the same arithmetic) and its codes
    and scales from the same launch as the normalisation."""
    return _launch_collapse(stream, pre_prev, norm_w, eps, None, config, quant=True)[1:]


def _mhc_post_collapse_quant_triton(stream, y, post_prev, comb_prev, pre_prev, norm_w, eps: float, y2=None,
                                    config: dict | None = None):
    """CUDA (or interpreter) path of ``mhc_post_collapse_quant``."""
    return _launch_collapse(stream, pre_prev, norm_w, eps, (y, post_prev, comb_prev, y2), config, quant=True)


def _mhc_coeffs_triton(stream, fn, base, scale, eps: float, hc_eps: float, iters: int, config: dict | None = None):
    """CUDA (or interpreter) path of ``mhc_coeffs``."""
    return _launch_coeffs(stream, fn, base, scale, eps, hc_eps, iters, config)


def _mhc_pre_triton(stream, fn, base, scale, pre_prev, norm_w, eps: float, hc_eps: float, iters: int,
                    config: dict | None = None):
    """CUDA (or interpreter) path of ``mhc_pre``; ``config`` overrides ``_pre_config`` (benchmark sweeps)."""
    _, x, pre, post, comb = _launch_pre(stream, fn, base, scale, pre_prev, norm_w, eps, hc_eps, iters, None, config)
    return x, pre, post, comb


def _mhc_post_triton(stream, y, post, comb, y2=None, config: dict | None = None):
    """CUDA (or interpreter) path of ``mhc_post``: one token x BLOCK_H columns of every stream per program; ``y2`` read
    beside y (of another dtype: added first, in PyTorch, as the reference does)."""
    assert stream.dim() == 3 and stream.stride(2) == 1, "stream must be [T, C, H] with H contiguous"
    T, C, H = stream.shape
    assert C & (C - 1) == 0, f"hc_mult C={C} must be a power of two"
    assert y.shape == (T, H) and post.shape == (T, C) and comb.shape == (T, C, C)
    if y2 is not None:
        assert y2.shape == (T, H), f"mhc_post: y2 {tuple(y2.shape)} for y {tuple(y.shape)}"
        if y2.dtype != y.dtype:
            y, y2 = y + y2, None
    out = torch.empty_like(stream)
    if T == 0:
        return out
    cfg = {"block_t": 1, "block_h": 1024 if T >= 64 else 256, "num_warps": 4, **(config or {})}
    grid = (_cdiv(T, cfg["block_t"]), _cdiv(H, cfg["block_h"]))
    y2_ = y if y2 is None else y2
    _kernels().post[grid](
        stream, y, y2_, post, comb, out, T, H,
        *stream.stride(), *y.stride(), *y2_.stride(), *post.stride(), *comb.stride(), *out.stride(),
        C=C, BLOCK_T=cfg["block_t"], BLOCK_H=cfg["block_h"], ADD_Y2=y2 is not None, num_warps=cfg["num_warps"],
        **pdl_launch(pdl(stream)),
    )
    return out


def _mhc_post_pre_triton(stream, y, post_prev, comb_prev, fn, base, scale, pre_prev, norm_w, eps: float,
                         hc_eps: float, iters: int, y2=None, config: dict | None = None):
    """CUDA (or interpreter) path of ``mhc_post_pre``: _mhc_pre_kernel with FUSE_POST, then the epilogue."""
    return _launch_pre(stream, fn, base, scale, pre_prev, norm_w, eps, hc_eps, iters,
                       (y, post_prev, comb_prev, y2), config)


# --------------------------------------------------------------------------- fake (meta) implementations


def _mhc_pre_fake(stream, fn, base, scale, pre_prev, norm_w, eps, hc_eps, iters):
    T, C, H = stream.shape
    f32 = dict(dtype=torch.float32)
    return (stream.new_empty(T, H), stream.new_empty(T, C, **f32), stream.new_empty(T, C, **f32),
            stream.new_empty(T, C, C, **f32))


def _mhc_post_fake(stream, y, post, comb, y2=None):
    return torch.empty_like(stream)


def _mhc_post_pre_fake(stream, y, post_prev, comb_prev, fn, base, scale, pre_prev, norm_w, eps, hc_eps, iters,
                       y2=None):
    return (torch.empty_like(stream), *_mhc_pre_fake(stream, fn, base, scale, pre_prev, norm_w, eps, hc_eps, iters))


def _mhc_collapse_fake(stream, pre_prev, norm_w, eps):
    return stream.new_empty(stream.shape[0], stream.shape[2])


def _mhc_post_collapse_fake(stream, y, post_prev, comb_prev, pre_prev, norm_w, eps, y2=None):
    return torch.empty_like(stream), _mhc_collapse_fake(stream, pre_prev, norm_w, eps)


def _mhc_collapse_quant_fake(stream, pre_prev, norm_w, eps):
    T, _, H = stream.shape
    return (stream.new_empty(T, H), stream.new_empty(T, H, dtype=torch.float8_e4m3fn),
            stream.new_empty(T, 1, dtype=torch.float32))


def _mhc_post_collapse_quant_fake(stream, y, post_prev, comb_prev, pre_prev, norm_w, eps, y2=None):
    return (torch.empty_like(stream), *_mhc_collapse_quant_fake(stream, pre_prev, norm_w, eps))


def _mhc_coeffs_fake(stream, fn, base, scale, eps, hc_eps, iters):
    return _mhc_pre_fake(stream, fn, base, scale, None, None, eps, hc_eps, iters)[1:]


# --------------------------------------------------------------------------- registration

_PRE_ARGS = "Tensor fn, Tensor base, Tensor scale, Tensor pre_prev, Tensor norm_w, float eps, float hc_eps, int iters"

mhc_pre = define_op(
    "mhc_pre", f"(Tensor stream, {_PRE_ARGS}) -> (Tensor, Tensor, Tensor, Tensor)",
    mhc_pre_ref, _mhc_pre_triton, _mhc_pre_fake)
mhc_post = define_op(
    "mhc_post", "(Tensor stream, Tensor y, Tensor post, Tensor comb, Tensor? y2=None) -> Tensor",
    mhc_post_ref, _mhc_post_triton, _mhc_post_fake)
mhc_post_pre = define_op(
    "mhc_post_pre",
    f"(Tensor stream, Tensor y, Tensor post_prev, Tensor comb_prev, {_PRE_ARGS}, Tensor? y2=None) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    mhc_post_pre_ref, _mhc_post_pre_triton, _mhc_post_pre_fake)
mhc_collapse = define_op(
    "mhc_collapse", "(Tensor stream, Tensor pre_prev, Tensor norm_w, float eps) -> Tensor",
    mhc_collapse_ref, _mhc_collapse_triton, _mhc_collapse_fake)
mhc_post_collapse = define_op(
    "mhc_post_collapse",
    "(Tensor stream, Tensor y, Tensor post_prev, Tensor comb_prev, Tensor pre_prev, Tensor norm_w, float eps, "
    "Tensor? y2=None) -> (Tensor, Tensor)",
    mhc_post_collapse_ref, _mhc_post_collapse_triton, _mhc_post_collapse_fake)
mhc_coeffs = define_op(
    "mhc_coeffs",
    "(Tensor stream, Tensor fn, Tensor base, Tensor scale, float eps, float hc_eps, int iters) "
    "-> (Tensor, Tensor, Tensor)",
    mhc_coeffs_ref, _mhc_coeffs_triton, _mhc_coeffs_fake)
mhc_collapse_quant = define_op(
    "mhc_collapse_quant", "(Tensor stream, Tensor pre_prev, Tensor norm_w, float eps) -> (Tensor, Tensor, Tensor)",
    mhc_collapse_quant_ref, _mhc_collapse_quant_triton, _mhc_collapse_quant_fake)
mhc_post_collapse_quant = define_op(
    "mhc_post_collapse_quant",
    "(Tensor stream, Tensor y, Tensor post_prev, Tensor comb_prev, Tensor pre_prev, Tensor norm_w, float eps, "
    "Tensor? y2=None) -> (Tensor, Tensor, Tensor, Tensor)",
    mhc_post_collapse_quant_ref, _mhc_post_collapse_quant_triton, _mhc_post_collapse_quant_fake)
