"""``dsv41::paged_rows`` - cache rows of per-request entries through a block table, one launch.

``paged_rows(block_table [N, M], req [R], entries [R, K], rows_per_block E, bstep, rstep)`` ->
int64 [R, K]: for entry j >= 0 of row r, ``block_table[req[r], min(j // E, M - 1)] * bstep + (j % E) *
rstep``, else -1.  With (bstep, rstep) = (E, 1) that is the engine slot; with a cache's flat-view
geometry (``CacheLayer.flat_rows``) it is the row the ops read.  Why an op: in torch this is eleven
launches (casts, masks, two clamps, the gather, the arithmetic, the select), and the model needs it
for the SWA keys of every group and the selected compressed entries of every KV source, each step.
"""

from __future__ import annotations

import functools

import torch

from vllm_dsv41.ops import define_op
from vllm_dsv41.ops._triton import gdc_launch_dependents, gdc_wait, pdl, pdl_launch

__all__ = ["paged_rows", "paged_rows_ref"]


def paged_rows_ref(block_table: torch.Tensor, req: torch.Tensor, entries: torch.Tensor, rows_per_block: int,
                   bstep: int, rstep: int) -> torch.Tensor:
    e = rows_per_block
    ent = entries.to(torch.int64)
    valid = ent >= 0
    ent = ent.clamp(min=0)
    col = (ent // e).clamp(max=block_table.shape[1] - 1)
    blocks = block_table.to(torch.int64)[req.to(torch.int64)[:, None], col]
    return torch.where(valid, blocks * bstep + (ent % e) * rstep, -1)


tl = None  # triton.language, bound by _kernels()


def _paged_rows_kernel(bt_ptr, req_ptr, ent_ptr, out_ptr, K, M, stride_bt, stride_ent, stride_out, bstep, rstep,
                       E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:  # programmatic dependent launch: the previous kernel first
        gdc_wait()
        gdc_launch_dependents()
    r = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    inb = k < K
    ent = tl.load(ent_ptr + r * stride_ent + k, mask=inb, other=-1).to(tl.int64)
    valid = ent >= 0
    ent = tl.maximum(ent, 0)
    col = tl.minimum(ent // E, M - 1)
    req = tl.load(req_ptr + r).to(tl.int64)
    blk = tl.load(bt_ptr + req * stride_bt + col, mask=inb & valid, other=0).to(tl.int64)
    rows = tl.where(valid, blk * bstep + (ent % E) * rstep, -1)
    tl.store(out_ptr + r * stride_out + k, rows, mask=inb)


@functools.lru_cache(maxsize=None)
def _kernels():
    import triton
    import triton.language

    module = globals()
    module["tl"] = triton.language
    # the block table's width varies with the batch; it is only a bound and the stride of a gather
    module["_paged_rows_kernel"] = triton.jit(_paged_rows_kernel, do_not_specialize=["M", "stride_bt"])
    return module["_paged_rows_kernel"]


def _paged_rows_triton(block_table: torch.Tensor, req: torch.Tensor, entries: torch.Tensor, rows_per_block: int,
                       bstep: int, rstep: int) -> torch.Tensor:
    R, K = entries.shape
    out = torch.empty(R, K, dtype=torch.int64, device=entries.device)
    if R == 0 or K == 0:
        return out
    if entries.stride(1) != 1:
        entries = entries.contiguous()
    if block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    block = min(1024, max(16, 1 << (K - 1).bit_length()))
    _kernels()[(R, -(-K // block))](block_table, req.contiguous(), entries, out, K, block_table.shape[1],
                                    block_table.stride(0), entries.stride(0), out.stride(0), bstep, rstep,
                                    E=rows_per_block, BLOCK_K=block, num_warps=4, **pdl_launch(pdl(block_table)))
    return out


paged_rows = define_op(
    "paged_rows",
    "(Tensor block_table, Tensor req, Tensor entries, int rows_per_block, int bstep, int rstep) -> Tensor",
    paged_rows_ref,
    _paged_rows_triton,
    lambda block_table, req, entries, rows_per_block, bstep, rstep: entries.new_empty(entries.shape,
                                                                                     dtype=torch.int64),
)
