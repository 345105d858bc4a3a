"""``dsv41::moe_gemv`` - the routed experts of a few tokens (batch-1 decode) on the MXFP4 weights, MXFP8 activations,
in three launches and without sorting the rows by expert.

``moe_gemv(x [T, H] bf16, w13 [E, 2I, H/2], s13 [E, 2I, H/32], w2 [E, H, I/2], s2 [E, H, I/32], idx [T, k],
wts [T, k], limit) -> [T, H]`` (x's dtype), the weights as ``dsv41::moe_mxfp4`` takes them (the checkpoint's bytes,
``w13 = [w1; w3]``)::

    xq      = mxfp8(x)                                   (formats.encode_mxfp8_record: E4M3 under a UE8M0 per 32)
    [a; b]  = W13[e] @ xq[t],  h = mxfp8(silu(min(a, L)) * clamp(b, -L, L))            e = idx[t, j]
    y[t]    = sum_j wts[t, j] * W2[e] @ h[t, j]                                          (slots summed in order j)

MXFP8 activations are what the V4.1 experts take on the fast paths (architecture.md §2.7); the E4M3 codes times the
E2M1 codes are exact products, so only the fp32 sums' order separates the kernels from :func:`moe_gemv_ref`.

Why an op: at batch 1 the routed experts of a decode step took 2.29 ms in ``matmul_ogs`` (57 µs a layer for ~113 MB
of expert bytes, ~2 TB/s) plus ~0.4 ms of routing-data kernels (docs/benchmarks.md, session 21); six (token, slot)
pairs need no sort.  Launches:

1. ``_mxfp8_rows_kernel``: x -> E4M3 codes + fp32 power-of-two scales, the codes in the *diagonal layout*
   (:func:`_store_diag`): tiles of G scale groups, each the MMA's [32G, 16] operand with group c of the tile in
   column c and zeros elsewhere;
2. ``_up_kernel``: grid (I / BLOCK_N, SPLIT_K, T*k): a program owns one pair, one K part and BLOCK_N rows of w1 and
   the same rows of w3, and walks K a tile at a time (16G contiguous bytes of each row): it turns the packed E2M1
   bytes into E4M3 bytes four at a time in integer registers (value x 2^-6, exact: one shift-and-mask per nibble
   position, no lookup, no float conversion), runs one FP8 tensor-core MMA [BLOCK_N, 32G] x [32G, 16] against the
   diagonal tile, so output column c is group c's unscaled partial, and multiplies the [BLOCK_N, 16] result by the
   groups' weight and activation scales into the accumulator (one multiply-add a column per G groups; a column sum
   at the end).  The K parts are summed in order by the tile's last program, whose epilogue applies the clamped
   SwiGLU and quantises h to MXFP8 in the diagonal layout (BLOCK_N is a multiple of 32: whole groups);
3. ``_down_kernel``: grid (H / BLOCK_N, k, T): one pair's BLOCK_N rows of w2 over h the same way, times the routing
   weight; the k slots of a tile are summed in slot order by whichever of its programs arrives last (``fp8_gemv``'s
   counters: no fourth launch, graph-safe, deterministic).

The diagonal tile spends 16x the MMA work a one-column product needs, which Hopper's FP8 tensor cores have to spare
at one token; what it buys is one MMA and one scale pass per G groups, instead of one of each per group (the first
version: ~65 µs for the first GEMM at one token on an H100, where its weight bytes take ~22).  The zeros of the
layout are written once, when its buffer is made (:func:`_diag`, :func:`reserve`).

Why not the earlier MXFP4 kernels: ``dsv41::moe_mxfp4`` decodes each nibble to fp32 with four to six integer
operations per weight and upcasts to bf16 for the MMA; at one token that integer work, not the weight bytes, sets the
time (an H200 SM issues 64 integer operations a clock: 226M weights a layer at 5 ops is ~70 µs).  Here the decode
costs under one operation per weight.
"""

from __future__ import annotations

import functools

import torch

from vllm_dsv41 import formats
from vllm_dsv41.ops import define_op, fp8_gemv
from vllm_dsv41.ops._triton import (
    HAS_TRITON, gdc_launch_dependents, gdc_wait, interpreting, pdl, pdl_launch, tl, triton,
)
from vllm_dsv41.ops.moe_mxfp4 import _check
from vllm_dsv41.reference.model import clamped_swiglu_act

