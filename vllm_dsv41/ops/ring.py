"""``dsv41::ring_step`` - a ratio-2 compressor's partner rows and its ring write, for one step.

Specification: architecture.md §2.5.4 (the ratio-2 compressor pools positions p-1 and p; the ring keeps each
request's last positions for the next step) and the model's torch route (``Attention._partners`` then
``Attention._ring_write``), which this op replaces on the ops path.

For every step row t (position p = positions[t], request r = req[t]):

    prev[t] = rows[t-1]                                   if row t-1 is request r at position p-1 (same step)
            = ring[ring_blocks[r] * capacity + (p-1) % capacity]   otherwise (the request's ring, before this step)

then, after every read, for the rows among each request's last ``capacity`` positions of the step
(p > seq_lens[r] - 1 - capacity) with ring_slots[t] >= 0:

    ring[ring_slots[t]] = rows[t]

Slots are engine slots (row ``s % rows_per_block`` of block ``s // rows_per_block``); ``ring`` is the cache's flat
view (``DSV41CacheLayer.flat_rows``), where slot s is row ``(s // rows_per_block) * bstep + (s % rows_per_block) *
rstep``.  Shapes: rows [T, W] (fp32 or bf16), positions / req int64 [T], seq_lens / ring_blocks [R] (any integer
dtype), ring_slots int64 [T], ring [n, W] fp32 (written in place) -> prev [T, W] in the promoted dtype of rows and
ring (as ``torch.where`` of the two gives it).

Why an op: the torch route is ~20 small launches a ratio-2 KV-source layer and step (index arithmetic, the ring
gather, a where, the masked scatter), on the side stream's chain that the attention waits for (beside ``wq_b``,
``model_executor/overlap.py``); here two launches (every read, then every write, so a row's read never sees this
step's writes, whatever the rows per request).
"""

from __future__ import annotations

import functools

import torch

from vllm_dsv41.ops import define_op
from vllm_dsv41.ops._triton import ROW_COUNT_ARGS, gdc_launch_dependents, gdc_wait, pdl, pdl_launch

__all__ = ["ring_step", "ring_step_ref"]


