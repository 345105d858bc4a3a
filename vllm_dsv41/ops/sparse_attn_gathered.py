"""Sparse attention through FlashMLA's sparse prefill kernel on gathered bf16 keys (a Hopper prefill path).

Same maths and arguments as ``dsv41::sparse_attn`` (:mod:`vllm_dsv41.ops.sparse_attn`), another route:

1. **Gather plan** (:func:`gather_plan`): the cache blocks a step's slot lists touch, and for every listed slot
   its row in a workspace that holds those blocks' records one after another.  No sort: the touched blocks are
   marked in a per-block table (``scatter_reduce`` max), numbered by a prefix sum, and scattered to their ranks in
   a list sized by a host-side bound (the blocks the step's requests can reach: no host read, so the host keeps
   running ahead of the GPU; ``nonzero`` without a bound).  The model computes one plan per slot list and step and
   shares it between the layers that read the same list.
2. **Workspace**: every record of those blocks decoded to bf16 (exact: a record element has at most 8
   significant bits), the SWA table then the compressed one.
3. **Kernel**: vLLM 0.32's ``flash_mla_sparse_fwd`` (FlashMLA's sparse prefill: bf16 q and keys, per-row key
   indices, the attention sink; MQA with D = 512), the kernel vLLM's own V4.1 runs for prefill on Hopper after
   a similar gather.  Its sparse *decode* kernel documents our very record formats but refuses them on SM90
   (``benchmarks/ops/flashmla_probe.py``), hence the workspace.
4. **Inverse RoPE** of the output (``dsv41::rope`` at the negated positions).

Why (H200, docs/benchmarks.md session 10): at 4,096 prefill rows FlashMLA's kernel took 654 µs against
``sparse_attn``'s 2,752 on the records; end to end, with the gather, a 32k prompt's prefill went from 1.70 to
1.54 s.  So it is the default for prefill-sized steps where it applies (``VLLM_DSV41_PREFILL_ATTN=auto``);
``sparse_attn`` is the comparison path (``VLLM_DSV41_PREFILL_ATTN=sparse_attn``); decode-sized steps take the
decode-rows route below.
On CPU (tests) ``kernel`` is :func:`sparse_fwd_ref`, a float64 stand-in with the kernel's contract.

**Decode rows** (``VLLM_DSV41_DECODE_ATTN=flashmla``, the default since session 19: at batch 64 its kernels take 1.67
against 2.29 ms a step (session 18), the decode step 18.27 against 18.78 ms in session 19's timeline, the
side-by-side +0.4% and +1.3%; ``sparse_attn`` is the comparison path): rows share no keys there, so
instead of a block plan each row's own listed records are decoded into its own stretch of the workspace
(:func:`row_keys`: one Triton program per row and tile of keys, the record decoders of ``sparse_attn``) and the same
FlashMLA kernel runs on them (:func:`sparse_attn_rows`).  Why try it: at 64 decode rows ``sparse_attn`` takes 64 µs
a layer (register spills), while FlashMLA's kernel does a 640-key row in ~21 µs on one SM (session 10's 4,096-row
figure); the gather writes ~42 MB at 64 rows.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import torch

from vllm_dsv41 import formats
from vllm_dsv41.ops.sparse_attn import _decoded_union
from vllm_dsv41.reference.model import sparse_attention

logger = logging.getLogger(__name__)

ENV = "VLLM_DSV41_PREFILL_ATTN"
"""``auto`` (default) or ``flashmla``: prefill rows go through this path where it applies (:func:`applies`);
``sparse_attn``: every row through ``dsv41::sparse_attn``."""
MODES = ("auto", "flashmla", "sparse_attn")
READBACK_ENV = "VLLM_DSV41_PLAN_READBACK"
"""``1``: gather plans read their block list back with ``nonzero`` (a host read per plan, session 11's behaviour,
for comparison) instead of sizing it by the host-side bound."""
MIN_ROWS = 256
"""Steps with fewer attention rows (decode) keep ``sparse_attn`` (or take :func:`sparse_attn_rows`)."""
DECODE_ENV = "VLLM_DSV41_DECODE_ATTN"
"""``sparse_attn`` (default) or ``flashmla``: steps of ``DECODE_MIN_ROWS`` to ``MIN_ROWS`` - 1 rows through
:func:`sparse_attn_rows`."""
DECODE_MODES = ("sparse_attn", "flashmla")
DECODE_MIN_ROWS = 16
"""Fewer rows would leave most SMs idle in FlashMLA's kernel (one CTA a row): they keep ``sparse_attn``'s split-KV."""
ROW_KEYS_BLOCK = 16
"""Keys a program of :func:`row_keys`' kernel decodes."""
INDEX_ALIGN = 128
"""The combined index lists are padded with -1 to a multiple of this (as vLLM pads them for the kernel)."""
FLASHMLA_HEADS = (64, 128)
"""Query head counts the FlashMLA kernels take."""
_switched_off: str | None = None
"""Why this process stopped taking the path (:func:`switch_off`), or None."""


