"""``dsv41::l2_prefetch`` - ask the GPU's L2 for a tensor's bytes ahead of the kernel that will read them.

``l2_prefetch(t, programs, evict_last) -> ()``: a hint, no result.  ``programs`` programs issue one
``prefetch.global.L2`` per 128-byte line of ``t``'s storage; nothing waits for the lines to arrive, so the kernel ends
once its requests are issued, and a later reader of ``t`` finds in L2 what has arrived by then.  On CPU (and where
Triton is absent) it does nothing: it changes when bytes move, never what any kernel computes.

``l2_prefetch_rows(t [E, ...], rows [n] int, programs, evict_last) -> ()``: the same for the slabs ``t[rows[i]]``
(the routed experts a router chose: rows read on the device, clamped into [0, E), so no host sync and no address
outside ``t``).

Why: a batch-1 decode layer has latency-bound phases (the attention after ``wq_b``, the mHC boundaries, the router)
in which the HBM is nearly idle, followed by weight GEMVs that reach ~45% of the bandwidth because of their fixed
ramp and tail (docs/design.md, "Batch-1 budget").  Issued on a side stream at the start of such a phase, the next
GEMV's weight (when it fits the L2: the grouped ``wo_a`` is 33.5 MB of the H100's and H200's 50 MB) is fetched while
the phase runs.  ``benchmarks/ops/bench_l2_prefetch.py`` measures whether that pays.
"""

from __future__ import annotations

import torch

from vllm_dsv41.ops import define_op
from vllm_dsv41.ops._triton import HAS_TRITON, tl, triton

LINE = 128
"""Bytes of one L2 line request."""
LINES_PER_STEP = 256
"""Lines a program asks for per loop step."""


@triton.jit
def _prefetch_line(addr, EVICT_LAST: tl.constexpr = False):
    """Ask L2 for the 128-byte line at each address of ``addr`` (with the evict-last priority when ``EVICT_LAST``): a
    hint, nothing waits for it and no register is written; the addresses must lie inside the tensor."""
    if EVICT_LAST:
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.b32 $0, 0;", "=r,l", [addr],
                                  dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.b32 $0, 0;", "=r,l", [addr],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _l2_prefetch_kernel(ptr, nlines, LINES: tl.constexpr, EVICT_LAST: tl.constexpr):
    step = tl.num_programs(0) * LINES
    for start in range(tl.program_id(0) * LINES, nlines, step):
        line = tl.minimum(start + tl.arange(0, LINES), nlines - 1).to(tl.int64)
        addr = ptr + line * 128
        _prefetch_line(addr, EVICT_LAST)


@triton.jit
def _l2_prefetch_rows_kernel(ptr, rows_ptr, n_rows, n_slabs, slab_bytes, slab_lines, LINES: tl.constexpr,
                             EVICT_LAST: tl.constexpr):
    step = tl.num_programs(0) * LINES
    total = n_rows * slab_lines
    for start in range(tl.program_id(0) * LINES, total, step):
        line = tl.minimum(start + tl.arange(0, LINES), total - 1)
        slot = line // slab_lines
        row = tl.load(rows_ptr + slot).to(tl.int64)
        row = tl.minimum(tl.maximum(row, 0), n_slabs - 1)
        within = tl.minimum((line - slot * slab_lines).to(tl.int64) * 128, slab_bytes - 1)
        addr = ptr + row * slab_bytes + within
        _prefetch_line(addr, EVICT_LAST)


def _check(t: torch.Tensor, programs: int) -> None:
    if programs < 1:
        raise ValueError(f"l2_prefetch: programs={programs}: expected at least 1")
    if not t.is_contiguous():
        raise ValueError(f"l2_prefetch: the tensor (shape {tuple(t.shape)}) must be contiguous")


def l2_prefetch_ref(t: torch.Tensor, programs: int = 16, evict_last: bool = False) -> None:
    """CPU implementation: nothing to prefetch (the hint has no effect on any result)."""
    _check(t, programs)


def _l2_prefetch_cuda(t: torch.Tensor, programs: int = 16, evict_last: bool = False) -> None:
    _check(t, programs)
    nbytes = t.numel() * t.element_size()
    if not HAS_TRITON or nbytes == 0:
        return
    nlines = triton.cdiv(nbytes, LINE)
    lines = LINES_PER_STEP
    grid = (max(1, min(programs, triton.cdiv(nlines, lines))),)
    _l2_prefetch_kernel[grid](t.view(torch.uint8).view(-1), nlines,
                              LINES=lines, EVICT_LAST=evict_last, num_warps=4)


l2_prefetch = define_op("l2_prefetch", "(Tensor t, int programs=16, bool evict_last=False) -> ()",
                        l2_prefetch_ref, _l2_prefetch_cuda)


def _check_rows(t: torch.Tensor, rows: torch.Tensor, programs: int) -> None:
    _check(t, programs)
    if t.dim() < 1 or t.shape[0] == 0:
        raise ValueError(f"l2_prefetch_rows: the tensor (shape {tuple(t.shape)}) needs a non-empty first dimension")
    if rows.dtype not in (torch.int32, torch.int64) or rows.device != t.device:
        raise ValueError(f"l2_prefetch_rows: rows must be int32 or int64 on {t.device}, got {rows.dtype} on "
                         f"{rows.device}")


def l2_prefetch_rows_ref(t: torch.Tensor, rows: torch.Tensor, programs: int = 16, evict_last: bool = False) -> None:
    """CPU implementation: nothing to prefetch."""
    _check_rows(t, rows, programs)


def _l2_prefetch_rows_cuda(t: torch.Tensor, rows: torch.Tensor, programs: int = 16, evict_last: bool = False) -> None:
    _check_rows(t, rows, programs)
    slab = t[0].numel() * t.element_size()
    if not HAS_TRITON or slab == 0 or rows.numel() == 0:
        return
    rows = rows.reshape(-1)
    lines = LINES_PER_STEP
    slab_lines = triton.cdiv(slab, LINE)
    grid = (max(1, min(programs, triton.cdiv(rows.numel() * slab_lines, lines))),)
    _l2_prefetch_rows_kernel[grid](t.view(torch.uint8).view(-1), rows.contiguous(), rows.numel(), t.shape[0], slab,
                                   slab_lines, LINES=lines, EVICT_LAST=evict_last, num_warps=4)


l2_prefetch_rows = define_op("l2_prefetch_rows", "(Tensor t, Tensor rows, int programs=16, bool evict_last=False) -> ()",
                             l2_prefetch_rows_ref, _l2_prefetch_rows_cuda)
