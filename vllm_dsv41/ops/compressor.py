"""``torch.ops.dsv41.compress_insert``: fused compressor pooling + NVFP4 / MXFP4 cache writes.

Specification: architecture.md §2.5.4 (compressor), §4.1 (records) and §7.1 (the vLLM kernels
``fused_save_compress_norm``, ``rope_quant_insert`` and ``indexer_k_norm_rope_store`` that this one
op replaces); the oracle is ``reference.model.Transformer._compress``.

For every token t whose position p closes a compression group ((p + 1) % r == 0, r = ratio):

* pooled = kv_c[t]                                     (ratio 1)
  pooled[d] = sum_{i in {p-1, p}} kv_c[i, d] * softmax_i(score_c[., d])[i]   (ratio 2; row p-1 is
  ``prev[t]``, already resolved by the caller from the same step or from the compressor ring)
* z = RMSNorm_{norm_weight}(pooled); z_rot = RoPE(z) at position (p // r) * r on the last R dims
  (GPT-J pairs) -> NVFP4 record (D/2 packed E2M1 + D/16 E4M3 scales) -> ``comp_cache[comp_slots[t]]``
* k = RMSNorm_{k_norm_weight}(wk @ z) (the *un-rotated* z), RoPE at the same position ->
  MXFP4 record (ID/2 packed E2M1 + ID/32 UE8M0 scales) -> ``idx_cache[idx_slots[t]]``

A slot of -1 means "no write" (non-closing token, replayed token, padding); the two caches are
addressed independently.  Shapes: kv_score fp32 [T, r*D] (= [kv_c | score_c] for ratio 2, kv_c for
ratio 1), prev fp32 [T, 2D] or None (ratio 1), positions int64 [T], norm_weight [D], wk [ID, D]
(bf16/fp32), k_norm_weight [ID], inv_freq fp32 [R/2], comp_slots / idx_slots int64 [T],
comp_cache uint8 [slots, D/2 + D/16], idx_cache uint8 [slots, ID/2 + ID/32] (both written in place).

Why one op: pooling, both norms, the small wk projection, two RoPEs, two quantisations and two
paged writes are ~10 tiny kernels per KV-source layer and step in plain PyTorch; one launch keeps
decode latency down and makes the write a single graph node with declared mutations.

Numerics of the Triton kernel.  Everything is fp32.  The record encoders follow
``formats.py``'s rounding rules bit for bit: amax/6 and x/scale are correctly rounded divisions
(``div_rn``), the E4M3 scale is rounded to nearest-even with integer arithmetic on the float32 bit
pattern, the UE8M0 exponent is the exact bit-pattern ceiling, E2M1 ties go to the even code and the
sign comes from the IEEE sign bit; so for the same float input the bytes equal
``formats.encode_nvfp4_record`` / ``encode_mxfp4_record`` exactly (tested on adversarial inputs
through ``_encode_records_triton``).  The floats themselves (softmax, RMS, matvec, cos/sin) differ
from the PyTorch reference by a few ulps, which moves a value across an E2M1 decision point only
rarely.  RoPE angles p * f are formed exactly (hi + lo via fma) and reduced modulo 2*pi with a
three-part constant, so positions up to 2^24 keep an absolute angle error of a few 1e-7 (a plain
fp32 product p * f is off by up to 0.03 rad at p = 1e6; the reference works in float64).
"""

from __future__ import annotations

import functools

import torch

from vllm_dsv41 import formats
from vllm_dsv41.ops import define_op, env_rows
from vllm_dsv41.ops._triton import ROW_COUNT_ARGS, gdc_launch_dependents, gdc_wait, pdl, pdl_launch
from vllm_dsv41.reference.model import apply_rope, rms_norm

__all__ = ["compress_insert", "compress_insert_ref"]


# --------------------------------------------------------------------------- reference (CPU + oracle)