@dataclass(frozen=True)
class GatherPlan:
    """Which blocks of a flat cache view a slot list touches, and where each listed slot lands."""

    blocks: torch.Tensor  # int64 [n] touched blocks, ascending
    rows: torch.Tensor    # int32 [R, N] workspace row of each listed slot, -1 where the list has -1
    rows_per_block: int


def gather_plan(slots: torch.Tensor, bstep: int, rstep: int, rows_per_block: int, n_flat: int,
                max_blocks: int | None = None) -> GatherPlan:
    """Plan for ``slots`` [R, N] (rows of a flat cache view with block step ``bstep`` and row step ``rstep``,
    ``CacheLayer.flat_rows``; ``n_flat`` rows in the view; -1 = none): slot ``b * bstep + i * rstep`` lands
    on workspace row ``rank(b) * rows_per_block + i``.

    ``max_blocks``: an upper bound on the blocks the slots touch, known on the host (:func:`swa_block_bound`,
    :func:`entry_block_bound`).  With it the plan is made without a host read: the touched blocks are scattered to
    their ranks in a list of ``max_blocks`` entries, whose unused tail repeats block 0 (decoded, never indexed).
    Without it (None) the list is read back through ``nonzero``, which waits for the device."""
    valid = slots >= 0
    s = torch.where(valid, slots, 0).to(torch.int64)
    blk = s // bstep
    off = (s - blk * bstep) // rstep
    n_blocks = (n_flat - 1) // bstep + 1
    mark = torch.zeros(n_blocks, dtype=torch.int32, device=slots.device)
    mark.scatter_reduce_(0, blk.flatten(), valid.flatten().to(torch.int32), "amax")
    rank = torch.cumsum(mark, 0) - 1
    rows = torch.where(valid, rank[blk] * rows_per_block + off, -1).to(torch.int32)
    if max_blocks is None:
        return GatherPlan(mark.nonzero().squeeze(1), rows, rows_per_block)
    n = min(max_blocks, n_blocks)
    dst = torch.where(mark > 0, rank, n).clamp(max=n)  # untouched blocks go to a spare entry past the list
    blocks = torch.zeros(n + 1, dtype=torch.int64, device=slots.device)
    blocks.scatter_(0, dst.to(torch.int64), torch.arange(n_blocks, device=slots.device))
    return GatherPlan(blocks[:n], rows, rows_per_block)


