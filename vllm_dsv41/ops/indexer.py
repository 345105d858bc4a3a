"""``torch.ops.dsv41.index_scores``: indexer logits over a paged MXFP4 index-K cache.

Specification: architecture.md §2.5.5 (indexer), §4.1 (the 68-byte MXFP4 index-K record), §7.2
(DeepGEMM ``fp8_fp4_paged_mqa_logits``, which this op replaces); the oracle is
``reference.model.index_scores`` over keys decoded with ``formats.decode_mxfp4_record``.

For query row t (of request req_of_row[t]) and compressed entry s < n_vis[t] of that request:

    I[t, s] = sum_h w[t, h] * ReLU(q[t, h, :] . K[s, :])

where K[s] is the decoded record at slot block_table[req, s // rows_per_block] * rows_per_block
+ s % rows_per_block of ``idx_cache``.  Columns s >= n_vis[t] (up to n_max) are -inf.
Shapes: q fp32/bf16 [T, IH, ID] (RoPE applied), w fp32 [T, IH] (already x ID^-0.5 x IH^-0.5),
idx_cache uint8 [slots, ID/2 + ID/32], block_table int32 or int64 [num_reqs, max_blocks], req_of_row int32
[T], n_vis int32 [T] -> scores fp32 [T, n_max].  n_max is an argument so the output shape never
depends on device data (CUDA graphs, torch.compile).

Why an op: the PyTorch path gathers and decodes every visible record into fp32 (8x the cached
bytes) and materialises [T, IH, N] logits; at decode (T small, N up to 512k entries) the job is
a stream over 68-byte records, which one kernel does in a single pass.

Kernel design: one program per (query row, group of key tiles); the row's 32 x 128 query is
loaded once per program and kept in registers, each tile of BLOCK_N records is read once (68 B
each), dequantised in registers and multiplied against all heads with tensor cores.  Exactness
plan: the dequantised key is held in fp16 as E2M1 value x 2^-6 x 2^(e_g - e_max) (e_g the group's
UE8M0 exponent, e_max the record's largest), which is exact unless a group is > 2^24 below the
record's largest; the query is scaled by a power of two to |q| < 512 and split into fp16 hi + lo
(bf16 queries: hi only), so products are exact and sums are fp32; the powers of two are applied
to the fp32 logits.  The dequantisation is either portable Triton (integer ops building fp16 bit
patterns) or, on sm_89+, inline PTX that turns four record bytes into eight fp16 values with a
few shifts/masks, ``cvt.rn.f16x2.e4m3x2`` and ``mul.rn.f16x2`` (E2M1 magnitudes placed in an
E4M3 byte are exact; the 0.5 code lands on an E4M3 subnormal, which the conversion handles).
"""

from __future__ import annotations

import functools
import os

import torch

from vllm_dsv41 import formats
from vllm_dsv41.ops import define_op
from vllm_dsv41.ops._triton import gdc_launch_dependents, gdc_wait, hw_fp8, interpreting, pdl, pdl_launch, sm_count
from vllm_dsv41.reference.model import index_scores as _reference_index_scores

__all__ = ["index_scores", "index_scores_ref"]

_REF_CHUNK = 1 << 16  # keys per step of the reference (bounds its [rows, IH, chunk] temporaries)
DECODE_ENV = "VLLM_DSV41_INDEXER_DECODE"  # "asm" / "portable": overrides the Triton dequantiser choice


# --------------------------------------------------------------------------- reference (CPU + oracle)