def compress_insert_ref(kv_score: torch.Tensor, prev: torch.Tensor | None, positions: torch.Tensor, ratio: int,
                        norm_weight: torch.Tensor, wk: torch.Tensor, k_norm_weight: torch.Tensor, eps: float,
                        inv_freq: torch.Tensor, comp_slots: torch.Tensor, idx_slots: torch.Tensor,
                        comp_cache: torch.Tensor, idx_cache: torch.Tensor) -> None:
    """Plain-PyTorch compress + quantise + paged write (fp32, the math of ``Transformer._compress``)."""
    _check_args(kv_score, prev, ratio, norm_weight, wk, k_norm_weight, inv_freq, comp_cache, idx_cache)
    D = norm_weight.numel()
    pos = positions.to(torch.int64)
    cs, ks = comp_slots.to(torch.int64), idx_slots.to(torch.int64)
    closing = (pos + 1) % ratio == 0
    rows = (closing & ((cs >= 0) | (ks >= 0))).nonzero().flatten()
    if rows.numel() == 0:
        return
    cur = kv_score[rows].float()
    if ratio == 2:
        pair = torch.stack((prev[rows].float(), cur), 1)  # [J, 2, 2D]: positions p-1, p
        pooled = (pair[..., :D] * torch.softmax(pair[..., D:], dim=1)).sum(1)
    else:
        pooled = cur[:, :D]
    z = rms_norm(pooled, norm_weight.float(), eps)
    ent_pos = (pos[rows] // ratio) * ratio
    z_rot = apply_rope(z, ent_pos, inv_freq.float())
    k = rms_norm(z @ wk.float().t(), k_norm_weight.float(), eps)
    k = apply_rope(k, ent_pos, inv_freq.float())
    wc, wi = cs[rows] >= 0, ks[rows] >= 0
    comp_cache[cs[rows][wc]] = formats.encode_nvfp4_record(z_rot[wc])
    idx_cache[ks[rows][wi]] = formats.encode_mxfp4_record(k[wi])


def _check_args(kv_score, prev, ratio, norm_weight, wk, k_norm_weight, inv_freq, comp_cache, idx_cache) -> None:
    D, ID, R = norm_weight.numel(), k_norm_weight.numel(), 2 * inv_freq.numel()
    if ratio not in (1, 2):
        raise ValueError(f"compress_insert: ratio must be 1 or 2, got {ratio}")
    if kv_score.dim() != 2 or kv_score.shape[1] != ratio * D:
        raise ValueError(f"compress_insert: kv_score must be [T, {ratio * D}], got {tuple(kv_score.shape)}")
    if ratio == 2 and (prev is None or tuple(prev.shape) != tuple(kv_score.shape)):
        raise ValueError("compress_insert: ratio 2 needs prev rows shaped like kv_score")
    if tuple(wk.shape) != (ID, D):
        raise ValueError(f"compress_insert: wk must be [{ID}, {D}], got {tuple(wk.shape)}")
    if R > min(D, ID) or R % 2:
        raise ValueError(f"compress_insert: rotary width {R} does not fit D={D}, ID={ID}")
    if tuple(comp_cache.shape[1:]) != (formats.nvfp4_record_bytes(D),) or comp_cache.dtype != torch.uint8:
        raise ValueError(f"compress_insert: comp_cache must be uint8 [slots, {formats.nvfp4_record_bytes(D)}]")
    if tuple(idx_cache.shape[1:]) != (formats.mxfp4_record_bytes(ID),) or idx_cache.dtype != torch.uint8:
        raise ValueError(f"compress_insert: idx_cache must be uint8 [slots, {formats.mxfp4_record_bytes(ID)}]")


# --------------------------------------------------------------------------- Triton kernels


# Kernels are written as plain functions and wrapped with ``triton.jit`` by ``_kernels()`` on first
# use, so this module imports without Triton; ``tl`` is bound at that moment.
tl = None


def _e2m1_codes(y):
    # fp32 values already divided by their scale -> int32 E2M1 codes 0..15.
    # Magnitude = number of decision points passed; '>=' where the upper neighbour has the
    # even mantissa bit (exact ties round to the even code), '>' otherwise; saturates at 6.
    a = tl.abs(y)
    m = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
    m += (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
    m += (a > 5.0).to(tl.int32)
    neg = (y.to(tl.int32, bitcast=True) < 0) & (y == y)  # IEEE sign bit; NaN -> +0
    return m | (neg.to(tl.int32) << 3)


def _e4m3_round(v):
    # v fp32 in [2^-9, 448] -> (the E4M3 value as fp32, its byte), round to nearest even.
    # Normal range (v >= 2^-6): keep 3 mantissa bits of the float32 pattern; the carry of a
    # round-up propagates into the exponent.  Bytes: biased exponent 7 vs 127 -> minus 120 << 3.
    bits = v.to(tl.int32, bitcast=True)
    rb = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # -1048576 = 0xFFF00000
    v_norm = rb.to(tl.float32, bitcast=True)
    b_norm = (rb >> 20) - 960
    # Subnormal range: multiples of 2^-9; q = v * 512 is exact, round it to an even integer
    # on ties (q = 8 is the byte of 2^-6, so the two ranges meet seamlessly).
    q = v * 512.0
    qf = tl.floor(q)
    frac = q - qf
    qi = qf.to(tl.int32)
    qi += ((frac > 0.5) | ((frac == 0.5) & ((qi & 1) == 1))).to(tl.int32)
    normal = v >= 0.015625
    return tl.where(normal, v_norm, qi.to(tl.float32) * 0.001953125), tl.where(normal, b_norm, qi)


def _e4m3_byte(v):
    # fp32 v -> its E4M3 byte: |v| saturated at 448, rounded to nearest even, the sign from the IEEE bit (-0.0 -> 0x80)
    _, mag = _e4m3_round(tl.minimum(tl.abs(v), 448.0))
    return mag | ((v.to(tl.int32, bitcast=True) < 0).to(tl.int32) << 7)


def _fp8_token_scale(amax, floor):
    # formats.quant_fp8_tokens' per-row scale: max(amax / 448, floor), the division correctly rounded
    return tl.maximum(tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)), floor)