def swa_block_bound(first: torch.Tensor, last: torch.Tensor, window: int, rows_per_block: int) -> int:
    """Most blocks of a per-position cache that the rows of requests spanning positions ``first[i]..last[i]``
    (host tensors) can list with a window of ``window`` keys: the blocks of positions max(first - window + 1, 0)
    .. last of every request (a block shared by two requests counts twice)."""
    lo = (first.to(torch.int64) - window + 1).clamp(min=0)
    hi = last.to(torch.int64)
    return int((hi // rows_per_block - lo // rows_per_block + 1).clamp(min=0).sum())


def entry_block_bound(last: torch.Tensor, ratio: int, rows_per_block: int) -> int:
    """Most blocks of a compressed cache (an entry per ``ratio`` positions) that rows of requests whose last
    position is ``last[i]`` (host tensor) can select from: every visible entry, (last + 1) // ratio of them."""
    n = (last.to(torch.int64) + 1).clamp(min=0) // ratio
    return int(((n + rows_per_block - 1) // rows_per_block).sum())


def gather_keys(flat: torch.Tensor, plan: GatherPlan, bstep: int, rstep: int, decode) -> torch.Tensor:
    """bf16 keys [n * rows_per_block, D] of the plan's blocks (every row of each, in order), from the flat
    view's records through ``decode`` (records -> fp32 [n, D])."""
    e = plan.rows_per_block
    f = plan.blocks[:, None] * bstep + torch.arange(e, device=flat.device)[None, :] * rstep
    return decode(flat[f.flatten()]).to(torch.bfloat16)


def sparse_fwd_ref(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float, d_v: int = 512,
                   attn_sink: torch.Tensor | None = None) -> tuple[torch.Tensor]:
    """Stand-in for ``flash_mla_sparse_fwd`` with its contract: q [T, H, D] bf16, kv [S, 1, D] bf16, indices
    [T, 1, N] int32 (-1 or >= S: none) -> (out [T, H, d_v] bf16,), softmax over each row's listed keys with the
    sink; computed in float64 by the reference's ``sparse_attention`` (the tests' kernel on CPU)."""
    T, S = q.shape[0], kv.shape[0]
    idx = indices[:, 0].long()
    idx = torch.where(idx < S, idx, -1)
    out = torch.zeros(T, q.shape[1], d_v, dtype=torch.float32, device=q.device)
    sink = attn_sink.float() if attn_sink is not None else torch.full((q.shape[1],), float("-inf"))
    for lo in range(0, T, 64):
        hi = min(lo + 64, T)
        keys, mask = _decoded_union(kv[:, 0], idx[lo:hi], lambda rows: rows.float())
        if keys.shape[0]:
            out[lo:hi] = sparse_attention(q[lo:hi].float(), keys, mask, sink, scale)[..., :d_v]
    return (out.to(q.dtype),)


@functools.cache
def flashmla_sparse_fwd():
    """vLLM's ``flash_mla_sparse_fwd``, or None where it cannot be imported (CPU wheels, no GPU)."""
    try:
        from vllm.third_party.flashmla.flash_mla_interface import flash_mla_sparse_fwd
    except Exception:  # noqa: BLE001 - any import failure means "not here"
        return None
    return flash_mla_sparse_fwd


def read_back() -> bool:
    """``VLLM_DSV41_PLAN_READBACK=1``: plans through ``nonzero`` (see :data:`READBACK_ENV`)."""
    return os.environ.get(READBACK_ENV, "0").strip() == "1"


def _env_choice(env: str, default: str, choices: tuple[str, ...]) -> str:
    """The environment's value of ``env``, checked (a misspelt value is an error, not a silent fallback)."""
    m = os.environ.get(env, default).strip().lower() or default
    if m not in choices:
        raise ValueError(f"{env}={m!r}: expected one of {', '.join(choices)}")
    return m


def mode() -> str:
    """``VLLM_DSV41_PREFILL_ATTN``, checked."""
    return _env_choice(ENV, "auto", MODES)


def decode_mode() -> str:
    """``VLLM_DSV41_DECODE_ATTN``, checked."""
    return _env_choice(DECODE_ENV, "flashmla", DECODE_MODES)


def _kernel_takes(q: torch.Tensor) -> bool:
    """bf16 q of 512 dims and a head count FlashMLA's kernel takes, on a GPU where it imports, the path not switched
    off."""
    return (q.is_cuda and q.dtype == torch.bfloat16 and q.shape[-1] == 512 and q.shape[1] in FLASHMLA_HEADS
            and _switched_off is None and flashmla_sparse_fwd() is not None)


def applies(q: torch.Tensor, rows: int) -> bool:
    """Whether the model sends these attention rows here: a prefill-sized step, not switched off
    (``VLLM_DSV41_PREFILL_ATTN``), a q the kernel takes."""
    return rows >= MIN_ROWS and mode() != "sparse_attn" and _kernel_takes(q)


def applies_rows(q: torch.Tensor, rows: int) -> bool:
    """Whether decode-sized steps go through :func:`sparse_attn_rows`: not switched off (``VLLM_DSV41_DECODE_ATTN``),
    ``DECODE_MIN_ROWS`` to ``MIN_ROWS`` - 1 rows, a q the kernel takes."""
    return DECODE_MIN_ROWS <= rows < MIN_ROWS and decode_mode() == "flashmla" and _kernel_takes(q)


def switch_off(exc: BaseException) -> None:
    """After the path failed on a step (the model then serves it through ``sparse_attn``): no more steps here in
    this process, said once in the log."""
    global _switched_off
    if _switched_off is None:
        _switched_off = f"{type(exc).__name__}: {exc}"
        logger.warning("vllm-dsv41: FlashMLA attention on gathered keys failed (%s); attention runs through "
                       "dsv41::sparse_attn from now on", _switched_off, exc_info=exc)


def combined_indices(swa_plan: GatherPlan, comp_plan: GatherPlan | None, n_swa_rows: int) -> torch.Tensor:
    """[R, 1, N] int32: each row's SWA workspace rows, then its compressed ones shifted past the SWA table, -1
    padded to a multiple of ``INDEX_ALIGN``."""
    parts = [swa_plan.rows]
    if comp_plan is not None:
        c = comp_plan.rows
        parts.append(torch.where(c >= 0, c + n_swa_rows, -1).to(torch.int32))
    idx = torch.cat(parts, 1)
    pad = -idx.shape[1] % INDEX_ALIGN
    if pad:
        idx = torch.cat((idx, idx.new_full((idx.shape[0], pad), -1)), 1)
    return idx.unsqueeze(1).contiguous()


def sparse_attn_gathered(q: torch.Tensor, swa_flat: torch.Tensor, swa_plan: GatherPlan, swa_steps: tuple[int, int],
                         comp_flat: torch.Tensor | None, comp_plan: GatherPlan | None,
                         comp_steps: tuple[int, int] | None, sink: torch.Tensor, scale: float,
                         positions: torch.Tensor, inv_freq: torch.Tensor, kernel=None) -> torch.Tensor:
    """``sparse_attn`` of q [T, Hq, D] over the SWA and compressed records its plans list (``*_steps`` =
    (bstep, rstep) of each flat view), through ``kernel`` (default: FlashMLA's) on the gathered bf16 keys,
    inverse RoPE included.  Returns [T, Hq, D] in q's dtype."""
    from vllm_dsv41.ops import rope as rope_op

    D = q.shape[-1]
    kv = [gather_keys(swa_flat, swa_plan, *swa_steps, lambda r: formats.decode_mxfp8_record(r, D))]
    if comp_plan is not None:
        kv.append(gather_keys(comp_flat, comp_plan, *comp_steps, lambda r: formats.decode_nvfp4_record(r, D)))
    idx = combined_indices(swa_plan, comp_plan, kv[0].shape[0])
    kv = torch.cat(kv).unsqueeze(1).contiguous()
    kernel = kernel or flashmla_sparse_fwd()
    out = kernel(q.contiguous(), kv, idx, scale, D, attn_sink=sink.float().contiguous())[0]
    out = out.to(q.dtype)  # the kernel's fresh output: rotated back in place
    rope_op.rope_(out, -positions, inv_freq)
    return out


# --------------------------------------------------------------------------- decode rows: each row's own keys


def row_keys_ref(swa_cache: torch.Tensor, swa_slots: torch.Tensor, comp_cache: torch.Tensor | None,
                 comp_slots: torch.Tensor | None, D: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys [T * N, 1, D] bf16, indices [T, 1, N] int32): row t's SWA records then its compressed ones decoded
    into rows t * N .. t * N + W + K of the workspace (N = W + K padded to ``INDEX_ALIGN``), and each listed slot's
    workspace row in ``indices`` (-1 where the list has -1 and in the padding; those workspace rows hold zeros)."""
    T, W = swa_slots.shape
    K = comp_slots.shape[1] if comp_slots is not None else 0
    N = -(-(W + K) // INDEX_ALIGN) * INDEX_ALIGN
    keys = torch.zeros(T, N, D, dtype=torch.bfloat16, device=swa_slots.device)
    valid = torch.zeros(T, N, dtype=torch.bool, device=swa_slots.device)
    parts = [(swa_cache, swa_slots, 0, formats.decode_mxfp8_record)]
    if comp_slots is not None:
        parts.append((comp_cache, comp_slots, W, formats.decode_nvfp4_record))
    for cache, slots, c0, decode in parts:
        ok = slots >= 0
        rec = cache[torch.where(ok, slots, 0).long().flatten()]
        dec = decode(rec, D).reshape(T, slots.shape[1], D)
        keys[:, c0:c0 + slots.shape[1]] = torch.where(ok[..., None], dec, 0.0).to(torch.bfloat16)
        valid[:, c0:c0 + slots.shape[1]] = ok
    rows = torch.arange(T * N, device=swa_slots.device, dtype=torch.int32).view(T, N)
    return keys.view(T * N, 1, D), torch.where(valid, rows, -1).unsqueeze(1)


def row_keys(swa_cache: torch.Tensor, swa_slots: torch.Tensor, comp_cache: torch.Tensor | None,
             comp_slots: torch.Tensor | None, D: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`row_keys_ref`'s result; on a GPU (or under Triton's interpreter) one kernel launch per record kind
    (the keys' rows for padding columns are left unwritten: no index points at them)."""
    from vllm_dsv41.ops import triton_available
    from vllm_dsv41.ops._triton import interpreting

    if not (swa_slots.is_cuda and triton_available()) and not interpreting():
        return row_keys_ref(swa_cache, swa_slots, comp_cache, comp_slots, D)
    return _row_keys_triton(swa_cache, swa_slots, comp_cache, comp_slots, D)


def _row_keys_triton(swa_cache, swa_slots, comp_cache, comp_slots, D: int, hw_fp8: bool | None = None):
    import triton

    from vllm_dsv41.ops import sparse_attn as sa
    from vllm_dsv41.ops._triton import hw_fp8 as _hw_fp8

    T, W = swa_slots.shape
    K = comp_slots.shape[1] if comp_slots is not None else 0
    N = -(-(W + K) // INDEX_ALIGN) * INDEX_ALIGN
    dev = swa_slots.device
    keys = torch.empty(T * N, 1, D, dtype=torch.bfloat16, device=dev)
    idx = torch.full((T, 1, N), -1, dtype=torch.int32, device=dev)
    hw = _hw_fp8(swa_slots) if hw_fp8 is None else hw_fp8
    parts = [(swa_cache, swa_slots, 0, 0)]
    if comp_slots is not None:
        parts.append((comp_cache, comp_slots, W, 1))
    for cache, slots, c0, kind in parts:
        if slots.shape[1] == 0 or T == 0:
            continue
        cache = cache if cache.stride(1) == 1 else cache.contiguous()
        slots = sa._slot_list(slots)
        slots = slots if slots.stride(1) == 1 else slots.contiguous()
        rec16 = cache.view(torch.int16) if kind == 0 else cache
        grid = (T, triton.cdiv(slots.shape[1], ROW_KEYS_BLOCK))
        sa._row_keys_kernel[grid](cache, rec16, cache.stride(0), rec16.stride(0), slots, slots.stride(0),
                                  slots.shape[1], c0, keys, idx, N, KIND=kind, D=D, BLOCK_N=ROW_KEYS_BLOCK,
                                  HW_FP8=bool(hw), ALIGNED=sa._rows_aligned(cache), num_warps=4)
    return keys, idx


def sparse_attn_rows(q: torch.Tensor, swa_cache: torch.Tensor, swa_slots: torch.Tensor,
                     comp_cache: torch.Tensor | None, comp_slots: torch.Tensor | None, sink: torch.Tensor,
                     scale: float, positions: torch.Tensor, inv_freq: torch.Tensor, kernel=None) -> torch.Tensor:
    """``sparse_attn`` (same arguments: the caches as flat record views, the slot lists) through FlashMLA's kernel
    (or ``kernel``) on each row's own decoded keys (:func:`row_keys`), inverse RoPE included."""
    from vllm_dsv41.ops import rope as rope_op

    D = q.shape[-1]
    keys, idx = row_keys(swa_cache, swa_slots, comp_cache, comp_slots, D)
    kernel = kernel or flashmla_sparse_fwd()
    out = kernel(q.contiguous(), keys, idx, scale, D, attn_sink=sink.float().contiguous())[0]
    out = out.to(q.dtype)
    rope_op.rope_(out, -positions, inv_freq)
    return out
