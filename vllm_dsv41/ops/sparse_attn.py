"""``torch.ops.dsv41.sparse_attn``: CSA2 sparse attention over the compact KV records.

Maths (architecture.md §2.5.6-2.5.7, §7.3).  For query row t (position p_t) and head h, the keys
are the union of

* the sliding-window entries listed in ``swa_slots[t]`` (MXFP8 records of the layer's SWA cache) and
* the selected compressed entries listed in ``comp_slots[t]`` (NVFP4 records of the KV source),

slot −1 meaning "no key".  Keys and values are the same 512-d latent (MQA over one shared vector):

    logit_n = (q[t,h] · k_n) · scale
    out[t,h] = Σ_n exp(logit_n) k_n / (Σ_n exp(logit_n) + exp(sink[h]))
    out[t,h, D-R:] = RoPE^-1(out[t,h, D-R:], p_t)   (GPT-J pairs, angle −p_t·inv_freq)

The inverse RoPE belongs here because V carries the keys' rotations (§2.5.7).

Shapes: q [T, Hq, D] bf16/fp32 (RoPE applied); swa_cache uint8 [S1, D + D/32]; swa_slots int32 or int64
[T, W]; comp_cache uint8 [S2, D/2 + D/16] and comp_slots int32 or int64 [T, K] (both optional: SWA-only
layers); sink fp32 [Hq]; positions int64 [T]; inv_freq fp32 [R/2] -> out [T, Hq, D] in q's dtype.
Production: D = 512, Hq = 64 (per TP rank Hq/TP), R = 64, W = 128, K = 512.  The slots within one
row's list must be distinct (the reference takes the union, the kernel sums every listed entry).

Why an op: it is the step's hottest kernel and needs the cache records read in place (no bf16
workspace), one name for the CPU reference and the CUDA kernel, and a graph-opaque call.

Record codecs: :mod:`vllm_dsv41.formats` (``decode_mxfp8_record``, ``decode_nvfp4_record``).
The oracle maths: ``reference.model.sparse_attention`` and ``apply_rope(..., inverse=True)``.

GPU kernel (``_sparse_attn_kernel``)
------------------------------------
One program per (query row, key split, head group).  Every head of the group shares the row's
keys, so a key tile is fetched and dequantised once and multiplied against all BLOCK_H heads
(tensor-core dots, fp32 accumulation, flash-style online softmax in base 2, the sink as the
initial running maximum so no ``-inf - -inf`` can appear).  The D dims are carried as two halves,
even and odd elements (``k[:, 0::2]``, ``k[:, 1::2]``): q·k = q_e·k_e + q_o·k_o, and the output's
RoPE pairs (2i, 2i+1) then sit at the same index of the two accumulators, so the inverse RoPE is
elementwise.  The split also matches the records: an NVFP4 byte holds elements (2i, 2i+1) in its
two nibbles, and the MXFP8 bytes are read as 16-bit words (low byte even, high byte odd).
Keys are walked as one virtual list: SWA entries in [0, W_pad), compressed entries after; with
``skip_empty`` a key tile whose slots are all -1 (a window not yet full, fewer compressed entries than top-k:
a short prompt's prefill) is skipped (:func:`skip_empty_pays` says when the model asks for it).  For
small T (decode) the list is cut into NUM_SPLITS ranges ("split-KV") whose partial (max, sum,
acc) go to an fp32 workspace, merged by ``_sparse_attn_combine_kernel``; with one split the
main kernel normalises and writes directly.  Dequantised keys are exact in bf16 (E4M3 x 2^e and
E2M1 x E4M3 both fit in 8 significant bits), so with bf16 q only the probabilities are rounded
(to bf16, for the P·V dot); with fp32 q everything stays fp32 ("ieee" dots).

Tuning knobs (measured on the GPU, not here): BLOCK_H / BLOCK_N / warps / stages from
:func:`default_config` (the autotuner's H200 winners), the autotuner (``_TUNE_CONFIGS``, keyed on the
power-of-two bucket of T; ``VLLM_DSV41_AUTOTUNE=1``) or a pinned ``config``; the
split count (``default_num_splits``: one wave of 64-head programs); ``hw_fp8`` (hardware E4M3
conversion or integer decoding).  With BLOCK_H = 64 the fp32 accumulator alone is 128 registers
per thread at 8 warps, so the kernel runs one CTA per SM.

``V_SPLIT = 2`` (a launch-config key, not a default): two programs per (row, split, head group), each owning
half of the value pairs (the logits still run over all of them, so each decodes the whole key tile).  It halves
the accumulator a program holds; measured on the H200 (docs/benchmarks.md session 16) it did not pay: the sm_90
build still spills, and the doubled key decoding cancels the gain (decode T = 64: 66.1 against 64.1 µs).
"""

from __future__ import annotations

import functools
import os

import torch

from vllm_dsv41 import formats
from vllm_dsv41.ops import define_op, triton_available
from vllm_dsv41.ops._triton import (
    gdc_launch_dependents, gdc_wait, hw_fp8 as _hw_fp8, launch_fitting, pdl, pdl_launch, sm_count,
)
from vllm_dsv41.reference.model import apply_rope, sparse_attention

try:  # Triton is optional: the CPU wheels run the reference only
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

OP_NAME = "sparse_attn"
SCHEMA = ("(Tensor q, Tensor swa_cache, Tensor swa_slots, Tensor? comp_cache, Tensor? comp_slots, "
          "Tensor sink, float scale, Tensor positions, Tensor inv_freq, bool skip_empty=False) -> Tensor")

LOG2E = 1.4426950408889634
SPLIT_ALIGN = 64
"""Keys per split are a multiple of this (so every BLOCK_N in the tuning list divides it)."""
MIN_KEYS_PER_SPLIT = 64
"""The default split count never cuts a row's keys into ranges shorter than this."""
SKIP_EMPTY_MIN_ROWS = 256
"""``skip_empty`` is asked for from this many rows (prefill); see :func:`skip_empty_pays`."""
AUTOTUNE_ENV = "VLLM_DSV41_AUTOTUNE"
"""1: the Triton autotuner picks the launch config per shape key (else :func:`default_config`)."""
COMBINE_CHUNK_ENV = "VLLM_DSV41_COMBINE_CHUNK"
"""Splits the split-KV combine merges a step (a power of two up to 16; default 1: one a step)."""
_REF_ROW_CHUNK = 64
"""The reference attends this many rows at a time (bounds the [rows, heads, keys] logits)."""