def _nvfp4_pack(a, b):
    # a, b: fp32 [BT, G, 8] = dims 16g + 2j and 16g + 2j + 1 of each row.
    # -> (packed bytes [BT, G, 8] int32, E4M3 scale bytes [BT, G] int32)
    amax = tl.max(tl.maximum(tl.abs(a), tl.abs(b)), axis=2)
    r = tl.math.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32))
    r = tl.minimum(tl.maximum(r, 0.001953125), 448.0)  # clamp(amax/6, 2^-9, 448)
    s_val, s_byte = _e4m3_round(r)
    s3 = tl.broadcast_to(s_val[:, :, None], a.shape)
    ca = _e2m1_codes(tl.math.div_rn(a, s3))
    cb = _e2m1_codes(tl.math.div_rn(b, s3))
    return ca | (cb << 4), s_byte


def _mxfp4_pack(a, b):
    # a, b: fp32 [BT, G, 16] = dims 32g + 2j and 32g + 2j + 1.
    # -> (packed bytes [BT, G, 16] int32, UE8M0 bytes [BT, G] int32)
    amax = tl.max(tl.maximum(tl.abs(a), tl.abs(b)), axis=2)
    r = tl.math.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32))
    r = tl.maximum(r, 1.1754943508222875e-38)  # floor 2^-126
    bits = r.to(tl.int32, bitcast=True)
    field = (bits >> 23) & 255
    e = field - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)  # exact ceil(log2 r)
    byte = tl.minimum(tl.maximum(e + 127, 0), 254)
    byte = tl.where(field == 255, 255, byte)
    s3 = tl.broadcast_to((byte << 23).to(tl.float32, bitcast=True)[:, :, None], a.shape)
    ca = _e2m1_codes(tl.math.div_rn(a, s3))
    cb = _e2m1_codes(tl.math.div_rn(b, s3))
    return ca | (cb << 4), byte