def _flat(slots: torch.Tensor, rows_per_block: int, bstep: int, rstep: int) -> torch.Tensor:
    return (slots // rows_per_block) * bstep + (slots % rows_per_block) * rstep


def _check(rows, positions, req, seq_lens, ring_blocks, ring_slots, ring) -> None:
    T = rows.shape[0]
    if rows.dim() != 2 or ring.dim() != 2 or rows.shape[1] != ring.shape[1]:
        raise ValueError(f"ring_step: rows [T, W] and ring [n, W] expected, got {tuple(rows.shape)} and "
                         f"{tuple(ring.shape)}")
    for name, t in (("positions", positions), ("req", req), ("ring_slots", ring_slots)):
        if t.shape != (T,):
            raise ValueError(f"ring_step: {name} must be [T={T}], got {tuple(t.shape)}")
    if seq_lens.dim() != 1 or ring_blocks.shape != seq_lens.shape:
        raise ValueError(f"ring_step: seq_lens and ring_blocks must be [R], got {tuple(seq_lens.shape)} and "
                         f"{tuple(ring_blocks.shape)}")


def ring_step_ref(rows: torch.Tensor, positions: torch.Tensor, req: torch.Tensor, seq_lens: torch.Tensor,
                  ring_blocks: torch.Tensor, ring_slots: torch.Tensor, ring: torch.Tensor, capacity: int,
                  rows_per_block: int, bstep: int, rstep: int) -> torch.Tensor:
    """Plain PyTorch (the CPU implementation and the test oracle): the model's torch route on the flat view.  The
    write redirects skipped rows to flat row 0 of the null block, rewriting the value it holds (no host sync, as
    ``DSV41CacheLayer.write``)."""
    _check(rows, positions, req, seq_lens, ring_blocks, ring_slots, ring)
    pos, req = positions.to(torch.int64), req.to(torch.int64)
    t = torch.arange(rows.shape[0], device=rows.device)
    before = (t - 1).clamp(min=0)
    in_step = (t > 0) & (req[before] == req) & (pos[before] == pos - 1)
    src = ring_blocks.to(torch.int64)[req] * capacity + (pos - 1) % capacity
    prev = torch.where(in_step[:, None], rows[before], ring[_flat(src, rows_per_block, bstep, rstep)])
    keep = (pos > seq_lens.to(torch.int64)[req] - 1 - capacity) & (ring_slots >= 0)
    dst = torch.where(keep, _flat(ring_slots.to(torch.int64), rows_per_block, bstep, rstep), 0)
    ring[dst] = torch.where(keep[:, None], rows.to(ring.dtype), ring[0])
    return prev


# --------------------------------------------------------------------------- Triton kernel

tl = None  # triton.language, bound by _kernels()


def _ring_step_kernel(rows_ptr, pos_ptr, req_ptr, seq_ptr, rb_ptr, slot_ptr, ring_ptr, prev_ptr, T, W,
                      stride_rows, stride_ring, stride_prev, capacity, rows_per_block, bstep, rstep,
                      WRITE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    # program (row t, column block); WRITE 0: prev[t], 1: the ring write of row t (a second launch)
    if PDL:  # programmatic dependent launch: the previous kernel first
        gdc_wait()
        gdc_launch_dependents()
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < W
    p = tl.load(pos_ptr + t)
    r = tl.load(req_ptr + t)
    if WRITE:
        slot = tl.load(slot_ptr + t)
        keep = (p > tl.load(seq_ptr + r).to(tl.int64) - 1 - capacity) & (slot >= 0)
        if keep:
            dst = (slot // rows_per_block) * bstep + (slot % rows_per_block) * rstep
            v = tl.load(rows_ptr + t.to(tl.int64) * stride_rows + cols, mask=ok)
            tl.store(ring_ptr + dst * stride_ring + cols, v.to(ring_ptr.dtype.element_ty), mask=ok)
    else:
        tb = tl.maximum(t - 1, 0)
        in_step = (t > 0) & (tl.load(req_ptr + tb) == r) & (tl.load(pos_ptr + tb) == p - 1)
        out = prev_ptr + t.to(tl.int64) * stride_prev + cols
        # both branches convert to prev's dtype: rows (bf16) and ring (fp32) differ, and Triton's compiler wants one
        # type per variable after the if (the interpreter does not check it)
        if in_step:
            v = tl.load(rows_ptr + tb.to(tl.int64) * stride_rows + cols, mask=ok).to(prev_ptr.dtype.element_ty)
        else:
            back = p - 1
            src = tl.load(rb_ptr + r).to(tl.int64) * capacity + (back % capacity + capacity) % capacity
            srow = (src // rows_per_block) * bstep + (src % rows_per_block) * rstep
            v = tl.load(ring_ptr + srow * stride_ring + cols, mask=ok).to(prev_ptr.dtype.element_ty)
        tl.store(out, v, mask=ok)


@functools.lru_cache(maxsize=None)
def _kernels():
    import triton
    import triton.language

    module = globals()
    module["tl"] = triton.language
    module["_ring_step_kernel"] = triton.jit(_ring_step_kernel, do_not_specialize=ROW_COUNT_ARGS)
    return module["_ring_step_kernel"]


BLOCK = 1024


def _ring_step_triton(rows: torch.Tensor, positions: torch.Tensor, req: torch.Tensor, seq_lens: torch.Tensor,
                      ring_blocks: torch.Tensor, ring_slots: torch.Tensor, ring: torch.Tensor, capacity: int,
                      rows_per_block: int, bstep: int, rstep: int) -> torch.Tensor:
    """Two launches over (rows, column blocks): every partner row read, then every ring write."""
    _check(rows, positions, req, seq_lens, ring_blocks, ring_slots, ring)
    if rows.stride(1) != 1 or ring.stride(1) != 1:
        raise ValueError("ring_step (Triton): rows and ring rows must be contiguous")
    T, W = rows.shape
    prev = torch.empty(T, W, dtype=torch.promote_types(rows.dtype, ring.dtype), device=rows.device)
    if T == 0:
        return prev
    kernel = _kernels()
    args = (rows, positions.to(torch.int64).contiguous(), req.to(torch.int64).contiguous(), seq_lens.contiguous(),
            ring_blocks.contiguous(), ring_slots.to(torch.int64).contiguous(), ring, prev, T, W, rows.stride(0),
            ring.stride(0), prev.stride(0), capacity, rows_per_block, bstep, rstep)
    block = min(BLOCK, 1 << max(0, (W - 1).bit_length()))
    grid = (T, -(-W // block))
    on = pdl(rows)
    kernel[grid](*args, WRITE=False, BLOCK=block, num_warps=4, **pdl_launch(on))
    kernel[grid](*args, WRITE=True, BLOCK=block, num_warps=4, **pdl_launch(on))
    return prev


def _ring_step_fake(rows, positions, req, seq_lens, ring_blocks, ring_slots, ring, capacity, rows_per_block,
                    bstep, rstep):
    return rows.new_empty(rows.shape, dtype=torch.promote_types(rows.dtype, ring.dtype))


ring_step = define_op(
    "ring_step",
    "(Tensor rows, Tensor positions, Tensor req, Tensor seq_lens, Tensor ring_blocks, Tensor ring_slots, "
    "Tensor(a!) ring, int capacity, int rows_per_block, int bstep, int rstep) -> Tensor",
    ring_step_ref,
    _ring_step_triton,
    _ring_step_fake,
)
