"""A side CUDA stream for work that can run beside the main stream's: the shared expert next to the router and
the routed experts (``MoE.forward``), and the compressor's cache writes and the indexer's selection next to the query
projection (``Attention.forward``).

Lane 1 (``mhc_coeffs`` beside a whole sublayer, ``DecoderLayer._forward_split``): the boundary's projection and
Sinkhorn, which the sublayer does not read.

Why: in a batch-64 decode step the routed experts stream their weights at ~3.4 TB/s while the shared expert's
two FP8 GEMMs, its activation and its two activation quantisations (~25 µs a layer, ~1 ms of a ~20 ms step on the
H200, docs/benchmarks.md) are small launches that leave most SMs idle; run on a second stream they fill the gaps
of the router and routing kernels and share the bandwidth with the expert GEMMs.  Likewise ``compress_insert`` runs
4 programs at batch 64 (~70 µs) and the indexer's chain is ~45 µs of small kernels, beside ``wq_b``'s ~22 µs.  The
fork and the join are stream waits, so they are captured into the decode CUDA graphs as graph edges and cost no host
sync.

``VLLM_DSV41_OVERLAP_ROWS`` (default :data:`DEFAULT_OVERLAP_ROWS`): forward passes of at most this many rows take
the side stream; 0 turns it off (the serial order, for comparison).  Large prefill passes keep the serial order:
there both branches are compute-bound GEMMs that would only take SMs from each other.

What may run on the side stream: ops without per-device shared state (``dsv41::fp8_gemv`` keeps its counters per
stream: :func:`side_streams` lets it reserve the side streams' at load).  ``dsv41::router`` keeps its arrival counters
in one buffer per device (``ops/router.py``), so two routers must not run on two streams at once; it stays on the
main stream (``MoE._routed``).

Lane 2 (``VLLM_DSV41_L2_PREFETCH``, :func:`prefetching`): ``dsv41::l2_prefetch`` of the next GEMV's weight beside a
latency-bound phase (the sparse attention before ``wo_a``, an mHC boundary's collapse before ``[wq_a; wkv]`` or the
shared expert's ``[w1; w3]``), so that the GEMV finds its bytes in L2; and the chosen experts' ``w2`` while
``moe_gemv``'s first GEMM runs below the bandwidth.

Memory: a tensor made on one stream and used on the other is only freed after the join (the main stream waits
for the side stream before it uses the side's result, and the side stream waits for the main one before every
fork), so the caching allocator never hands a block to one stream while the other may still read it.
"""

from __future__ import annotations

import functools
import os
from typing import Callable, TypeVar

import torch

from vllm_dsv41.model_executor.linear import env_count

OVERLAP_ROWS_ENV = "VLLM_DSV41_OVERLAP_ROWS"
DEFAULT_OVERLAP_ROWS = 1024
L2_PREFETCH_ENV = "VLLM_DSV41_L2_PREFETCH"
EVICT_LAST_ENV = "VLLM_DSV41_L2_PREFETCH_EVICT_LAST"
PREFETCH_MAX_ROWS = 16
"""Passes of more rows are compute-bound or stream more than the L2 holds: no prefetch."""
PREFETCH_MAX_BYTES = 40 << 20
"""At most this much of a weight is asked for (the H100's and H200's L2 is 50 MB)."""
PREFETCH_PROGRAMS = 16
PREFETCH_TARGETS = ("wo_a", "qkv_a", "w13", "experts_w2")

A = TypeVar("A")
B = TypeVar("B")


def overlap_rows() -> int:
    """The row limit of ``VLLM_DSV41_OVERLAP_ROWS`` (0: never overlap)."""
    return env_count(OVERLAP_ROWS_ENV, DEFAULT_OVERLAP_ROWS, "a row count >= 0 (0: no side stream)")


@functools.lru_cache(maxsize=None)
def _side_stream(device_index: int, lane: int = 0) -> torch.cuda.Stream:
    return torch.cuda.Stream(device=device_index)


LANES = (0, 1, 2)


def side_streams(device: torch.device) -> tuple[torch.cuda.Stream, ...]:
    """Every lane's side stream of ``device`` when the overlap is on (none off CUDA or with the limit 0)."""
    if device.type != "cuda" or overlap_rows() == 0:
        return ()
    index = device.index if device.index is not None else torch.cuda.current_device()
    return tuple(_side_stream(index, lane) for lane in LANES)


def side_stream_for(x: torch.Tensor, lane: int = 0) -> torch.cuda.Stream | None:
    """The side stream (``lane``: one per kind of side work, so that one kind never queues behind another) of
    ``x``'s device when a pass over ``x``'s rows should overlap, else None (CPU tensors, empty passes, more rows
    than the limit)."""
    if not x.is_cuda or x.shape[0] == 0 or x.shape[0] > overlap_rows():
        return None
    return _side_stream(x.device.index if x.device.index is not None else torch.cuda.current_device(), lane)