def _cos_sin(p, f):
    # cos / sin of p * f (p: exact integer positions as fp32, f: fp32 inverse frequency).
    # hi + lo is the exact product; hi is reduced by 2*pi = A + B + C (Cody-Waite with fma).
    hi = p * f
    lo = tl.fma(p, f, -hi)
    k = tl.floor(hi * 0.15915493667125702 + 0.5)
    r = tl.fma(-k, 6.2831854820251465, hi)
    r = tl.fma(-k, -1.7484555314695172e-07, r)
    r = tl.fma(-k, -6.8604980400235275e-15, r)
    r = r + lo
    return tl.cos(r), tl.sin(r)


def _rope_pairs(a, b, pair, ent, freq_ptr, P0: tl.constexpr):
    # GPT-J rotation of pairs (a, b) [BT, G, n] whose global pair index is pair [G, n];
    # pairs below P0 (the NoPE part) pass through unchanged.
    fi = pair - P0
    rot = fi >= 0
    f = tl.load(freq_ptr + tl.where(rot, fi, 0), mask=rot, other=0.0)
    c, s = _cos_sin(ent[:, None, None], f[None, :, :])
    rot3 = rot[None, :, :]
    return tl.where(rot3, a * c - b * s, a), tl.where(rot3, a * s + b * c, b)


def _pooled_chunk(kv_ptr, prev_ptr, rows, live, dd, stride_kv, stride_prev,
                  RATIO: tl.constexpr, D: tl.constexpr):
    # fp32 [BT, BD]: pooled compressor input of channels dd for the rows (0 where not live).
    m = live[:, None]
    cur = kv_ptr + rows[:, None] * stride_kv + dd[None, :]
    x = tl.load(cur, mask=m, other=0.0).to(tl.float32)
    if RATIO == 2:
        s1 = tl.load(cur + D, mask=m, other=0.0).to(tl.float32)
        old = prev_ptr + rows[:, None] * stride_prev + dd[None, :]
        x0 = tl.load(old, mask=m, other=0.0).to(tl.float32)
        s0 = tl.load(old + D, mask=m, other=0.0).to(tl.float32)
        mx = tl.maximum(s0, s1)
        e0 = tl.exp(s0 - mx)
        e1 = tl.exp(s1 - mx)
        den = e0 + e1
        x = x0 * tl.math.div_rn(e0, den) + x * tl.math.div_rn(e1, den)
    return x