def combine_chunk() -> int:
    """``VLLM_DSV41_COMBINE_CHUNK``: how many splits the combine kernel loads and merges at once.  At batch 1 the
    combine runs ~18 splits as dependent rounds of loads, ~7 µs a layer (docs/benchmarks.md, session 31); a chunk
    issues them together (the launcher caps it at 8 // BLOCK_H: 4 at batch 1).  Default 1 (the measured form) until
    that is timed; anything else fails naming the value."""
    v = os.environ.get(COMBINE_CHUNK_ENV, "1").strip() or "1"
    if v not in ("1", "2", "4", "8", "16"):
        raise ValueError(f"{COMBINE_CHUNK_ENV}={v!r}: expected 1, 2, 4, 8 or 16")
    return int(v)


# --------------------------------------------------------------------------- reference


def _slot_list(slots: torch.Tensor) -> torch.Tensor:
    """Slot lists stay int32 or int64 as given (int64 once a pool's flat rows pass 2^31); others -> int64."""
    return slots if slots.dtype in (torch.int32, torch.int64) else slots.to(torch.int64)


def _check_inputs(q, swa_cache, swa_slots, comp_cache, comp_slots, sink, positions, inv_freq) -> None:
    if q.dim() != 3:
        raise ValueError(f"sparse_attn: q must be [T, Hq, D], got {tuple(q.shape)}")
    T, Hq, D = q.shape
    if swa_cache.dtype != torch.uint8 or swa_cache.dim() != 2 or swa_cache.shape[1] != formats.mxfp8_record_bytes(D):
        raise ValueError(f"sparse_attn: swa_cache must be uint8 [slots, {D + D // 32}], got "
                         f"{swa_cache.dtype} {tuple(swa_cache.shape)}")
    if swa_slots.dim() != 2 or swa_slots.shape[0] != T:
        raise ValueError(f"sparse_attn: swa_slots must be [T={T}, W], got {tuple(swa_slots.shape)}")
    if (comp_cache is None) != (comp_slots is None):
        raise ValueError("sparse_attn: comp_cache and comp_slots come together (or both None)")
    if comp_cache is not None:
        if comp_cache.dtype != torch.uint8 or comp_cache.dim() != 2 or \
                comp_cache.shape[1] != formats.nvfp4_record_bytes(D):
            raise ValueError(f"sparse_attn: comp_cache must be uint8 [slots, {D // 2 + D // 16}], got "
                             f"{comp_cache.dtype} {tuple(comp_cache.shape)}")
        if comp_slots.dim() != 2 or comp_slots.shape[0] != T:
            raise ValueError(f"sparse_attn: comp_slots must be [T={T}, K], got {tuple(comp_slots.shape)}")
    if tuple(sink.shape) != (Hq,):
        raise ValueError(f"sparse_attn: sink must be [Hq={Hq}], got {tuple(sink.shape)}")
    if tuple(positions.shape) != (T,):
        raise ValueError(f"sparse_attn: positions must be [T={T}], got {tuple(positions.shape)}")
    R = 2 * inv_freq.numel()
    if inv_freq.dim() != 1 or not 0 < R <= D:
        raise ValueError(f"sparse_attn: inv_freq must be [R/2] with 0 < R <= D, got {tuple(inv_freq.shape)}")