__all__ = ["moe_gemv", "moe_gemv_ref", "mxfp8_roundtrip", "plan", "MAX_TOKENS"]

MAX_TOKENS = 16
"""Tokens the kernels serve; more (or a non-bf16 x) go through the reference arithmetic.  Each (token, slot) pair reads
its expert's bytes on its own, so the route pays off only while pairs rarely share an expert (the model takes it for
at most ``VLLM_DSV41_MOE_GEMV_ROWS`` tokens)."""


def mxfp8_roundtrip(v: torch.Tensor) -> torch.Tensor:
    """fp32 [..., D] -> the values of its MXFP8 record (formats.encode_mxfp8_record), fp32."""
    return formats.decode_mxfp8_record(formats.encode_mxfp8_record(v.float()), v.shape[-1])


def moe_gemv_ref(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
                 idx: torch.Tensor, wts: torch.Tensor, limit: float) -> torch.Tensor:
    """Plain PyTorch (the CPU implementation and the test oracle): expert by expert over the dequantised weights, in
    fp32, on MXFP8 activations; every expert runs on every row, weighted by that row's routing weight for it (0 when
    not chosen), so nothing is read on the host."""
    T, H, E, I, k = _check(x, w13, s13, w2, s2, idx, wts)
    xq = mxfp8_roundtrip(x)
    y = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    for e in range(E):
        ab = xq @ formats.dequant_mxfp4(w13[e], s13[e].view(torch.uint8)).t()
        h = mxfp8_roundtrip(clamped_swiglu_act(ab[:, :I], ab[:, I:], limit))
        g = (wts.float() * (idx == e)).sum(1, keepdim=True)
        y += (h @ formats.dequant_mxfp4(w2[e], s2[e].view(torch.uint8)).t()) * g
    return y.to(x.dtype)


@triton.jit
def _lo_e4m3(b, INTERPRET: tl.constexpr):
    """uint8 bytes of packed E2M1 pairs -> the low nibbles as E4M3 (value x 2^-6): (s e1 e0 m) -> (s 0 0 e1 e0 m 0 0).
    On the GPU four bytes at a time in one 32-bit register; in the interpreter the same bits per byte, as fp32."""
    if INTERPRET:
        i = b.to(tl.int32) & 255
        return _e4m3_to_f32(((i & 7) << 2) | ((i & 8) << 4), False)
    return tl.inline_asm_elementwise(
        "{ .reg .b32 a, c; and.b32 a, $1, 0x07070707; shl.b32 a, a, 2; and.b32 c, $1, 0x08080808; shl.b32 c, c, 4; "
        "or.b32 $0, a, c; }", "=r,r", [b], dtype=tl.uint8, is_pure=True, pack=4).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _hi_e4m3(b, INTERPRET: tl.constexpr):
    """The high nibbles as E4M3 (value x 2^-6): bits 6..4 move to 4..2, the sign stays at bit 7."""
    if INTERPRET:
        i = b.to(tl.int32) & 255
        return _e4m3_to_f32(((i >> 2) & 28) | (i & 128), False)
    return tl.inline_asm_elementwise(
        "{ .reg .b32 a, c; shr.b32 a, $1, 2; and.b32 a, a, 0x1C1C1C1C; and.b32 c, $1, 0x80808080; or.b32 $0, a, c; }",
        "=r,r", [b], dtype=tl.uint8, is_pure=True, pack=4).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _tile_dot(w_rows, s_rows, xd_row, xs_row, tau, n_groups, n_ok, G: tl.constexpr, EVEN: tl.constexpr,
              INTERPRET: tl.constexpr):
    """Tile ``tau`` (G scale groups, 16 * G bytes of each row) of BLOCK_N weight rows (``w_rows`` [BLOCK_N, 1] byte
    pointers, ``s_rows`` [BLOCK_N] scale pointers) against one row's diagonal activation tile (:func:`_store_diag`):
    fp32 [BLOCK_N, 16] whose column c is group tau * G + c's partial dot, its two scales and the 2^6 of the E4M3
    reading applied (columns from G on are 0).  The UE8M0 byte becomes the float's exponent field as it is (bytes 0 and
    255, which no MXFP4 encoder writes for finite weights, read as 0 and inf instead of 2^-127 and NaN)."""
    j = tau * (16 * G) + tl.arange(0, 16 * G)
    if EVEN:
        b = tl.load(w_rows + j[None, :], mask=n_ok[:, None], other=0)
    else:
        b = tl.load(w_rows + j[None, :], mask=n_ok[:, None] & (j < n_groups * 16)[None, :], other=0)
    # along K: the tile's low nibbles (its even inputs), then its high nibbles (the odd ones), the diagonal tile's
    # order, so each thread's MMA registers are the decodes of one 32-bit word of the row
    w = tl.reshape(tl.permute(tl.join(_lo_e4m3(b, INTERPRET), _hi_e4m3(b, INTERPRET)), (0, 2, 1)), (b.shape[0], 32 * G))
    c = tl.arange(0, 16)
    xt = tl.load(xd_row + tau * (512 * G) + c[None, :] * (32 * G) + tl.arange(0, 32 * G)[:, None])
    if INTERPRET:
        part = tl.dot(w, _e4m3_to_f32(xt.to(tl.int32) & 255, False), input_precision="ieee")
    else:
        part = tl.dot(w, xt)
    gs = tau * G + c
    g_ok = (c < G) & (gs < n_groups)
    sc = tl.load(s_rows[:, None] + gs[None, :], mask=n_ok[:, None] & g_ok[None, :], other=0).to(tl.int32)
    xs = tl.load(xs_row + gs, mask=g_ok, other=0.0)
    return part * ((sc << 23).to(tl.float32, bitcast=True) * (xs * 64.0)[None, :])