def index_scores_ref(q: torch.Tensor, w: torch.Tensor, idx_cache: torch.Tensor, block_table: torch.Tensor,
                     rows_per_block: int, req_of_row: torch.Tensor, n_vis: torch.Tensor, n_max: int) -> torch.Tensor:
    """Plain PyTorch: decode each request's visible records, ``reference.index_scores``, mask."""
    _check_args(q, w, idx_cache, block_table, req_of_row, n_vis)
    T, _, ID = q.shape
    out = torch.full((T, n_max), float("-inf"), dtype=torch.float32, device=q.device)
    if T == 0 or n_max == 0:
        return out
    req = req_of_row.to(torch.int64)
    nv = n_vis.to(torch.int64).clamp(0, n_max)
    qf, wf = q.float(), w.float()
    for r in req.unique().tolist():
        rows = (req == r).nonzero().flatten()
        n = int(nv[rows].max())
        for c0 in range(0, n, _REF_CHUNK):
            e = torch.arange(c0, min(n, c0 + _REF_CHUNK), device=q.device)
            slots = block_table[r].to(torch.int64)[e // rows_per_block] * rows_per_block + e % rows_per_block
            keys = formats.decode_mxfp4_record(idx_cache[slots], ID)
            s = _reference_index_scores(qf[rows], wf[rows], keys)
            vis = e[None, :] < nv[rows][:, None]
            out[rows, c0:c0 + e.numel()] = s.masked_fill(~vis, float("-inf"))
    return out


def _check_args(q, w, idx_cache, block_table, req_of_row, n_vis) -> None:
    if q.dim() != 3:
        raise ValueError(f"index_scores: q must be [T, IH, ID], got {tuple(q.shape)}")
    T, IH, ID = q.shape
    if tuple(w.shape) != (T, IH):
        raise ValueError(f"index_scores: w must be [{T}, {IH}], got {tuple(w.shape)}")
    if idx_cache.dim() != 2 or idx_cache.shape[1] != formats.mxfp4_record_bytes(ID) or idx_cache.dtype != torch.uint8:
        raise ValueError(f"index_scores: idx_cache must be uint8 [slots, {formats.mxfp4_record_bytes(ID)}]")
    if block_table.dim() != 2:
        raise ValueError(f"index_scores: block_table must be [num_reqs, max_blocks], got {tuple(block_table.shape)}")
    if tuple(req_of_row.shape) != (T,) or tuple(n_vis.shape) != (T,):
        raise ValueError("index_scores: req_of_row and n_vis must be [T]")


# --------------------------------------------------------------------------- Triton kernels

# Kernels are written as plain functions and wrapped with ``triton.jit`` by ``_kernels()`` on first
# use, so this module imports without Triton; ``tl`` and ``_DECODE_PTX`` are bound at that moment.
tl = None
_DECODE_PTX = None

# Inline PTX, bound as the ``tl.constexpr`` ``_DECODE_PTX`` by ``_kernels()``.  Four record bytes ($4)
# and their four fp16 group factors ($5, $6) -> fp16 values of the low nibbles ($0, $1) and of the
# high nibbles ($2, $3), times the factors.  A nibble s|e1 e0|m becomes the E4M3 byte s00e1 e0m00
# (the E2M1 value x 2^-6; code 1 = 0.5 lands on the subnormal 2^-7), converted two at a time.
_DECODE_PTX_SRC = """
{
.reg .b32 t, e, o;
.reg .b16 e0, e1, o0, o1;
shl.b32 t, $4, 2;
and.b32 e, t, 0x1C1C1C1C;
shl.b32 t, $4, 4;
and.b32 t, t, 0x80808080;
or.b32 e, e, t;
shr.b32 t, $4, 2;
and.b32 o, t, 0x1C1C1C1C;
and.b32 t, $4, 0x80808080;
or.b32 o, o, t;
mov.b32 {e0, e1}, e;
mov.b32 {o0, o1}, o;
cvt.rn.f16x2.e4m3x2 $0, e0;
cvt.rn.f16x2.e4m3x2 $1, e1;
cvt.rn.f16x2.e4m3x2 $2, o0;
cvt.rn.f16x2.e4m3x2 $3, o1;
mul.rn.f16x2 $0, $0, $5;
mul.rn.f16x2 $1, $1, $6;
mul.rn.f16x2 $2, $2, $5;
mul.rn.f16x2 $3, $3, $6;
}
"""


def _decode_bytes(vb, fac, ASM: tl.constexpr):
    # vb uint8 record bytes, fac fp16 group factors (same shape) -> fp16 (low nibble, high nibble)
    # values, each = E2M1 value x 2^-6 x fac (exact: one rounding of an exact product).
    if ASM:
        lo, hi = tl.inline_asm_elementwise(_DECODE_PTX, "=r,=r,=r,=r,r,r,r", [vb, fac],
                                           dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
    else:
        b = vb.to(tl.int32)
        # E2M1 magnitude bits -> fp16 exponent/mantissa bits 9..11 (value x 2^-14), sign -> bit 15
        lo16 = ((b & 7) << 9) | ((b & 8) << 12)
        hi16 = ((b & 0x70) << 5) | ((b & 0x80) << 8)
        f = fac.to(tl.float32) * 256.0  # 2^-14 -> 2^-6
        lo = (lo16.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * f).to(tl.float16)
        hi = (hi16.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * f).to(tl.float16)
    return lo, hi


def _index_scores_kernel(
    q_ptr,      # [T, IH, ID] fp32 / bf16
    w_ptr,      # [T, IH] fp32
    cache_ptr,  # uint8 [slots, ID/2 + ID/32]
    bt_ptr,     # int32 / int64 [num_reqs, max_blocks]
    req_ptr,    # int32 [T] request of each row
    nvis_ptr,   # int32 [T] visible entries of each row
    out_ptr,    # fp32 [T, n_max]
    n_max,
    stride_qt, stride_qh, stride_qd, stride_wt, stride_wh, stride_c, stride_bt, stride_o,
    IH: tl.constexpr, IH_P: tl.constexpr, ID: tl.constexpr, ROWS_PER_BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr, TILES: tl.constexpr, ALIGN: tl.constexpr,
    SPLIT_Q: tl.constexpr, ASM: tl.constexpr, F32_DOT: tl.constexpr, PDL: tl.constexpr = False,
):
    if PDL:  # programmatic dependent launch: the previous kernel first
        gdc_wait()
        gdc_launch_dependents()
    t = tl.program_id(0)
    first = tl.program_id(1) * (TILES * BLOCK_N)
    n = tl.minimum(tl.load(nvis_ptr + t), n_max)
    kk = tl.arange(0, BLOCK_N)
    orow = out_ptr + t.to(tl.int64) * stride_o
    if first >= n:  # nothing visible in this program's tiles
        for i in tl.static_range(TILES):
            s = first + i * BLOCK_N + kk
            tl.store(orow + s, tl.full([BLOCK_N], float("-inf"), tl.float32), mask=s < n_max)
    else:
        req = tl.load(req_ptr + t).to(tl.int64)
        # query of this row, even / odd dims as the K x N operands [ID/2, IH_P], scaled to |q| < 512
        hh = tl.arange(0, IH_P)
        dd = tl.arange(0, ID // 2)
        qptr = q_ptr + t.to(tl.int64) * stride_qt + hh[None, :] * stride_qh + (2 * dd)[:, None] * stride_qd
        hmask = (hh < IH)[None, :]
        q_ev = tl.load(qptr, mask=hmask, other=0.0).to(tl.float32)
        q_od = tl.load(qptr + stride_qd, mask=hmask, other=0.0).to(tl.float32)
        qmax = tl.maximum(tl.max(tl.max(tl.abs(q_ev), axis=1), axis=0), tl.max(tl.max(tl.abs(q_od), axis=1), axis=0))
        eq = tl.maximum(((qmax.to(tl.int32, bitcast=True) >> 23) & 255) - 127, -100)  # floor(log2 max|q|)
        qscale = ((135 - eq) << 23).to(tl.float32, bitcast=True)  # 2^(8 - eq)
        post = ((eq + 125) << 23).to(tl.float32, bitcast=True)  # 2^(eq - 2) = 2^(eq - 8) * 2^6
        q_ev = q_ev * qscale
        q_od = q_od * qscale
        qe_hi = q_ev.to(tl.float16)
        qo_hi = q_od.to(tl.float16)
        if SPLIT_Q:
            qe_lo = (q_ev - qe_hi.to(tl.float32)).to(tl.float16)
            qo_lo = (q_od - qo_hi.to(tl.float32)).to(tl.float16)
        wv = tl.load(w_ptr + t.to(tl.int64) * stride_wt + hh * stride_wh, mask=hh < IH, other=0.0).to(tl.float32)
        vcol = tl.arange(0, ID // 2)
        gcol = tl.arange(0, ID // 32)
        for i in tl.static_range(TILES):
            s = first + i * BLOCK_N + kk
            valid = s < n
            blk = tl.load(bt_ptr + req * stride_bt + s // ROWS_PER_BLOCK, mask=valid, other=0).to(tl.int64)
            row = tl.multiple_of((blk * ROWS_PER_BLOCK + s % ROWS_PER_BLOCK) * stride_c, ALIGN)
            vb = tl.load(cache_ptr + row[:, None] + vcol[None, :], mask=valid[:, None], other=0)  # [BN, ID/2]
            sb = tl.load(cache_ptr + row[:, None] + ID // 2 + gcol[None, :], mask=valid[:, None], other=0)
            sb = sb.to(tl.int32)  # [BN, ID/32] UE8M0 bytes
            emax = tl.max(sb, axis=1)
            rel = sb - emax[:, None]  # <= 0
            fac = tl.where(rel > -127, ((rel + 127) << 23).to(tl.float32, bitcast=True), 0.0).to(tl.float16)
            fac = tl.reshape(tl.broadcast_to(fac[:, :, None], [BLOCK_N, ID // 32, 16]), [BLOCK_N, ID // 2])
            k_lo, k_hi = _decode_bytes(vb, fac, ASM)
            if F32_DOT:  # interpreter: fp16 products are exact in fp32 too
                k_lo = k_lo.to(tl.float32)
                k_hi = k_hi.to(tl.float32)
                acc = tl.dot(k_lo, qe_hi.to(tl.float32), input_precision="ieee")
                acc = tl.dot(k_hi, qo_hi.to(tl.float32), acc, input_precision="ieee")
                if SPLIT_Q:
                    acc = tl.dot(k_lo, qe_lo.to(tl.float32), acc, input_precision="ieee")
                    acc = tl.dot(k_hi, qo_lo.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(k_lo, qe_hi)
                acc = tl.dot(k_hi, qo_hi, acc)
                if SPLIT_Q:
                    acc = tl.dot(k_lo, qe_lo, acc)
                    acc = tl.dot(k_hi, qo_lo, acc)
            # 2^(emax - 127) x 2^(eq - 2): undoes the key, query and 2^-6 scalings (fp32 range assumed)
            kscale = tl.where(emax > 0, emax << 23, 0x400000).to(tl.float32, bitcast=True) * post
            logits = tl.maximum(acc * kscale[:, None], 0.0)
            score = tl.sum(logits * wv[None, :], axis=1)
            tl.store(orow + s, tl.where(valid, score, float("-inf")), mask=s < n_max)


_JIT_FUNCTIONS = ("_decode_bytes", "_index_scores_kernel")
_NOT_SPECIALISED = {"_index_scores_kernel": ("stride_bt",)}
"""Per kernel, the integer arguments Triton should not specialise on: the block table's width varies with the batch
and is only the stride of a gather."""


@functools.lru_cache(maxsize=None)
def _kernels():
    """Import Triton and turn the kernel functions above into JIT functions (once per process)."""
    import triton
    import triton.language

    module = globals()
    module["tl"] = triton.language
    module["_DECODE_PTX"] = triton.language.constexpr(_DECODE_PTX_SRC)
    for name in _JIT_FUNCTIONS:
        module[name] = triton.jit(module[name], do_not_specialize=_NOT_SPECIALISED.get(name))
    return module["_index_scores_kernel"]


def _index_scores_triton(q: torch.Tensor, w: torch.Tensor, idx_cache: torch.Tensor, block_table: torch.Tensor,
                         rows_per_block: int, req_of_row: torch.Tensor, n_vis: torch.Tensor, n_max: int, *,
                         decode: str | None = None, tiles: int | None = None, block_n: int = 128,
                         num_warps: int = 4) -> torch.Tensor:
    """Launch the kernel.  ``decode``: "asm" (inline PTX, sm_89+), "portable" (Triton integer ops)
    or None (asm on sm_89+ GPUs, portable otherwise and under the interpreter).  ``tiles``: key tiles
    of ``block_n`` records per program (default: enough programs to fill the GPU, at most 8 each)."""
    _check_args(q, w, idx_cache, block_table, req_of_row, n_vis)
    T, IH, ID = q.shape
    if ID < 32 or ID & (ID - 1):
        raise ValueError(f"index_scores (Triton): ID={ID} must be a power of two >= 32")
    if idx_cache.stride(1) != 1:
        raise ValueError("index_scores (Triton): cache records must be contiguous")
    out = torch.empty((T, n_max), dtype=torch.float32, device=q.device)
    if T == 0 or n_max == 0:
        return out
    interp = interpreting()
    if decode is None:
        decode = os.environ.get(DECODE_ENV) or (
            "asm" if not interp and hw_fp8(q) else "portable")
    if decode not in ("asm", "portable") or (decode == "asm" and interp):
        raise ValueError(f"index_scores (Triton): decode={decode!r} is not available here")
    kernel = _kernels()
    n_tiles = -(-n_max // block_n)
    if tiles is None:  # enough tiles per program to amortise the query load, while filling the GPU
        tiles = 1
        if q.is_cuda:
            target = 4 * sm_count(q.device)
            while tiles < 8 and T * n_tiles // (2 * tiles) >= target:
                tiles *= 2
    align = 1
    while align < 16 and idx_cache.stride(0) % (2 * align) == 0 and idx_cache.data_ptr() % (2 * align) == 0:
        align *= 2
    grid = (T, -(-n_tiles // tiles))
    kernel[grid](
        q, w, idx_cache, block_table, req_of_row.to(torch.int32).contiguous(), n_vis.to(torch.int32).contiguous(),
        out, n_max,
        q.stride(0), q.stride(1), q.stride(2), w.stride(0), w.stride(1), idx_cache.stride(0), block_table.stride(0),
        out.stride(0),
        IH=IH, IH_P=max(16, 1 << (IH - 1).bit_length()), ID=ID, ROWS_PER_BLOCK=rows_per_block,
        BLOCK_N=block_n, TILES=tiles, ALIGN=align,
        SPLIT_Q=q.dtype != torch.bfloat16, ASM=decode == "asm", F32_DOT=interp,
        num_warps=num_warps,
        **pdl_launch(pdl(q)),
    )
    return out


# --------------------------------------------------------------------------- registration


def _index_scores_fake(q, w, idx_cache, block_table, rows_per_block, req_of_row, n_vis, n_max):
    return q.new_empty((q.shape[0], n_max), dtype=torch.float32)


index_scores = define_op(
    "index_scores",
    "(Tensor q, Tensor w, Tensor idx_cache, Tensor block_table, int rows_per_block, Tensor req_of_row, "
    "Tensor n_vis, SymInt n_max) -> Tensor",
    index_scores_ref,
    _index_scores_triton,
    _index_scores_fake,
)