def beside(x: torch.Tensor, side: Callable[[], B], main: Callable[[], A], lane: int = 0) -> tuple[A, B]:
    """``(main(), side())``, with ``side`` on the side stream while ``main`` runs on the current one when
    :func:`side_stream_for` allows (``side`` launched first, so it starts while ``main``'s first kernels are
    queued), else one after the other (``side`` first, the same order).  Results are the same either way: the two
    callables must not depend on each other.  ``main`` may itself call ``beside`` on another ``lane`` (the mHC
    coefficients, lane 1, beside a sublayer whose own side work takes lane 0)."""
    stream = side_stream_for(x, lane)
    if stream is None:
        s = side()
        return main(), s
    current = torch.cuda.current_stream(x.device)
    stream.wait_stream(current)  # fork: the side work sees everything queued before it
    try:
        with torch.cuda.stream(stream):
            s = side()
        m = main()
    finally:  # join, also when either raised: nothing the side stream still reads is freed to the current one early
        current.wait_stream(stream)
    return m, s


def l2_prefetch_targets() -> frozenset[str]:
    """``VLLM_DSV41_L2_PREFETCH``: the weights prefetched into L2 beside the phase before their GEMV (default ``0``:
    none).  ``1``: ``wo_a`` (beside the sparse attention); ``all``; or a comma list of :data:`PREFETCH_TARGETS`
    (``qkv_a``: the fused ``[wq_a; wkv]`` beside the attention boundary's collapse; ``w13``: the shared expert's
    ``[w1; w3]`` beside the FFN boundary's collapse; ``experts_w2``: the chosen experts' ``w2`` and its scales beside
    ``moe_gemv``'s first two launches).  Anything else fails naming the variable and the value."""
    v = os.environ.get(L2_PREFETCH_ENV, "0").strip() or "0"
    if v == "0":
        return frozenset()
    if v == "1":
        return frozenset({"wo_a"})
    if v == "all":
        return frozenset(PREFETCH_TARGETS)
    names = {n.strip() for n in v.split(",") if n.strip()}
    unknown = sorted(names - set(PREFETCH_TARGETS))
    if unknown or not names:
        raise ValueError(f"{L2_PREFETCH_ENV}={v!r}: unknown target(s) {unknown}; expected 0, 1 (wo_a), all, or a "
                         f"comma list of {', '.join(PREFETCH_TARGETS)}")
    return frozenset(names)


def prefetching(x: torch.Tensor, weight: torch.Tensor | tuple[torch.Tensor, ...] | None, main: Callable[[], A],
                target: str = "wo_a", rows: torch.Tensor | None = None) -> A:
    """``main()``, with ``dsv41::l2_prefetch`` of ``weight`` (a tensor or several) on lane 2 beside it when ``target``
    is switched on and the pass over ``x``'s rows is short enough; joined after ``main``.  With ``rows`` (device
    indices into each weight's first dimension: the chosen experts) only those slabs, ``dsv41::l2_prefetch_rows``.
    At most :data:`PREFETCH_MAX_BYTES` of each weight is asked for; ``VLLM_DSV41_L2_PREFETCH_EVICT_LAST=1`` asks with
    the evict-last hint.  The prefetch is a hint: ``main``'s results and the weight's reader's are the same either
    way."""
    if weight is None or x.shape[0] > PREFETCH_MAX_ROWS or target not in l2_prefetch_targets():
        return main()
    stream = side_stream_for(x, lane=2)
    if stream is None:
        return main()
    from vllm_dsv41.ops import env_flag, l2_prefetch  # noqa: F401  (defines the ops)

    # the evict-last hint keeps the lines against the streaming reads beside them (the experts' w13 is 70 MB)
    evict_last = env_flag(EVICT_LAST_ENV, "0")
    current = torch.cuda.current_stream(x.device)
    stream.wait_stream(current)
    try:
        with torch.cuda.stream(stream):
            for w in weight if isinstance(weight, tuple) else (weight,):
                slab = max(1, w[0].numel() * w.element_size())
                n = max(1, PREFETCH_MAX_BYTES // slab)
                if rows is None:
                    torch.ops.dsv41.l2_prefetch(w[:n], PREFETCH_PROGRAMS, evict_last)
                else:
                    torch.ops.dsv41.l2_prefetch_rows(w, rows.reshape(-1)[:n], PREFETCH_PROGRAMS, evict_last)
        return main()
    finally:
        current.wait_stream(stream)