@triton.jit
def _diag_row(codes_ptr, r, n_groups, G: tl.constexpr):
    """Row r of a diagonal-layout buffer (:func:`diag_row_bytes` bytes a row: n_groups padded to whole tiles of G)."""
    return codes_ptr + r * (tl.cdiv(n_groups, G) * (512 * G))


@triton.jit
def _store_diag(codes_row, s_row, gs, ok, q, scale, G: tl.constexpr):
    """Groups ``gs`` [n] of one row into its diagonal layout: tile gs // G is the MMA's [32 * G, 16] operand, K-major
    (16 columns of 32 * G bytes), whose column c = gs % G holds group gs's 16 even inputs at K 16c.. and its 16 odd
    ones at K 16G + 16c.. and zeros elsewhere (written once, when the buffer is made, never here); scales [n] as fp32."""
    i = tl.arange(0, 32)
    c = gs % G
    off = (gs // G) * (512 * G) + c * (32 * G + 16)
    tl.store(codes_row + off[:, None] + ((i % 2) * (16 * G) + i // 2)[None, :], q, mask=ok[:, None])
    tl.store(s_row + gs, scale, mask=ok)


@triton.jit
def _mxfp8_quant(v, floor, INTERPRET: tl.constexpr):
    """fp32 [G, 32] -> (codes [G, 32]: float8e4nv, uint8 bytes in the interpreter; scales [G] fp32), as
    formats.encode_mxfp8_record: scale = 2^ceil(log2(max(amax, floor) / 448)), code = e4m3(v / scale) (exact
    division by a power of two, then round to nearest even)."""
    amax = tl.max(tl.abs(v), axis=1)
    r = tl.math.div_rn(tl.maximum(amax, floor), tl.full(amax.shape, 448.0, tl.float32))
    bits = r.to(tl.int32, bitcast=True)
    k = ((bits >> 23) & 255) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    k = tl.minimum(tl.maximum(k, -126), 126)
    scale = ((k + 127) << 23).to(tl.float32, bitcast=True)
    inv = ((127 - k) << 23).to(tl.float32, bitcast=True)
    y = v * inv[:, None]
    if INTERPRET:  # bit by bit: the interpreter's fp8 cast drops the carry into the next binade
        return _e4m3_byte(y).to(tl.uint8), scale
    return y.to(tl.float8e4nv, fp_downcast_rounding="rtne"), scale


@triton.jit
def _mxfp8_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, floor, BLOCK_G: tl.constexpr, G: tl.constexpr,
                       INTERPRET: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:  # programmatic dependent launch: the previous kernel first
        gdc_wait()
        gdc_launch_dependents()
    t = tl.program_id(0)
    gs = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    ok = gs < K // 32
    v = tl.load(x_ptr + t * stride_x + gs[:, None] * 32 + tl.arange(0, 32)[None, :], mask=ok[:, None],
                other=0.0).to(tl.float32)
    q, scale = _mxfp8_quant(v, floor, INTERPRET)
    _store_diag(_diag_row(q_ptr, t, K // 32, G), s_ptr + t * (K // 32), gs, ok, q, scale, G)


@triton.jit
def _up_kernel(xd_ptr, xs_ptr, w_ptr, s_ptr, idx_ptr, hd_ptr, hs_ptr, part_ptr, lock_ptr,
               K, I, k_slots, stride_we, stride_wn, stride_se, stride_sn, limit, floor,
               BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, G: tl.constexpr, H_G: tl.constexpr,
               EVEN: tl.constexpr, THREADS: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:  # programmatic dependent launch: the previous kernel first
        gdc_wait()
        gdc_launch_dependents()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    p = tl.program_id(2)                                   # the (token, slot) pair t * k + j
    e = tl.load(idx_ptr + p).to(tl.int64)
    t = p // k_slots
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    wa = w_ptr + e * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn   # w1 rows (gate)
    wb = wa + I * stride_wn                                                  # w3 rows (up)
    sa = s_ptr + e * stride_se + offs_n.to(tl.int64) * stride_sn
    sb = sa + I * stride_sn
    n_groups = K // 32
    tiles = tl.cdiv(n_groups, G)
    xd_row = _diag_row(xd_ptr, t, n_groups, G)
    xs_row = xs_ptr + t * n_groups
    acc_a = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    per = tiles // SPLIT_K
    for tau in range(pid_k * per, (pid_k + 1) * per):
        acc_a += _tile_dot(wa, sa, xd_row, xs_row, tau, n_groups, n_ok, G, EVEN, INTERPRET)
        acc_b += _tile_dot(wb, sb, xd_row, xs_row, tau, n_groups, n_ok, G, EVEN, INTERPRET)
    a = tl.sum(acc_a, axis=1)
    b = tl.sum(acc_b, axis=1)
    last = True
    if SPLIT_K > 1:  # K in SPLIT_K parts: the tile's last program sums the fp32 partials in part order
        part = part_ptr + p * SPLIT_K * 2 * I + offs_n
        tl.store(part + pid_k * 2 * I, a, mask=n_ok)
        tl.store(part + pid_k * 2 * I + I, b, mask=n_ok)
        if not INTERPRET:  # programs run one after another in the interpreter
            _fence(tl.arange(0, THREADS))
            tl.debug_barrier()
        tile = p * tl.num_programs(0) + pid_n
        last = tl.atomic_add(lock_ptr + tile, 1) == SPLIT_K - 1
        if last:
            if not INTERPRET:
                _fence(tl.arange(0, THREADS))
            a = tl.zeros([BLOCK_N], dtype=tl.float32)
            b = tl.zeros([BLOCK_N], dtype=tl.float32)
            for s in range(SPLIT_K):
                a += tl.load(part + s * 2 * I, mask=n_ok, other=0.0, cache_modifier=".cg")
                b += tl.load(part + s * 2 * I + I, mask=n_ok, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(lock_ptr + tile, 0)
    if last:
        a = tl.minimum(a, limit)
        b = tl.minimum(tl.maximum(b, -limit), limit)
        h = a / (1.0 + tl.exp(-a)) * b
        NG: tl.constexpr = BLOCK_N // 32
        q, scale = _mxfp8_quant(tl.reshape(h, (NG, 32)), floor, INTERPRET)
        gs = pid_n * NG + tl.arange(0, NG)
        _store_diag(_diag_row(hd_ptr, p, I // 32, H_G), hs_ptr + p * (I // 32), gs, gs < I // 32, q, scale, H_G)


@triton.jit
def _down_kernel(hd_ptr, hs_ptr, w_ptr, s_ptr, idx_ptr, wts_ptr, out_ptr, part_ptr, lock_ptr,
                 H, I, stride_we, stride_wn, stride_se, stride_sn,
                 BLOCK_N: tl.constexpr, K_SLOTS: tl.constexpr, G: tl.constexpr, EVEN: tl.constexpr,
                 THREADS: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:  # programmatic dependent launch: the previous kernel first
        gdc_wait()
        gdc_launch_dependents()
    pid_n = tl.program_id(0)
    j = tl.program_id(1)
    t = tl.program_id(2)
    p = t * K_SLOTS + j
    e = tl.load(idx_ptr + p).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    w_rows = w_ptr + e * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
    s_rows = s_ptr + e * stride_se + offs_n.to(tl.int64) * stride_sn
    n_groups = I // 32
    tiles = tl.cdiv(n_groups, G)
    hd_row = _diag_row(hd_ptr, p, n_groups, G)
    hs_row = hs_ptr + p * n_groups
    acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    for tau in range(0, tiles):
        acc += _tile_dot(w_rows, s_rows, hd_row, hs_row, tau, n_groups, n_ok, G, EVEN, INTERPRET)
    y = tl.sum(acc, axis=1) * tl.load(wts_ptr + p).to(tl.float32)
    out = out_ptr + t * H + offs_n
    if K_SLOTS == 1:
        tl.store(out, y.to(out_ptr.dtype.element_ty), mask=n_ok)
    else:
        part = part_ptr + t * K_SLOTS * H + offs_n
        tl.store(part + j * H, y, mask=n_ok)
        if not INTERPRET:  # programs run one after another in the interpreter
            _fence(tl.arange(0, THREADS))
            tl.debug_barrier()
        tile = t * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(lock_ptr + tile, 1)
        if arrived == K_SLOTS - 1:  # the tile's last slot: sum the slots in order
            if not INTERPRET:
                _fence(tl.arange(0, THREADS))
            total = tl.zeros([BLOCK_N], dtype=tl.float32)
            for s in range(K_SLOTS):
                total += tl.load(part + s * H, mask=n_ok, other=0.0, cache_modifier=".cg")
            tl.store(out, total.to(out_ptr.dtype.element_ty), mask=n_ok)
            tl.atomic_xchg(lock_ptr + tile, 0)


if HAS_TRITON:  # helpers shared with the other kernels
    from vllm_dsv41.ops.fp8_gemv import _fence
    from vllm_dsv41.ops.sparse_attn import _e4m3_to_f32


@functools.lru_cache(maxsize=None)
def _bind() -> None:
    """compressor's bit-exact E4M3 rounding (the interpreter's quantisation), a JIT function once its kernels are
    built."""
    from vllm_dsv41.ops import compressor

    compressor._kernels()
    globals().update(_e4m3_byte=compressor._e4m3_byte)


def plan(H: int, I: int) -> dict:
    """Launch parameters: 128 weight rows a program in both GEMMs (two 64-row MMAs of a warpgroup; whole 32-wide
    groups of h), 8 scale groups a K step (128 contiguous bytes of each row, a [128, 256] x [256, 16] MMA), the first
    GEMM's K in two where its tiles split evenly (its I / 128 tiles times the pairs then fill the GPU), 4 warps, 3
    stages of the weight stream in flight.  Figures: docs/benchmarks.md, session 26."""
    block = 128 if H % 128 == 0 and I % 128 == 0 else 64 if I % 64 == 0 else 32
    split = 2 if diag_tiles(H // 32, 8) % 2 == 0 else 1
    return dict(UP_BLOCK_N=block, DOWN_BLOCK_N=block, UP_SPLIT_K=split, UP_G=8, DOWN_G=8, num_warps=4, num_stages=3)


def diag_tiles(groups: int, g: int) -> int:
    """K steps over ``groups`` scale groups, g a step (the last one ragged when g does not divide them)."""
    return -(-groups // g)


def diag_row_bytes(groups: int, g: int) -> int:
    """Bytes of one row's diagonal layout (:func:`_store_diag`): its groups padded to whole tiles of g, 512 a group."""
    return diag_tiles(groups, g) * 512 * g


_DIAG: dict[tuple, torch.Tensor] = {}


def _diag(device: torch.device, name: str, rows: int, groups: int, g: int, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed [rows, diag_row_bytes(groups, g)] diagonal-layout buffer of ``device``, kept between launches: the
    kernels write only the diagonal's bytes, so the zeros around them stay.  One per device and use, not per stream
    (a buffer made inside a graph capture would be the graph's): two launches on two streams at once would share it;
    the model runs the routed experts on its main stream only and reserves the buffers at load (:func:`reserve`)."""
    key = (device.type, device.index, name, groups, g, dtype)
    buf = _DIAG.get(key)
    if buf is None or buf.shape[0] < rows:
        buf = torch.zeros(max(rows, 1), diag_row_bytes(groups, g), dtype=dtype, device=device)
        _DIAG[key] = buf
    return buf[:rows]


def reserve(device: torch.device, H: int, I: int, k: int, rows: int = MAX_TOKENS, streams: tuple = ()) -> None:
    """Allocate the split counters (``fp8_gemv``'s, of ``device``'s current stream and of ``streams``) and the diagonal
    buffers for up to ``rows`` tokens now (the model calls this at load, so that no graph capture allocates them)."""
    if device.type != "cuda":
        return
    p = plan(H, I)
    fp8_gemv.reserve(device, streams)
    _diag(device, "x", rows, H // 32, p["UP_G"], torch.float8_e4m3fn)
    _diag(device, "h", rows * k, I // 32, p["DOWN_G"], torch.float8_e4m3fn)


def _moe_gemv_triton(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
                     idx: torch.Tensor, wts: torch.Tensor, limit: float, config: dict | None = None) -> torch.Tensor:
    T, H, E, I, k = _check(x, w13, s13, w2, s2, idx, wts)
    if T > MAX_TOKENS or x.dtype != torch.bfloat16:
        return moe_gemv_ref(x, w13, s13, w2, s2, idx, wts, limit)
    out = torch.empty(T, H, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    _bind()
    interp = interpreting()
    p = {**plan(H, I), **(config or {})}
    ug, dg, bn, split = p["UP_G"], p["DOWN_G"], p["UP_BLOCK_N"], p["UP_SPLIT_K"]
    up_tiles = diag_tiles(H // 32, ug)
    if not (1 <= ug <= 16 and 1 <= dg <= 16) or up_tiles % split or bn % 32 or p["DOWN_BLOCK_N"] % 32:
        raise ValueError(f"moe_gemv: config {p}: UP_G and DOWN_G must lie in 1..16, UP_SPLIT_K divide the "
                         f"{up_tiles} K tiles of x, the BLOCK_Ns be multiples of 32")
    dev = x.device
    code = torch.uint8 if interp else torch.float8_e4m3fn
    xd = _diag(dev, "x", T, H // 32, ug, code)
    xs = torch.empty(T, H // 32, dtype=torch.float32, device=dev)
    hd = _diag(dev, "h", T * k, I // 32, dg, code)
    hs = torch.empty(T * k, I // 32, dtype=torch.float32, device=dev)
    w13, s13, w2, s2 = (t.contiguous().view(torch.uint8) for t in (w13, s13, w2, s2))
    ids = idx.reshape(-1).to(torch.int32).contiguous()
    floor = formats.MXFP8_AMAX_FLOOR
    x = x.contiguous()
    warps, stages = p["num_warps"], p["num_stages"]
    on = pdl(x)
    _mxfp8_rows_kernel[(T, -(-(H // 32) // 8))](x, xd, xs, H, x.stride(0), floor, BLOCK_G=8, G=ug, INTERPRET=interp,
                                                num_warps=1, **pdl_launch(on))
    tiles = -(-I // bn)
    part = torch.empty(T * k, split, 2, I, dtype=torch.float32, device=dev) if split > 1 else xs
    locks = fp8_gemv._locks(dev, T * k * tiles) if split > 1 else xs
    _up_kernel[(tiles, split, T * k)](xd, xs, w13, s13, ids, hd, hs, part, locks, H, I, k, w13.stride(0),
                                      w13.stride(1), s13.stride(0), s13.stride(1), limit, floor, BLOCK_N=bn,
                                      SPLIT_K=split, G=ug, H_G=dg, EVEN=(H // 32) % ug == 0, THREADS=32 * warps,
                                      INTERPRET=interp, num_warps=warps, num_stages=stages, **pdl_launch(on))
    bn = p["DOWN_BLOCK_N"]
    tiles = -(-H // bn)
    part = torch.empty(T, k, H, dtype=torch.float32, device=dev) if k > 1 else out
    locks = fp8_gemv._locks(dev, T * tiles) if k > 1 else out
    _down_kernel[(tiles, k, T)](hd, hs, w2, s2, ids, wts.reshape(-1).float().contiguous(), out, part, locks, H, I,
                                w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), BLOCK_N=bn, K_SLOTS=k, G=dg,
                                EVEN=(I // 32) % dg == 0, THREADS=32 * warps, INTERPRET=interp, num_warps=warps,
                                num_stages=stages, **pdl_launch(on))
    return out


moe_gemv = define_op(
    "moe_gemv",
    "(Tensor x, Tensor w13, Tensor s13, Tensor w2, Tensor s2, Tensor idx, Tensor wts, float limit) -> Tensor",
    moe_gemv_ref,
    _moe_gemv_triton if HAS_TRITON else None,
    lambda x, w13, s13, w2, s2, idx, wts, limit: torch.empty_like(x),
)