def _latent_chunk(acc, d0, kv_ptr, prev_ptr, rows, live, wc, cslot, rstd, ent, norm_ptr, wk_ptr, freq_ptr,
                  ccache_ptr, zdbg_ptr, stride_kv, stride_prev, stride_wk_o, stride_wk_i, stride_cc,
                  RATIO: tl.constexpr, D: tl.constexpr, ID: tl.constexpr, R: tl.constexpr,
                  BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, ROPE: tl.constexpr, STORE_FLOATS: tl.constexpr):
    # Channels d0 .. d0+BLOCK_D of z = RMSNorm(pooled): add z @ wk^T to acc [BLOCK_T, ID], rotate
    # (ROPE: the chunk holds rotary dims) and write those channels' NVFP4 bytes and scales.
    dd = d0 + tl.arange(0, BLOCK_D)
    x = _pooled_chunk(kv_ptr, prev_ptr, rows, live, dd, stride_kv, stride_prev, RATIO, D)
    z = x * rstd[:, None] * tl.load(norm_ptr + dd).to(tl.float32)[None, :]
    kk = tl.arange(0, ID)
    if BLOCK_T >= 16:
        wkt = tl.load(wk_ptr + kk[None, :] * stride_wk_o + dd[:, None] * stride_wk_i).to(tl.float32)  # [BD, ID]
        acc = tl.dot(z, wkt, acc, input_precision="ieee")
    else:  # too few rows for an MMA tile: products and a sum along the channels (exact products, fp32 sums in
        # another order)
        wk = tl.load(wk_ptr + kk[:, None] * stride_wk_o + dd[None, :] * stride_wk_i).to(tl.float32)  # [ID, BD]
        acc += tl.sum(z[:, None, :] * wk[None, :, :], axis=2)
    a, b = tl.split(tl.reshape(z, [BLOCK_T, BLOCK_D // 16, 8, 2]))
    gi = tl.arange(0, BLOCK_D // 16)
    pair = d0 // 2 + gi[:, None] * 8 + tl.arange(0, 8)[None, :]  # [G, 8] global pair index
    if ROPE:
        a, b = _rope_pairs(a, b, pair, ent, freq_ptr, (D - R) // 2)
    codes, s_byte = _nvfp4_pack(a, b)
    crow = cslot * stride_cc
    tl.store(ccache_ptr + crow[:, None, None] + pair[None, :, :], codes.to(tl.uint8), mask=wc[:, None, None])
    tl.store(ccache_ptr + crow[:, None] + (D // 2 + d0 // 16) + gi[None, :], s_byte.to(tl.uint8), mask=wc[:, None])
    if STORE_FLOATS:
        zrow = zdbg_ptr + rows[:, None, None] * D + 2 * pair[None, :, :]
        tl.store(zrow, a, mask=live[:, None, None])
        tl.store(zrow + 1, b, mask=live[:, None, None])
    return acc


def _compress_insert_kernel(
    kv_ptr,      # [T, RATIO*D] fp32 compressor rows ([kv | score] for ratio 2)
    prev_ptr,    # [T, 2D] fp32 partner rows (position p-1); unused for ratio 1
    pos_ptr,     # [T] int64 positions
    cslot_ptr,   # [T] int64 compressed-cache slot, -1 = no write
    islot_ptr,   # [T] int64 index-cache slot, -1 = no write
    norm_ptr,    # [D] compressor norm weight
    wk_ptr,      # [ID, D] indexer wk (bf16 / fp32)
    knorm_ptr,   # [ID] indexer k_norm weight
    freq_ptr,    # [R/2] fp32 inverse frequencies
    ccache_ptr,  # uint8 [slots, D/2 + D/16]
    icache_ptr,  # uint8 [slots, ID/2 + ID/32]
    zdbg_ptr,    # fp32 [T, D] rotated latents (STORE_FLOATS only)
    kdbg_ptr,    # fp32 [T, ID] rotated index keys (STORE_FLOATS only)
    T, eps,
    stride_kv, stride_prev, stride_wk_o, stride_wk_i, stride_cc, stride_ic,
    RATIO: tl.constexpr, D: tl.constexpr, ID: tl.constexpr, R: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, STORE_FLOATS: tl.constexpr, PDL: tl.constexpr = False,
):
    if PDL:  # programmatic dependent launch: the previous kernel first
        gdc_wait()
        gdc_launch_dependents()
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_range = rows < T
    pos = tl.load(pos_ptr + rows, mask=in_range, other=0).to(tl.int64)
    cslot = tl.load(cslot_ptr + rows, mask=in_range, other=-1).to(tl.int64)
    islot = tl.load(islot_ptr + rows, mask=in_range, other=-1).to(tl.int64)
    closing = in_range & ((pos + 1) % RATIO == 0)
    wc = closing & (cslot >= 0)
    wi = closing & (islot >= 0)
    live = wc | wi
    if tl.max(live.to(tl.int32), axis=0) > 0:
        rows64 = rows.to(tl.int64)
        # pass 1: mean square of the pooled row
        ssq = tl.zeros([BLOCK_T], tl.float32)
        for d0 in range(0, D, BLOCK_D):
            x = _pooled_chunk(kv_ptr, prev_ptr, rows64, live, d0 + tl.arange(0, BLOCK_D),
                              stride_kv, stride_prev, RATIO, D)
            ssq += tl.sum(x * x, axis=1)
        ms = tl.math.div_rn(ssq, tl.full([BLOCK_T], D, tl.float32))
        rstd = tl.math.div_rn(tl.full([BLOCK_T], 1.0, tl.float32), tl.math.sqrt_rn(ms + eps))
        ent = ((pos // RATIO) * RATIO).to(tl.float32)  # entry position (group's first token)
        acc = tl.zeros([BLOCK_T, ID], tl.float32)
        # pass 2: z chunk -> wk projection accumulator and NVFP4 record bytes; a runtime loop over the
        # NoPE chunks, the chunks that hold rotary dims unrolled with the RoPE compiled in
        for d0 in range(0, ((D - R) // BLOCK_D) * BLOCK_D, BLOCK_D):
            acc = _latent_chunk(acc, d0, kv_ptr, prev_ptr, rows64, live, wc, cslot, rstd, ent, norm_ptr, wk_ptr,
                                freq_ptr, ccache_ptr, zdbg_ptr, stride_kv, stride_prev, stride_wk_o, stride_wk_i,
                                stride_cc, RATIO, D, ID, R, BLOCK_T, BLOCK_D, False, STORE_FLOATS)
        for d0 in tl.static_range(((D - R) // BLOCK_D) * BLOCK_D, D, BLOCK_D):
            acc = _latent_chunk(acc, d0, kv_ptr, prev_ptr, rows64, live, wc, cslot, rstd, ent, norm_ptr, wk_ptr,
                                freq_ptr, ccache_ptr, zdbg_ptr, stride_kv, stride_prev, stride_wk_o, stride_wk_i,
                                stride_cc, RATIO, D, ID, R, BLOCK_T, BLOCK_D, True, STORE_FLOATS)
        kk = tl.arange(0, ID)
        # index key: RMSNorm, RoPE, MXFP4
        kms = tl.math.div_rn(tl.sum(acc * acc, axis=1), tl.full([BLOCK_T], ID, tl.float32))
        krs = tl.math.div_rn(tl.full([BLOCK_T], 1.0, tl.float32), tl.math.sqrt_rn(kms + eps))
        k = acc * krs[:, None] * tl.load(knorm_ptr + kk).to(tl.float32)[None, :]
        ka, kb = tl.split(tl.reshape(k, [BLOCK_T, ID // 32, 16, 2]))
        kpair = tl.arange(0, ID // 32)[:, None] * 16 + tl.arange(0, 16)[None, :]  # [G, 16]
        ka, kb = _rope_pairs(ka, kb, kpair, ent, freq_ptr, (ID - R) // 2)
        kcodes, k_byte = _mxfp4_pack(ka, kb)
        irow = islot * stride_ic
        tl.store(icache_ptr + irow[:, None, None] + kpair[None, :, :], kcodes.to(tl.uint8),
                 mask=wi[:, None, None])
        tl.store(icache_ptr + irow[:, None] + ID // 2 + tl.arange(0, ID // 32)[None, :], k_byte.to(tl.uint8),
                 mask=wi[:, None])
        if STORE_FLOATS:
            krow = kdbg_ptr + rows64[:, None, None] * ID + 2 * kpair[None, :, :]
            tl.store(krow, ka, mask=live[:, None, None])
            tl.store(krow + 1, kb, mask=live[:, None, None])


def _encode_records_kernel(
    x_ptr,    # [N, W] fp32 rows
    out_ptr,  # uint8 [N, W/2 + W/GS]
    N, stride_x, stride_o,
    W: tl.constexpr, NVFP4: tl.constexpr, GS: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr = False,
):
    # The record encoders alone (the same helpers as the fused kernel), for exactness tests.
    if PDL:  # programmatic dependent launch: the previous kernel first
        gdc_wait()
        gdc_launch_dependents()
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = rows < N
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_x + tl.arange(0, W)[None, :], mask=m[:, None], other=0.0)
    a, b = tl.split(tl.reshape(x.to(tl.float32), [BLOCK_N, W // GS, GS // 2, 2]))
    if NVFP4:
        codes, s_byte = _nvfp4_pack(a, b)
    else:
        codes, s_byte = _mxfp4_pack(a, b)
    pair = tl.arange(0, W // GS)[:, None] * (GS // 2) + tl.arange(0, GS // 2)[None, :]
    orow = rows64 * stride_o
    tl.store(out_ptr + orow[:, None, None] + pair[None, :, :], codes.to(tl.uint8), mask=m[:, None, None])
    tl.store(out_ptr + orow[:, None] + W // 2 + tl.arange(0, W // GS)[None, :], s_byte.to(tl.uint8),
             mask=m[:, None])


_NOT_SPECIALISED = {"_compress_insert_kernel": ROW_COUNT_ARGS, "_encode_records_kernel": ("N",)}
"""Per kernel, the integer arguments Triton should not specialise on: the row count, a bound only
(``_triton.ROW_COUNT_ARGS``)."""
_JIT_FUNCTIONS = ("_e2m1_codes", "_e4m3_round", "_e4m3_byte", "_fp8_token_scale", "_nvfp4_pack", "_mxfp4_pack", "_cos_sin", "_rope_pairs",
                  "_pooled_chunk", "_latent_chunk", "_compress_insert_kernel", "_encode_records_kernel")


@functools.lru_cache(maxsize=None)
def _kernels():
    """Import Triton and turn the kernel functions above into JIT functions (once per process)."""
    import triton
    import triton.language

    module = globals()
    module["tl"] = triton.language
    for name in _JIT_FUNCTIONS:
        module[name] = triton.jit(module[name], do_not_specialize=_NOT_SPECIALISED.get(name))
    return module["_compress_insert_kernel"], module["_encode_records_kernel"]


_BLOCK_T = 16  # tokens per program on the tl.dot route (tl.dot needs >= 16 rows)
SMALL_BLOCK_T = 2
"""Tokens per program up to :data:`SMALL_ROWS` rows: the wk projection as products and a sum instead of ``tl.dot``,
so a decode step's rows spread over many programs (batch 64: 32 instead of 4; each program's chain of chunks is as
long either way, so fewer rows per program is what shortens the launch)."""
SMALL_ROWS_ENV = "VLLM_DSV41_COMPRESS_SMALL_ROWS"
SMALL_ROWS = 256


def block_rows(T: int) -> int:
    """Tokens per program for a launch over ``T`` rows: :data:`SMALL_BLOCK_T` up to ``VLLM_DSV41_COMPRESS_SMALL_ROWS``
    rows (default :data:`SMALL_ROWS`; 0: always the tl.dot route, the earlier launch, for comparison)."""
    return SMALL_BLOCK_T if T <= env_rows(SMALL_ROWS_ENV, SMALL_ROWS) else _BLOCK_T


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _compress_insert_triton(kv_score: torch.Tensor, prev: torch.Tensor | None, positions: torch.Tensor, ratio: int,
                            norm_weight: torch.Tensor, wk: torch.Tensor, k_norm_weight: torch.Tensor, eps: float,
                            inv_freq: torch.Tensor, comp_slots: torch.Tensor, idx_slots: torch.Tensor,
                            comp_cache: torch.Tensor, idx_cache: torch.Tensor, *,
                            float_out: tuple[torch.Tensor, torch.Tensor] | None = None, block_d: int = 64,
                            num_warps: int = 8, block_t: int | None = None) -> None:
    """Launch the fused kernel.  ``float_out = (z_rot [T, D], k [T, ID])`` fp32 receives the rotated
    floats the kernel quantised (rows it wrote), so tests can check the encode step byte for byte.
    ``block_d``: latent channels per step (a multiple of 16); ``block_t``: tokens per program (a power of two;
    default :func:`block_rows`)."""
    _check_args(kv_score, prev, ratio, norm_weight, wk, k_norm_weight, inv_freq, comp_cache, idx_cache)
    D, ID, R = norm_weight.numel(), k_norm_weight.numel(), 2 * inv_freq.numel()
    if not (_pow2(D) and D >= 16 and _pow2(ID) and ID >= 32):
        raise ValueError(f"compress_insert (Triton): D={D} and ID={ID} must be powers of two (>= 16, >= 32)")
    if kv_score.stride(1) != 1 or (prev is not None and prev.stride(1) != 1):
        raise ValueError("compress_insert (Triton): rows of kv_score / prev must be contiguous")
    if comp_cache.stride(1) != 1 or idx_cache.stride(1) != 1:
        raise ValueError("compress_insert (Triton): cache records must be contiguous")
    T = kv_score.shape[0]
    if T == 0:
        return
    kernel, _ = _kernels()
    if prev is None:
        prev = kv_score  # never read for ratio 1
    zdbg, kdbg = float_out if float_out is not None else (kv_score, kv_score)
    block_d = min(block_d, D)
    block_t = block_t or block_rows(T)
    if not _pow2(block_t):
        raise ValueError(f"compress_insert (Triton): block_t={block_t} must be a power of two")
    grid = ((T + block_t - 1) // block_t,)
    kernel[grid](
        kv_score, prev, positions.contiguous(), comp_slots.contiguous(), idx_slots.contiguous(),
        norm_weight.contiguous(), wk, k_norm_weight.contiguous(), inv_freq.float().contiguous(),
        comp_cache, idx_cache, zdbg, kdbg,
        T, float(eps),
        kv_score.stride(0), prev.stride(0), wk.stride(0), wk.stride(1), comp_cache.stride(0), idx_cache.stride(0),
        RATIO=ratio, D=D, ID=ID, R=R, BLOCK_T=block_t, BLOCK_D=block_d, STORE_FLOATS=float_out is not None,
        num_warps=num_warps,
        **pdl_launch(pdl(kv_score)),
    )


def _encode_records_triton(x: torch.Tensor, kind: str) -> torch.Tensor:
    """Triton twin of ``formats.encode_nvfp4_record`` / ``encode_mxfp4_record`` for rows [N, W]."""
    W = x.shape[-1]
    nv = kind == "nvfp4"
    rec = formats.nvfp4_record_bytes(W) if nv else formats.mxfp4_record_bytes(W)
    x2 = x.reshape(-1, W).float().contiguous()
    out = torch.empty(x2.shape[0], rec, dtype=torch.uint8, device=x.device)
    if x2.shape[0]:
        _, kernel = _kernels()
        block = 16
        kernel[((x2.shape[0] + block - 1) // block,)](x2, out, x2.shape[0], x2.stride(0), out.stride(0),
                                                      W=W, NVFP4=nv, GS=16 if nv else 32, BLOCK_N=block,
                                                      **pdl_launch(pdl(x2)))
    return out.reshape(*x.shape[:-1], rec)


# --------------------------------------------------------------------------- registration


def _compress_insert_fake(kv_score, prev, positions, ratio, norm_weight, wk, k_norm_weight, eps, inv_freq,
                          comp_slots, idx_slots, comp_cache, idx_cache) -> None:
    return None


compress_insert = define_op(
    "compress_insert",
    "(Tensor kv_score, Tensor? prev, Tensor positions, int ratio, Tensor norm_weight, Tensor wk, "
    "Tensor k_norm_weight, float eps, Tensor inv_freq, Tensor comp_slots, Tensor idx_slots, "
    "Tensor(a!) comp_cache, Tensor(b!) idx_cache) -> ()",
    compress_insert_ref,
    _compress_insert_triton,
    _compress_insert_fake,
)