def _decoded_union(cache: torch.Tensor, slots: torch.Tensor, decode) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct valid slots of ``slots`` [t, n] (ascending) -> (decoded keys [u, D], membership [t, u])."""
    valid = slots >= 0
    uniq = torch.unique(slots[valid])
    keys = decode(cache[uniq.long()])
    col = torch.where(valid, torch.searchsorted(uniq, slots.contiguous()), uniq.numel())  # -1 -> spare column
    member = torch.zeros(slots.shape[0], uniq.numel() + 1, dtype=torch.bool, device=slots.device)
    member.scatter_(1, col, True)
    return keys, member[:, :-1]


def skip_empty_pays(rows: int, max_position: int, fill_context: int) -> bool:
    """Whether ``sparse_attn`` should test each key tile and skip the tiles of -1 (``skip_empty``): for prefill
    rows (``SKIP_EMPTY_MIN_ROWS`` or more) while the step's largest position stays below twice
    ``fill_context``, the context from which every row's lists are full (the largest compression ratio x
    top-k).  Measured on an H200 (Triton 3.7.1, kernel time, 64 heads, W 128, top-512, docs/benchmarks.md
    session 8): the test in the key loop costs 17% on rows whose lists are full (4,096 rows at position 8,192:
    3,301 -> 3,864 µs) and 8% on a 4,096-token prompt from position 0, and saves 21% on a 1,024-token prompt
    (837 -> 662 µs); a decode step (64 rows) lost 43% under Triton 3.6.  Twice the fill context is about where
    the rows that gain and the rows that pay balance."""
    return rows >= SKIP_EMPTY_MIN_ROWS and 0 <= max_position < 2 * fill_context


def sparse_attn_ref(q: torch.Tensor, swa_cache: torch.Tensor, swa_slots: torch.Tensor,
                    comp_cache: torch.Tensor | None, comp_slots: torch.Tensor | None, sink: torch.Tensor,
                    scale: float, positions: torch.Tensor, inv_freq: torch.Tensor,
                    skip_empty: bool = False) -> torch.Tensor:
    """Plain-PyTorch sparse_attn (CPU implementation and test oracle), fp32 throughout.  ``skip_empty`` is
    a hint for the kernel's loop; the result does not depend on it.

    Rows go in chunks of ``_REF_ROW_CHUNK``.  Per chunk the keys are the decoded records of the
    distinct valid SWA slots (ascending), then of the distinct valid compressed slots (ascending),
    and each row's mask marks its own lists; ``reference.model.sparse_attention`` does the softmax
    with the sink and ``apply_rope(..., inverse=True)`` rotates the output back.
    """
    _check_inputs(q, swa_cache, swa_slots, comp_cache, comp_slots, sink, positions, inv_freq)
    T, Hq, D = q.shape
    out = torch.empty(T, Hq, D, dtype=torch.float32, device=q.device)
    sink32 = sink.float()
    for lo in range(0, T, _REF_ROW_CHUNK):
        hi = min(lo + _REF_ROW_CHUNK, T)
        keys, mask = _decoded_union(swa_cache, swa_slots[lo:hi], lambda r: formats.decode_mxfp8_record(r, D))
        if comp_cache is not None:
            ck, cm = _decoded_union(comp_cache, comp_slots[lo:hi], lambda r: formats.decode_nvfp4_record(r, D))
            keys, mask = torch.cat((keys, ck)), torch.cat((mask, cm), dim=1)
        if keys.shape[0] == 0:  # only the sink: nothing in the numerator
            out[lo:hi] = 0.0
        else:
            out[lo:hi] = sparse_attention(q[lo:hi].float(), keys, mask, sink32, scale)
    out = apply_rope(out, positions, inv_freq.float(), inverse=True)
    return out.to(q.dtype)


# --------------------------------------------------------------------------- Triton kernels

if triton is not None:

    @triton.jit
    def _e4m3_to_f32(b, HW_FP8: tl.constexpr):
        """int32 tensor of E4M3 bytes (0..255) -> float32 (NaN codes are never written by the encoder)."""
        if HW_FP8:
            v = b.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            e = (b >> 3) & 15
            m = b & 7
            # value = significand * 2^-10: subnormal (e = 0) m*2^-9, normal (8+m)*2^(e-10)
            sig = tl.where(e == 0, 2 * m, (m | 8) << e)
            v = sig.to(tl.float32) * 0.0009765625
            v = tl.where((b & 128) != 0, -v, v)
        return v

    @triton.jit
    def _e8m0_to_f32(e):
        """int32 tensor of UE8M0 bytes -> float32 2^(e-127) (0 -> 2^-127, 255 -> NaN), from the bits."""
        bits = tl.where(e == 0, 1 << 22, e << 23)
        v = bits.to(tl.float32, bitcast=True)
        return tl.where(e == 255, float("nan"), v)

    @triton.jit
    def _e2m1_twice(c):
        """int32 tensor of E2M1 codes (0..15) -> float32 2*value (exact small integers, signed)."""
        e = (c >> 1) & 3
        m = c & 1
        mag2 = tl.where(e == 0, m, ((2 + m) << e) >> 1)  # 0,1,2,3,4,6,8,12
        v = mag2.to(tl.float32)
        return tl.where((c & 8) != 0, -v, v)

    @triton.jit
    def _mxfp8_part(rec8_ptr, rec16_ptr, row8, row16, slots, valid, p0, P: tl.constexpr, D: tl.constexpr,
                    BLOCK_N: tl.constexpr, HW_FP8: tl.constexpr, ALIGNED: tl.constexpr):
        """Pairs p0 .. p0 + P of the MXFP8 records of ``slots`` [BLOCK_N] (int64) -> (even, odd) [BLOCK_N, P], fp32.

        A record is D E4M3 bytes then D/32 UE8M0 bytes; read as int16 words, word i holds elements
        2i (low byte) and 2i+1 (high byte); one scale covers 16 words (``p0`` is a multiple of 16).
        """
        G: tl.constexpr = P // 16
        base16 = slots * row16
        base8 = slots * row8
        if ALIGNED:  # rows start on 16-byte boundaries: lets the loads vectorise
            base16 = tl.multiple_of(base16, 8)
            base8 = tl.multiple_of(base8, 16)
        w = tl.load(rec16_ptr + base16[:, None] + p0 + tl.arange(0, P)[None, :], mask=valid[:, None], other=0)
        w = tl.reshape(w.to(tl.int32), (BLOCK_N, G, 16))
        sc = tl.load(rec8_ptr + base8[:, None] + D + p0 // 16 + tl.arange(0, G)[None, :], mask=valid[:, None],
                     other=127)
        s = _e8m0_to_f32(sc.to(tl.int32))[:, :, None]
        ke = _e4m3_to_f32(w & 255, HW_FP8) * s
        ko = _e4m3_to_f32((w >> 8) & 255, HW_FP8) * s
        return tl.reshape(ke, (BLOCK_N, P)), tl.reshape(ko, (BLOCK_N, P))

    @triton.jit
    def _nvfp4_part(rec8_ptr, row8, slots, valid, p0, P: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                    HW_FP8: tl.constexpr, ALIGNED: tl.constexpr):
        """Pairs p0 .. p0 + P of the NVFP4 records of ``slots`` [BLOCK_N] (int64) -> (even, odd) [BLOCK_N, P], fp32.

        A record is D/2 bytes of E2M1 pairs (low nibble = even element) then D/16 E4M3 scales;
        one scale covers 8 bytes (``p0`` is a multiple of 8).  With HW_FP8 each E2M1 code goes through the
        hardware E4M3 conversion: its bits (s, e1, e0, m) placed as the E4M3 byte (s, 0, 0, e1, e0, m, 0, 0) read
        exactly value x 2^-6 (subnormal codes included), so a nibble costs three integer ops instead of the ~12 of
        the bit-by-bit decode (the comp-tile loop of the sm_90 build: 3,846 -> 2,265 instructions per thread).
        """
        HALF: tl.constexpr = D // 2
        G: tl.constexpr = P // 8
        base = slots * row8
        if ALIGNED:
            base = tl.multiple_of(base, 16)
        b = tl.load(rec8_ptr + base[:, None] + p0 + tl.arange(0, P)[None, :], mask=valid[:, None], other=0)
        b = tl.reshape(b.to(tl.int32), (BLOCK_N, G, 8))
        sc = tl.load(rec8_ptr + base[:, None] + HALF + p0 // 8 + tl.arange(0, G)[None, :], mask=valid[:, None],
                     other=0)
        if HW_FP8:
            s = (_e4m3_to_f32(sc.to(tl.int32), HW_FP8) * 64.0)[:, :, None]  # 64 undoes the 2^-6 of the E4M3 read
            ke = _e4m3_to_f32(((b & 7) << 2) | ((b & 8) << 4), HW_FP8) * s
            ko = _e4m3_to_f32(((b >> 2) & 28) | (b & 128), HW_FP8) * s
        else:
            s = (_e4m3_to_f32(sc.to(tl.int32), HW_FP8) * 0.5)[:, :, None]  # 0.5 undoes the doubled E2M1
            ke = _e2m1_twice(b & 15) * s
            ko = _e2m1_twice(b >> 4) * s
        return tl.reshape(ke, (BLOCK_N, P)), tl.reshape(ko, (BLOCK_N, P))

    @triton.jit
    def _row_keys_kernel(rec8_ptr, rec16_ptr, row8, row16, slot_ptr, stride_st, n_cols, col0, out_ptr, idx_ptr, N,
                         KIND: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, HW_FP8: tl.constexpr,
                         ALIGNED: tl.constexpr):
        """``sparse_attn_gathered.row_keys``: the records row t lists in ``slot_ptr`` [T, n_cols] (KIND 0: MXFP8,
        1: NVFP4), decoded to bf16 into workspace rows t * N + col0 + n, and those rows' numbers into ``idx_ptr``
        [T, N] (-1 for a slot of -1)."""
        t = tl.program_id(0).to(tl.int64)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        inside = n < n_cols
        slots = tl.load(slot_ptr + t * stride_st + n, mask=inside, other=-1).to(tl.int64)
        valid = slots >= 0
        if KIND == 0:
            k_e, k_o = _mxfp8_part(rec8_ptr, rec16_ptr, row8, row16, slots, valid, 0, D // 2, D, BLOCK_N, HW_FP8,
                                   ALIGNED)
        else:
            k_e, k_o = _nvfp4_part(rec8_ptr, row8, slots, valid, 0, D // 2, D, BLOCK_N, HW_FP8, ALIGNED)
        v = tl.reshape(tl.join(k_e, k_o), (BLOCK_N, D)).to(tl.bfloat16)  # pairs back in element order
        row = t * N + col0 + n
        tl.store(out_ptr + row[:, None] * D + tl.arange(0, D)[None, :], v, mask=inside[:, None])
        tl.store(idx_ptr + row, tl.where(valid, row, -1).to(tl.int32), mask=inside)

    @triton.jit
    def _qk(q_e, q_o, k_e, k_o, s, DOT_PREC: tl.constexpr):
        """s + q·k^T over one block of pairs: q_* [H, P], k_* [N, P] -> [H, N] fp32."""
        s = tl.dot(q_e, tl.trans(k_e), s, input_precision=DOT_PREC)
        return tl.dot(q_o, tl.trans(k_o), s, input_precision=DOT_PREC)

    @triton.jit
    def _softmax_pv(s, k_e, k_o, valid, m_i, l_i, acc_e, acc_o, qk_scale, DOT_PREC: tl.constexpr,
                    P_BF16: tl.constexpr):
        """One key tile of the online softmax (base 2): logits s [H, N], values k_* [N, P], valid [N]."""
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if P_BF16:
            p = p.to(tl.bfloat16)
        p = p.to(k_e.dtype)
        acc_e = tl.dot(p, k_e, acc_e * alpha[:, None], input_precision=DOT_PREC)
        acc_o = tl.dot(p, k_o, acc_o * alpha[:, None], input_precision=DOT_PREC)
        return m_new, l_i, acc_e, acc_o

    @triton.jit
    def _swa_tile(rec8_ptr, rec16_ptr, row8, row16, slots, q_eA, q_oA, q_eB, q_oB, pa, pb, m_i, l_i, acc_e, acc_o,
                  qk_scale, D: tl.constexpr, PV: tl.constexpr, V_SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
                  HW_FP8: tl.constexpr, ALIGNED: tl.constexpr, DOT_PREC: tl.constexpr, P_BF16: tl.constexpr):
        """One tile of SWA keys (MXFP8 records of ``slots``, -1 = none) into the online softmax: the logits over
        every pair, the values of the program's pairs pa .. pa + PV (``q_*B``, ``pb``: the other half's pairs,
        decoded and dropped first, when V_SPLIT = 2)."""
        valid = slots >= 0
        slots = slots.to(tl.int64)
        s = tl.zeros([q_eA.shape[0], BLOCK_N], dtype=tl.float32)
        if V_SPLIT == 2:
            k_e, k_o = _mxfp8_part(rec8_ptr, rec16_ptr, row8, row16, slots, valid, pb, PV, D, BLOCK_N, HW_FP8,
                                   ALIGNED)
            s = _qk(q_eB, q_oB, k_e.to(q_eA.dtype), k_o.to(q_eA.dtype), s, DOT_PREC)
        k_e, k_o = _mxfp8_part(rec8_ptr, rec16_ptr, row8, row16, slots, valid, pa, PV, D, BLOCK_N, HW_FP8, ALIGNED)
        k_e, k_o = k_e.to(q_eA.dtype), k_o.to(q_eA.dtype)  # exact: the records carry <= 8 significant bits
        s = _qk(q_eA, q_oA, k_e, k_o, s, DOT_PREC)
        return _softmax_pv(s, k_e, k_o, valid, m_i, l_i, acc_e, acc_o, qk_scale, DOT_PREC, P_BF16)

    @triton.jit
    def _comp_tile(rec8_ptr, row8, slots, q_eA, q_oA, q_eB, q_oB, pa, pb, m_i, l_i, acc_e, acc_o, qk_scale,
                   D: tl.constexpr, PV: tl.constexpr, V_SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
                   HW_FP8: tl.constexpr, ALIGNED: tl.constexpr, DOT_PREC: tl.constexpr, P_BF16: tl.constexpr):
        """One tile of compressed keys (NVFP4 records of ``slots``, -1 = none) into the online softmax (pairs as
        in :func:`_swa_tile`)."""
        valid = slots >= 0
        slots = slots.to(tl.int64)
        s = tl.zeros([q_eA.shape[0], BLOCK_N], dtype=tl.float32)
        if V_SPLIT == 2:
            k_e, k_o = _nvfp4_part(rec8_ptr, row8, slots, valid, pb, PV, D, BLOCK_N, HW_FP8, ALIGNED)
            s = _qk(q_eB, q_oB, k_e.to(q_eA.dtype), k_o.to(q_eA.dtype), s, DOT_PREC)
        k_e, k_o = _nvfp4_part(rec8_ptr, row8, slots, valid, pa, PV, D, BLOCK_N, HW_FP8, ALIGNED)
        k_e, k_o = k_e.to(q_eA.dtype), k_o.to(q_eA.dtype)
        s = _qk(q_eA, q_oA, k_e, k_o, s, DOT_PREC)
        return _softmax_pv(s, k_e, k_o, valid, m_i, l_i, acc_e, acc_o, qk_scale, DOT_PREC, P_BF16)

    @triton.jit
    def _inv_rope_store(out_ptr, row_off, h_mask, o_e, o_o, pos, inv_freq_ptr, p0, P: tl.constexpr,
                        D: tl.constexpr, R: tl.constexpr, PAIR_IO: tl.constexpr):
        """Store pairs (2i, 2i+1), i = p0 .. p0 + P (o_* [H, P]), those with i >= (D-R)/2 rotated by
        -pos*inv_freq[i-(D-R)/2].

        The angle is formed and reduced modulo 2*pi in float64 (positions reach 1e6), then the
        cos/sin are float32.  ``row_off`` [H] int64 element offsets of each head's output row.
        """
        NOPE: tl.constexpr = (D - R) // 2
        j = p0 + tl.arange(0, P)
        rot = j >= NOPE
        f = tl.load(inv_freq_ptr + (j - NOPE), mask=rot, other=0.0)
        ang = pos.to(tl.float64) * f.to(tl.float64)
        ang = ang - 6.283185307179586 * tl.floor(ang * 0.15915494309189535)
        a32 = ang.to(tl.float32)
        c = tl.where(rot, tl.cos(a32), 1.0)
        sn = tl.where(rot, tl.sin(a32), 0.0)
        out_e = o_e * c[None, :] + o_o * sn[None, :]
        out_o = o_o * c[None, :] - o_e * sn[None, :]
        if PAIR_IO:  # bf16 output: one contiguous 32-bit word per pair (even element in the low half)
            lo = out_e.to(tl.bfloat16).to(tl.uint16, bitcast=True).to(tl.int32)
            hi = out_o.to(tl.bfloat16).to(tl.uint16, bitcast=True).to(tl.int32)
            wptr = out_ptr.to(tl.pointer_type(tl.int32)) + row_off[:, None] // 2 + j[None, :]
            tl.store(wptr, lo | (hi << 16), mask=h_mask[:, None])
        else:
            ptr = out_ptr + row_off[:, None] + 2 * j[None, :]
            dt = out_ptr.dtype.element_ty
            tl.store(ptr, out_e.to(dt), mask=h_mask[:, None])
            tl.store(ptr + 1, out_o.to(dt), mask=h_mask[:, None])

    @triton.jit
    def _load_q_pairs(q_ptr, q_off, h_mask, p0, P: tl.constexpr, PAIR_IO: tl.constexpr, DOT_F32: tl.constexpr):
        """Pairs p0 .. p0 + P of the query rows at ``q_off`` [H, 1] -> (even, odd) [H, P]."""
        j = p0 + tl.arange(0, P)
        if PAIR_IO:  # bf16 q: read each pair (2i, 2i+1) as one 32-bit word, contiguous loads
            qw = tl.load(q_ptr.to(tl.pointer_type(tl.int32)) + q_off // 2 + j[None, :], mask=h_mask[:, None], other=0)
            q_e = (qw & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)
            q_o = ((qw >> 16) & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            q_e = tl.load(q_ptr + q_off + 2 * j[None, :], mask=h_mask[:, None], other=0.0)
            q_o = tl.load(q_ptr + q_off + 2 * j[None, :] + 1, mask=h_mask[:, None], other=0.0)
        if DOT_F32:  # exact upcast; the keys follow q's dtype
            q_e, q_o = q_e.to(tl.float32), q_o.to(tl.float32)
        return q_e, q_o

    @triton.jit(do_not_specialize=["t_bucket"])  # an autotune key only: its value need not compile a variant
    def _sparse_attn_kernel(
        q_ptr,            # [T, Hq, D] bf16/fp32, last dim contiguous
        swa8_ptr,         # uint8 [S1, D + D/32] MXFP8 records
        swa16_ptr,        # the same storage as int16 words
        swa_slot_ptr,     # int32 / int64 [T, W]
        comp8_ptr,        # uint8 [S2, D/2 + D/16] NVFP4 records (unused without HAS_COMP)
        comp_slot_ptr,    # int32 / int64 [T, K]
        sink_ptr,         # fp32 [Hq]
        pos_ptr,          # int64 [T]
        inv_freq_ptr,     # fp32 [R/2]
        out_ptr,          # [T, Hq, D] q's dtype (written when NUM_SPLITS == 1)
        part_acc_ptr,     # fp32 [T, NUM_SPLITS, Hq, D]: even half then odd half (split-KV only)
        part_ml_ptr,      # fp32 [T, NUM_SPLITS, Hq, 2]: running max (base 2) and sum
        qk_scale,         # scale * log2(e)
        t_bucket,         # autotune key only (power of two >= T)
        Hq, W, K, W_pad, keys_per_split, NUM_SPLITS,
        stride_qt, stride_qh, stride_swa8, stride_swa16, stride_sst,
        stride_comp8, stride_cst, stride_ot, stride_oh,
        D: tl.constexpr, R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
        HAS_COMP: tl.constexpr, HW_FP8: tl.constexpr, DOT_PREC: tl.constexpr, P_BF16: tl.constexpr,
        DOT_F32: tl.constexpr, SWA_ALIGNED: tl.constexpr, COMP_ALIGNED: tl.constexpr, PAIR_IO: tl.constexpr,
        SKIP_EMPTY: tl.constexpr, V_SPLIT: tl.constexpr, PDL: tl.constexpr = False,
    ):
        if PDL:  # programmatic dependent launch: the previous kernel first
            gdc_wait()
            gdc_launch_dependents()
        HALF: tl.constexpr = D // 2
        PV: tl.constexpr = HALF // V_SPLIT  # value pairs per program
        n_hg = tl.cdiv(Hq, BLOCK_H)
        pid = tl.program_id(0)
        hg = pid % n_hg
        rest = pid // n_hg
        vc = rest % V_SPLIT
        rest = rest // V_SPLIT
        split = rest % NUM_SPLITS
        t = (rest // NUM_SPLITS).to(tl.int64)
        pa = vc * PV  # the program's value pairs: pa .. pa + PV
        pb = (1 - vc) * PV  # with V_SPLIT = 2, the other half (logits only)

        offs_h = hg * BLOCK_H + tl.arange(0, BLOCK_H)
        h_mask = offs_h < Hq
        q_off = t * stride_qt + offs_h[:, None].to(tl.int64) * stride_qh
        q_eA, q_oA = _load_q_pairs(q_ptr, q_off, h_mask, pa, PV, PAIR_IO, DOT_F32)
        if V_SPLIT == 2:
            q_eB, q_oB = _load_q_pairs(q_ptr, q_off, h_mask, pb, PV, PAIR_IO, DOT_F32)
        else:
            q_eB, q_oB = q_eA, q_oA

        sink2 = tl.load(sink_ptr + offs_h, mask=h_mask, other=0.0) * 1.4426950408889634
        m_i = tl.maximum(sink2, -1.0e30)  # the sink is a key with logit sink and value 0
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc_e = tl.zeros([BLOCK_H, PV], dtype=tl.float32)
        acc_o = tl.zeros([BLOCK_H, PV], dtype=tl.float32)

        lo = split * keys_per_split
        hi = lo + keys_per_split
        offs_n = tl.arange(0, BLOCK_N)

        # SWA entries: virtual keys [0, W).  SKIP_EMPTY is a constexpr so that without it the key loops hold
        # no branch (the test in the loop costs 17% on full rows, docs/benchmarks.md session 8)
        for n0 in range(tl.minimum(lo, W), tl.minimum(hi, W), BLOCK_N):
            n = n0 + offs_n
            slots = tl.load(swa_slot_ptr + t * stride_sst + n, mask=n < W, other=-1)
            if SKIP_EMPTY:
                if tl.max(slots, 0) >= 0:  # a tile of -1 only (a window not yet full) is skipped
                    m_i, l_i, acc_e, acc_o = _swa_tile(
                        swa8_ptr, swa16_ptr, stride_swa8, stride_swa16, slots, q_eA, q_oA, q_eB, q_oB, pa, pb,
                        m_i, l_i, acc_e, acc_o, qk_scale, D, PV, V_SPLIT, BLOCK_N, HW_FP8, SWA_ALIGNED, DOT_PREC,
                        P_BF16)
            else:
                m_i, l_i, acc_e, acc_o = _swa_tile(
                    swa8_ptr, swa16_ptr, stride_swa8, stride_swa16, slots, q_eA, q_oA, q_eB, q_oB, pa, pb,
                    m_i, l_i, acc_e, acc_o, qk_scale, D, PV, V_SPLIT, BLOCK_N, HW_FP8, SWA_ALIGNED, DOT_PREC, P_BF16)
        # compressed entries: virtual keys [W_pad, W_pad + K)
        if HAS_COMP:
            for n0 in range(tl.maximum(lo - W_pad, 0), tl.minimum(hi - W_pad, K), BLOCK_N):
                n = n0 + offs_n
                slots = tl.load(comp_slot_ptr + t * stride_cst + n, mask=n < K, other=-1)
                if SKIP_EMPTY:
                    if tl.max(slots, 0) >= 0:  # fewer visible entries than top-k: the tail of -1 is skipped
                        m_i, l_i, acc_e, acc_o = _comp_tile(
                            comp8_ptr, stride_comp8, slots, q_eA, q_oA, q_eB, q_oB, pa, pb, m_i, l_i, acc_e, acc_o,
                            qk_scale, D, PV, V_SPLIT, BLOCK_N, HW_FP8, COMP_ALIGNED, DOT_PREC, P_BF16)
                else:
                    m_i, l_i, acc_e, acc_o = _comp_tile(
                        comp8_ptr, stride_comp8, slots, q_eA, q_oA, q_eB, q_oB, pa, pb, m_i, l_i, acc_e, acc_o,
                        qk_scale, D, PV, V_SPLIT, BLOCK_N, HW_FP8, COMP_ALIGNED, DOT_PREC, P_BF16)

        if NUM_SPLITS == 1:
            denom = l_i + tl.exp2(sink2 - m_i)
            denom = tl.where(denom > 0, denom, 1.0)
            row_off = t * stride_ot + offs_h.to(tl.int64) * stride_oh
            pos = tl.load(pos_ptr + t)
            _inv_rope_store(out_ptr, row_off, h_mask, acc_e / denom[:, None], acc_o / denom[:, None], pos,
                            inv_freq_ptr, pa, PV, D, R, PAIR_IO)
        else:
            prow = (t * NUM_SPLITS + split) * Hq + offs_h.to(tl.int64)  # [H] rows of the workspace
            # both halves of a V split reach the same (max, sum) up to the order of the logit sums: one writes
            ml_mask = h_mask & (offs_h * 0 + vc == 0)
            tl.store(part_ml_ptr + prow * 2, m_i, mask=ml_mask)
            tl.store(part_ml_ptr + prow * 2 + 1, l_i, mask=ml_mask)
            a_ptr = part_acc_ptr + prow[:, None] * D + pa + tl.arange(0, PV)[None, :]
            tl.store(a_ptr, acc_e, mask=h_mask[:, None])
            tl.store(a_ptr + HALF, acc_o, mask=h_mask[:, None])

    @triton.jit
    def _sparse_attn_combine_kernel(
        part_acc_ptr,     # fp32 [T, NUM_SPLITS, Hq, D] (even half, odd half)
        part_ml_ptr,      # fp32 [T, NUM_SPLITS, Hq, 2]
        sink_ptr, pos_ptr, inv_freq_ptr,
        out_ptr,          # [T, Hq, D]
        Hq, NUM_SPLITS, stride_ot, stride_oh,
        D: tl.constexpr, R: tl.constexpr, BLOCK_H: tl.constexpr, PAIR_IO: tl.constexpr, PDL: tl.constexpr = False,
        S_CHUNK: tl.constexpr = 1,
    ):
        if PDL:  # programmatic dependent launch: the previous kernel first
            gdc_wait()
            gdc_launch_dependents()
        HALF: tl.constexpr = D // 2
        n_hg = tl.cdiv(Hq, BLOCK_H)
        pid = tl.program_id(0)
        hg = pid % n_hg
        t = (pid // n_hg).to(tl.int64)
        offs_h = hg * BLOCK_H + tl.arange(0, BLOCK_H)
        h_mask = offs_h < Hq
        j = tl.arange(0, HALF)
        sink2 = tl.load(sink_ptr + offs_h, mask=h_mask, other=0.0) * 1.4426950408889634
        m = tl.maximum(sink2, -1.0e30)
        acc_e = tl.zeros([BLOCK_H, HALF], dtype=tl.float32)
        acc_o = tl.zeros([BLOCK_H, HALF], dtype=tl.float32)
        if S_CHUNK == 1:  # one split a step: S dependent rounds of loads
            for s in range(NUM_SPLITS):
                prow = (t * NUM_SPLITS + s) * Hq + offs_h
                m = tl.maximum(m, tl.load(part_ml_ptr + prow * 2, mask=h_mask, other=-1.0e30))
            denom = tl.exp2(sink2 - m)
            for s in range(NUM_SPLITS):
                prow = (t * NUM_SPLITS + s) * Hq + offs_h
                m_s = tl.load(part_ml_ptr + prow * 2, mask=h_mask, other=-1.0e30)
                l_s = tl.load(part_ml_ptr + prow * 2 + 1, mask=h_mask, other=0.0)
                w = tl.exp2(m_s - m)
                denom += w * l_s
                a_ptr = part_acc_ptr + prow[:, None] * D + j[None, :]
                acc_e += w[:, None] * tl.load(a_ptr, mask=h_mask[:, None], other=0.0)
                acc_o += w[:, None] * tl.load(a_ptr + HALF, mask=h_mask[:, None], other=0.0)
        else:  # S_CHUNK splits a step, their loads issued together ([BLOCK_H, S_CHUNK(, HALF)] tiles)
            offs_c = tl.arange(0, S_CHUNK)
            for s0 in range(0, NUM_SPLITS, S_CHUNK):
                offs_s = s0 + offs_c
                prow = (t * NUM_SPLITS + offs_s[None, :]) * Hq + offs_h[:, None]
                ok = h_mask[:, None] & (offs_s[None, :] < NUM_SPLITS)
                m = tl.maximum(m, tl.max(tl.load(part_ml_ptr + prow * 2, mask=ok, other=-1.0e30), axis=1))
            denom = tl.exp2(sink2 - m)
            for s0 in range(0, NUM_SPLITS, S_CHUNK):
                offs_s = s0 + offs_c
                prow = (t * NUM_SPLITS + offs_s[None, :]) * Hq + offs_h[:, None]
                ok = h_mask[:, None] & (offs_s[None, :] < NUM_SPLITS)
                m_s = tl.load(part_ml_ptr + prow * 2, mask=ok, other=-1.0e30)
                l_s = tl.load(part_ml_ptr + prow * 2 + 1, mask=ok, other=0.0)
                w = tl.exp2(m_s - m[:, None])  # 0 for the chunk's splits past NUM_SPLITS
                denom += tl.sum(w * l_s, axis=1)
                a_ptr = part_acc_ptr + prow[:, :, None] * D + j[None, None, :]
                acc_e += tl.sum(w[:, :, None] * tl.load(a_ptr, mask=ok[:, :, None], other=0.0), axis=1)
                acc_o += tl.sum(w[:, :, None] * tl.load(a_ptr + HALF, mask=ok[:, :, None], other=0.0), axis=1)
        denom = tl.where(denom > 0, denom, 1.0)
        row_off = t * stride_ot + offs_h.to(tl.int64) * stride_oh
        pos = tl.load(pos_ptr + t)
        _inv_rope_store(out_ptr, row_off, h_mask, acc_e / denom[:, None], acc_o / denom[:, None], pos,
                        inv_freq_ptr, 0, HALF, D, R, PAIR_IO)

    # BLOCK_H = 64 runs the Hopper warp-group MMA (q and the key tile in shared memory); smaller head
    # groups use mma.sync and want num_stages = 2 (the pipeliner then stages the key tile through shared
    # memory instead of keeping two register copies).  Pruned with sm90 ptxas: all fit in 255 registers
    # with at most ~0.6 KB/thread of spill.
    _TUNE_CONFIGS = [
        triton.Config({"BLOCK_H": bh, "BLOCK_N": bn, "V_SPLIT": vs}, num_warps=nw, num_stages=ns)
        for bh, bn, nw, ns, vs in (
            (64, 32, 8, 1, 1), (64, 32, 8, 2, 1), (64, 16, 8, 1, 1), (64, 64, 8, 2, 1),
            (32, 32, 8, 2, 1), (32, 64, 8, 2, 1),
            (16, 16, 4, 2, 1), (16, 32, 4, 2, 1), (16, 64, 8, 2, 1),
        )
    ]
    _sparse_attn_kernel_tuned = triton.autotune(
        configs=_TUNE_CONFIGS,
        key=["t_bucket", "Hq", "W", "K", "NUM_SPLITS", "D", "HAS_COMP", "DOT_F32"],
    )(_sparse_attn_kernel)


# --------------------------------------------------------------------------- launch wrapper


def default_num_splits(T: int, Hq: int, n_virtual_keys: int, device: torch.device, v_split: int = 1) -> int:
    """Split-KV count for small T: as many (row x 64-head group x value half x split) programs as fit in one
    wave on the SMs, never cutting a row's keys below ``MIN_KEYS_PER_SPLIT``; 1 once the rows fill a wave."""
    sms = sm_count(device)
    units = T * -(-Hq // 64) * v_split
    return max(1, min(sms // units, n_virtual_keys // MIN_KEYS_PER_SPLIT))


def default_config(T: int, Hq: int) -> dict:
    """The launch config used unless ``VLLM_DSV41_AUTOTUNE=1``: the autotuner's H200 winners at the
    production shapes (docs/benchmarks.md) - 16-head tiles when a handful of rows (or heads) cannot fill
    64-head tiles, else 64 heads (warp-group MMA); 64-key tiles, 8 warps, 2 stages.  Autotuning in the
    engine compiles and times nine variants for every new (T bucket, K, splits) key: minutes of stalls
    on the first steps of a server."""
    bh = 16 if T < 8 or Hq < 64 else 64
    return {"BLOCK_H": bh, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2}


def smaller_configs(config: dict) -> list[dict]:
    """``config``, then the steps down :func:`~vllm_dsv41.ops._triton.launch_fitting` tries when it does
    not fit the GPU's shared memory: one pipeline stage, then narrower key tiles, then 16-head tiles."""
    out = [dict(config)]
    if config.get("num_stages", 1) > 1:
        out.append({**config, "num_stages": 1})
    out += [{**config, "BLOCK_N": bn, "num_stages": 1} for bn in (32, 16) if bn < config["BLOCK_N"]]
    if config["BLOCK_H"] > 16:
        out.append({"BLOCK_H": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2})
    return out


def plan_splits(T: int, Hq: int, W: int, K: int, device: torch.device,
                num_splits: int | None = None, v_split: int = 1) -> tuple[int, int, int]:
    """(W_pad, keys_per_split, splits) of the virtual key list [SWA 0..W_pad) + [compressed K)."""
    W_pad = -(-W // SPLIT_ALIGN) * SPLIT_ALIGN
    nv = max(W_pad + K, 1)
    S = num_splits if num_splits is not None else default_num_splits(T, Hq, W_pad + K, device, v_split)
    S = max(1, min(S, -(-nv // SPLIT_ALIGN)))
    keys_per_split = -(-(-(-nv // S)) // SPLIT_ALIGN) * SPLIT_ALIGN
    return W_pad, keys_per_split, -(-nv // keys_per_split)  # no empty split


def _rows_aligned(cache: torch.Tensor) -> bool:
    """Every record starts on a 16-byte boundary (true for the 528/288-byte production records)."""
    return cache.data_ptr() % 16 == 0 and cache.stride(0) % 16 == 0


def _sparse_attn_triton(q: torch.Tensor, swa_cache: torch.Tensor, swa_slots: torch.Tensor,
                        comp_cache: torch.Tensor | None, comp_slots: torch.Tensor | None, sink: torch.Tensor,
                        scale: float, positions: torch.Tensor, inv_freq: torch.Tensor, skip_empty: bool = False,
                        *, num_splits: int | None = None, config: dict | None = None,
                        hw_fp8: bool | None = None) -> torch.Tensor:
    """Launch the Triton kernel(s).  ``config`` = {"BLOCK_H", "BLOCK_N", "num_warps", "num_stages"}
    skips the autotuner (tests, sweeps); ``num_splits`` overrides :func:`default_num_splits`;
    ``hw_fp8`` picks the hardware E4M3 conversion (default: on for CUDA sm89+)."""
    if triton is None:
        raise RuntimeError("sparse_attn: Triton is not installed")
    _check_inputs(q, swa_cache, swa_slots, comp_cache, comp_slots, sink, positions, inv_freq)
    T, Hq, D = q.shape
    R = 2 * inv_freq.numel()
    if q.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"sparse_attn: q must be bf16 or fp32, got {q.dtype}")
    if D < 32 or D & (D - 1) or R % 2 or (D - R) % 2:
        raise ValueError(f"sparse_attn: the kernel needs D a power of two >= 32 and even R, got D={D}, R={R}")
    out = torch.empty(T, Hq, D, dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    if q.stride(2) != 1:
        q = q.contiguous()
    swa_cache = swa_cache if swa_cache.stride(1) == 1 else swa_cache.contiguous()
    if swa_cache.stride(0) % 2 or swa_cache.storage_offset() % 2:
        raise ValueError("sparse_attn: swa_cache rows must start on even byte offsets (read as 16-bit words)")
    swa16 = swa_cache.view(torch.int16)
    swa_slots = _slot_list(swa_slots)
    if swa_slots.stride(1) != 1:
        swa_slots = swa_slots.contiguous()
    W = swa_slots.shape[1]
    has_comp = comp_cache is not None
    if has_comp:
        comp_cache = comp_cache if comp_cache.stride(1) == 1 else comp_cache.contiguous()
        comp_slots = _slot_list(comp_slots)
        if comp_slots.stride(1) != 1:
            comp_slots = comp_slots.contiguous()
        K = comp_slots.shape[1]
    else:
        comp_cache, comp_slots, K = swa_cache, swa_slots, 0
    sink = sink.to(torch.float32).contiguous()
    positions = positions.to(torch.int64).contiguous()
    inv_freq = inv_freq.to(torch.float32).contiguous()

    if config is None and os.environ.get(AUTOTUNE_ENV, "0") != "1":
        config = default_config(T, Hq)
    v_split = config.get("V_SPLIT", 1) if config is not None else 1
    if v_split not in (1, 2) or (v_split == 2 and D % 64):
        raise ValueError(f"sparse_attn: V_SPLIT must be 1, or 2 with D a multiple of 64, got {v_split} (D={D})")
    W_pad, keys_per_split, S = plan_splits(T, Hq, W, K, q.device, num_splits, v_split)
    if S > 1:
        part_acc = torch.empty(T, S, Hq, D, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(T, S, Hq, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out
    # bf16 q/out with even strides and 4-byte aligned bases: pairs move as 32-bit words
    pair_io = (q.dtype == torch.bfloat16 and q.stride(0) % 2 == 0 and q.stride(1) % 2 == 0
               and q.data_ptr() % 4 == 0 and out.data_ptr() % 4 == 0)
    if hw_fp8 is None:
        hw_fp8 = _hw_fp8(q)
    # The interpreter's dot multiplies the raw bits of bf16 operands (Triton 3.9), so there the dots
    # run in fp32 on the same bf16-rounded operands (products of bf16 values are exact in fp32).
    dot_f32 = q.dtype == torch.float32 or not q.is_cuda
    dot_prec = "ieee" if dot_f32 else "tf32"

    args = (q, swa_cache, swa16, swa_slots, comp_cache, comp_slots, sink, positions, inv_freq, out,
            part_acc, part_ml, float(scale) * LOG2E, triton.next_power_of_2(T),
            Hq, W, K, W_pad, keys_per_split, S,
            q.stride(0), q.stride(1), swa_cache.stride(0), swa16.stride(0), swa_slots.stride(0),
            comp_cache.stride(0), comp_slots.stride(0), out.stride(0), out.stride(1))
    flags = dict(D=D, R=R, HAS_COMP=has_comp, HW_FP8=bool(hw_fp8), DOT_PREC=dot_prec,
                 P_BF16=q.dtype == torch.bfloat16, DOT_F32=dot_f32, SKIP_EMPTY=bool(skip_empty),
                 SWA_ALIGNED=_rows_aligned(swa_cache), COMP_ALIGNED=_rows_aligned(comp_cache), PAIR_IO=pair_io,
                 **pdl_launch(pdl(q)))
    if config is not None:
        if SPLIT_ALIGN % config["BLOCK_N"]:
            raise ValueError(f"sparse_attn: BLOCK_N must divide {SPLIT_ALIGN}")

        def launch(cfg: dict) -> None:
            cfg = dict(cfg)
            bh = cfg.pop("BLOCK_H")
            vs = cfg.pop("V_SPLIT", 1)
            _sparse_attn_kernel[(T * S * vs * triton.cdiv(Hq, bh),)](*args, BLOCK_H=bh, V_SPLIT=vs, **flags, **cfg)

        key = (tuple(sorted(config.items())), tuple(sorted(flags.items())), q.dtype, Hq, S > 1)
        launch_fitting("sparse_attn", launch, smaller_configs(config), key)
    else:
        def grid(meta):
            return (T * S * meta["V_SPLIT"] * triton.cdiv(Hq, meta["BLOCK_H"]),)
        _sparse_attn_kernel_tuned[grid](*args, **flags)
    if S > 1:
        # 16 heads per CTA, fewer while that leaves SMs idle (decode at batch 1: 4 CTAs of 16 heads took
        # ~11 µs, latency of S dependent rounds; 32 CTAs of 2 heads share the same bytes)
        bh = 16
        while bh > 2 and T * triton.cdiv(Hq, bh) < sm_count(q.device):
            bh //= 2
        # at most 8 (head, split) rows of loads at once a program: no spill on sm_90 at 4 warps (16 spill)
        chunk = min(combine_chunk(), max(1, 8 // bh), triton.next_power_of_2(S))
        _sparse_attn_combine_kernel[(T * triton.cdiv(Hq, bh),)](
            part_acc, part_ml, sink, positions, inv_freq, out, Hq, S, out.stride(0), out.stride(1),
            D=D, R=R, BLOCK_H=bh, PAIR_IO=pair_io, S_CHUNK=chunk, num_warps=4, **pdl_launch(flags["PDL"]))
    return out


def _sparse_attn_cuda(q, swa_cache, swa_slots, comp_cache, comp_slots, sink, scale, positions, inv_freq,
                      skip_empty=False):
    """CUDA implementation: the Triton kernel, or the reference where Triton is missing
    (``VLLM_DSV41_SPARSE_ATTN_REF=1`` forces the reference, for comparisons)."""
    if triton_available() and os.environ.get("VLLM_DSV41_SPARSE_ATTN_REF", "0") != "1":
        return _sparse_attn_triton(q, swa_cache, swa_slots, comp_cache, comp_slots, sink, scale, positions,
                                   inv_freq, skip_empty)
    return sparse_attn_ref(q, swa_cache, swa_slots, comp_cache, comp_slots, sink, scale, positions, inv_freq)


def _sparse_attn_fake(q, swa_cache, swa_slots, comp_cache, comp_slots, sink, scale, positions, inv_freq,
                      skip_empty=False):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@functools.cache
def register():
    """Define ``torch.ops.dsv41.sparse_attn`` (idempotent)."""
    return define_op(OP_NAME, SCHEMA, sparse_attn_ref, _sparse_attn_cuda, _sparse_attn_fake)


register()
