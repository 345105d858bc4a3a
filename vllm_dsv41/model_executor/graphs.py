"""CUDA graphs of whole decode steps, captured and replayed by the model itself.

Owns :class:`DecodeGraphs`.  A decode step (every scheduled request brings one token) is padded
to a batch bucket (1, 2, 4, ... ``max_batch``) and run against a :class:`StaticStep` whose device
tensors are fixed buffers; its host-side bounds are fixed per context bucket (the largest
position the graph serves, a power of two >= ``MIN_CONTEXT``), which sets the indexer's score
width.  The first step of a (batch, context) key runs eagerly (that result is returned) and is
then captured; later steps copy their metadata into the buffers and replay.  Prefill and mixed
steps, and the plain-PyTorch path, stay eager.

Why here and not vLLM's CUDA-graph wrapper: vLLM 0.32 captures through torch.compile's piecewise
backend or FULL graphs driven by the attention backend's own metadata buffers; our step metadata
(KV-source block tables, compressed slots, ring ids, Engram lookback ids) lives outside those, and a
decode step's shapes depend on the context bucket, which vLLM's capture sizes do not know.  Padding
is exact: padded rows write nothing (slot -1), read block 0 and are discarded
(``pad_decode_meta``), so a padded step returns the same rows as the unpadded one
(``tests/e2e/test_graphs.py`` checks this on CPU without capture).

``VLLM_DSV41_CUDAGRAPH``: ``auto`` (default: on CUDA with the ops path), ``0`` (off) or ``static``
(the padded static steps without capture, on any device: how the CPU tests check the padding).

Also owns :class:`DecoderGraphs`: the decoder layers of a prefill step, which run on the pruned rows (each
request's last ``sliding_window`` rows), captured the same way under a (request bucket, row bucket, context
bucket) key.  In a prunable layout those layers own no compressor and no Engram: they read the caches the
encoder wrote and write only their SWA rings, so the kept rows make a step of their own (:func:`kept_step_meta`).
Eager, their launches cost the host as much as an encoder layer's for a fraction of the GPU work, which left the
GPU waiting at the end of every prefill chunk (docs/benchmarks.md, session 13).  ``VLLM_DSV41_PREFILL_GRAPHS``:
``auto`` (the default, as ``1``), ``1`` (capture on CUDA with the ops path), ``0`` (eager) or ``static`` (the
padded static decoder steps without capture, on any device).  On by default since session 18: the no-crash sweep
ran with them and the batch-64 workload gained (docs/benchmarks.md, sessions 16 and 18).

And :class:`MixedGraphs`: whole steps in which some request brings several rows but none more than
``sliding_window`` (so nothing is pruned): the last chunk of a prompt beside decode rows, short prompts, multi-row
verify steps.  Such a step looked as host-bound as a decode step (session 19: the batch-64 workload's 157-row tail
step took 253-276 ms of host time for 47-67 ms of GPU work), so it is padded to a (request bucket, row bucket, context
bucket) key and captured like one (:func:`pad_mixed_meta`: the padded rows belong to one padding request that
writes nothing).  ``VLLM_DSV41_MIXED_GRAPHS``: ``0`` (the default: measured slower in steady state, session 21: that
tail step's host time did not fall, see docs/design.md), ``auto`` / ``1`` (capture on CUDA with the ops path) or
``static``, as above.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable

import torch

from vllm_dsv41.attention.backend import DSV41GroupMetadata, DSV41StepMetadata, replayed_mask, table_slots
from vllm_dsv41.model_executor.step import GroupView, Step

logger = logging.getLogger(__name__)

GRAPH_ENV = "VLLM_DSV41_CUDAGRAPH"
PREFILL_GRAPH_ENV = "VLLM_DSV41_PREFILL_GRAPHS"
MIXED_GRAPH_ENV = "VLLM_DSV41_MIXED_GRAPHS"
MIN_CONTEXT = 1024
MIN_KEPT_ROWS = 256  # smallest row bucket of the decoder graphs
MAX_DECODER_GRAPHS = 24
"""Most (request, row, context) buckets the decoder graphs capture; steps of further buckets run eagerly."""
KEPT_ROW_STEP = 256
"""Above 1,024 kept rows the decoder graphs' row buckets are multiples of this, not powers of two: a 16k prefill
chunk of the batch-64 workload keeps ~2,070 rows (15-16 requests' last 128 plus the decode rows of a mixed step),
which a power-of-two bucket pads to 4,096 (session 14: the likely source of ~27 ms more MoE and GEMM work a step,
inferred from the kernel totals)."""
MIN_MIXED_ROWS = 16  # smallest row bucket of the mixed-step graphs
MAX_MIXED_ROWS = 1024
"""Most rows a step the mixed-step graphs take has (larger steps keep the GPU busy on their own)."""
MAX_MIXED_GRAPHS = 16
"""Most (request, row, context) buckets the mixed-step graphs capture; steps of further buckets run eagerly."""


_IN_STATIC_STEP = False


def in_static_step() -> bool:
    """True while a padded static decode step runs (eager warm-up, capture, or ``static`` mode): code
    that would read device values on the host takes its sync-free form then."""
    return _IN_STATIC_STEP


@contextlib.contextmanager
def _static_step():
    global _IN_STATIC_STEP
    prev, _IN_STATIC_STEP = _IN_STATIC_STEP, True
    try:
        yield
    finally:
        _IN_STATIC_STEP = prev


def _env_mode(env: str, default: str, on: tuple[str, ...], expected: str, device: torch.device,
              use_ops: bool, eager: bool = False) -> str:
    """``capture``, ``static`` or ``off`` from ``env`` (unset or empty: ``default``); ``on`` are its spellings of
    "capture where it can" (on CUDA with the ops path).  ``eager``: the user asked for eager execution
    (``enforce_eager``, ``engine_config.user_asked_eager``), so ``auto`` captures nothing; an explicit ``1`` still does."""
    v = os.environ.get(env, default).strip().lower() or default
    if v in ("0", "false", "off", "no") or (v == "auto" and eager):
        return "off"
    if v == "static":
        return "static" if use_ops else "off"
    if v not in on:
        raise ValueError(f"{env}={v!r}: expected {expected}")
    return "capture" if device.type == "cuda" and use_ops else "off"


def graph_mode(device: torch.device, use_ops: bool, eager: bool = False) -> str:
    """``capture``, ``static`` or ``off`` for this model's decode steps (see the module docstring)."""
    return _env_mode(GRAPH_ENV, "auto", ("auto", "1", "true", "on", "yes"), "auto, 0, 1 or static", device, use_ops,
                     eager)


def prefill_graph_mode(device: torch.device, use_ops: bool, eager: bool = False) -> str:
    """``capture``, ``static`` or ``off`` for the decoder layers of prefill steps (``VLLM_DSV41_PREFILL_GRAPHS``:
    ``auto`` by default, ``1``, ``0`` or ``static``; see the module docstring)."""
    return _env_mode(PREFILL_GRAPH_ENV, "auto", ("auto", "1", "true", "on", "yes"), "auto, 0, 1 or static", device,
                     use_ops, eager)


def mixed_graph_mode(device: torch.device, use_ops: bool, eager: bool = False) -> str:
    """``capture``, ``static`` or ``off`` for the mixed steps (``VLLM_DSV41_MIXED_GRAPHS``: ``0`` by default (measured
    slower, session 21), ``auto`` / ``1`` (capture where it can), or ``static``; see the module docstring)."""
    return _env_mode(MIXED_GRAPH_ENV, "0", ("auto", "1", "true", "on", "yes"), "auto, 0, 1 or static", device,
                     use_ops, eager)


def mixed_row_bucket(n: int) -> int:
    """The row bucket of a mixed step of ``n`` rows: a power of two from :data:`MIN_MIXED_ROWS` to 256, then the next
    multiple of 128."""
    if n <= 256:
        return _pow2_at_least(n, MIN_MIXED_ROWS)
    return -(-n // 128) * 128


def kept_row_bucket(n: int) -> int:
    """The row bucket of ``n`` kept rows: a power of two from :data:`MIN_KEPT_ROWS` to 1,024, then the next multiple
    of :data:`KEPT_ROW_STEP`."""
    if n <= 1024:
        return _pow2_at_least(n, MIN_KEPT_ROWS)
    return -(-n // KEPT_ROW_STEP) * KEPT_ROW_STEP


def _pow2_at_least(n: int, lo: int = 1) -> int:
    b = lo
    while b < n:
        b *= 2
    return b


def is_decode_step(meta: DSV41StepMetadata, max_batch: int) -> bool:
    """Every request brings exactly one token (and there are at most ``max_batch`` of them)."""
    return 0 < meta.num_reqs <= max_batch and meta.num_tokens == meta.num_reqs


def _pad(t: torch.Tensor, n: int, fill) -> torch.Tensor:
    if t.shape[0] == n:
        return t
    pad = torch.full((n - t.shape[0], *t.shape[1:]), fill, dtype=t.dtype, device=t.device)
    return torch.cat((t, pad))


def pad_decode_meta(meta: DSV41StepMetadata, batch: int) -> DSV41StepMetadata:
    """``meta`` of a decode step grown to ``batch`` requests.  Padded request i (one token, position 0)
    writes no KV (slot -1), reads through an all-zero block-table row (the null block) and has no
    lookback ids; the real rows are untouched, so their results are those of the unpadded step."""
    n = meta.num_reqs
    B = batch
    ar = torch.arange(B + 1, dtype=meta.query_start_loc.dtype)
    out = DSV41StepMetadata(
        num_reqs=B, num_tokens=B, req_ids=list(meta.req_ids) + [None] * (B - n),
        query_start_loc=ar, seq_lens=_pad(meta.seq_lens, B, 1), context_lens=_pad(meta.context_lens, B, 0),
        positions=_pad(meta.positions, B, 0), token_req_idx=torch.arange(B, dtype=meta.token_req_idx.dtype),
        replay_start=_pad(meta.replay_start, B, 0), replay_window=meta.replay_window,
        lookback_token_ids=_pad(meta.lookback_token_ids, B, -1), is_prefill=_pad(meta.is_prefill, B, False),
        history_rows=_pad(meta.history_rows, B, -1))
    _add_groups(out, meta, lambda slots: _pad(slots, B, -1))
    return out


def pad_mixed_meta(meta: DSV41StepMetadata, rows: int, batch: int) -> DSV41StepMetadata:
    """``meta`` grown to ``rows`` rows and ``batch`` (> its ``num_reqs``) requests.  The padded rows belong to request
    ``num_reqs``, the padding request: position 0, seq len 1, an all-zero block-table row (the null block), so it
    writes no KV (the runner's SWA slot -1, no compressed or ring slot for block 0), reads the null block and has no
    lookback ids or history row; the further padded requests have no rows.  Each real row's result depends on its
    own request's inputs only, so the real rows' results are those of the unpadded step."""
    n, T, B, R = meta.num_reqs, meta.num_tokens, batch, rows
    if B <= n or R < T:
        raise ValueError(f"pad_mixed_meta: {n} requests / {T} rows do not fit {B} / {R}")
    qsl = torch.full((B + 1,), R, dtype=meta.query_start_loc.dtype)
    qsl[:n + 1] = meta.query_start_loc
    out = DSV41StepMetadata(
        num_reqs=B, num_tokens=R, req_ids=list(meta.req_ids) + [None] * (B - n), query_start_loc=qsl,
        seq_lens=_pad(meta.seq_lens, B, 1), context_lens=_pad(meta.context_lens, B, 0),
        positions=_pad(meta.positions, R, 0), token_req_idx=_pad(meta.token_req_idx, R, n),
        replay_start=_pad(meta.replay_start, B, 0), replay_window=meta.replay_window,
        lookback_token_ids=_pad(meta.lookback_token_ids, B, -1), is_prefill=_pad(meta.is_prefill, B, False),
        history_rows=_pad(meta.history_rows, B, -1))
    _add_groups(out, meta, lambda slots: _pad(slots, R, -1))
    return out


def _add_groups(out: DSV41StepMetadata, meta: DSV41StepMetadata,
                slots_of: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """``meta``'s KV-cache groups, each once (its layers share it), into ``out``: block tables grown to ``out``'s
    requests (all-zero rows: the null block), a SWA group's runner slots through ``slots_of``."""
    done: dict[int, DSV41GroupMetadata] = {}
    for name, g in meta.groups.items():
        ng = done.get(id(g))
        if ng is None:
            ng = done[id(g)] = DSV41GroupMetadata(
                kind=g.kind, block_size=g.block_size, tokens_per_state=g.tokens_per_state,
                rows_per_block=g.rows_per_block, block_table=_pad(g.block_table, out.num_reqs, 0),
                layer_names=g.layer_names, step=out,
                runner_slots=None if g.runner_slots is None else slots_of(g.runner_slots))
        out.groups[name] = ng


def kept_floors(meta: DSV41StepMetadata, counts: torch.Tensor) -> torch.Tensor:
    """[num_reqs] host: the decoder layers' SWA floor of each request of ``meta`` when they keep ``counts`` of its
    rows, its last ones (§3.2 item 5): a request some of whose rows were dropped reads from its first kept row on,
    as no decoder KV exists below it; the others read their whole windows (their earlier chunks kept their last
    rows), down to their replay start."""
    rs = meta.replay_start
    first_kept = (meta.seq_lens - counts).to(rs.dtype)
    return torch.where(counts < meta.query_lens, torch.maximum(rs, first_kept), rs)


def kept_step_meta(meta: DSV41StepMetadata, kept: torch.Tensor, kept_dev: torch.Tensor, rows: int,
                   batch: int) -> DSV41StepMetadata:
    """The rows ``kept`` (host int64, ascending: each request's kept rows together; ``kept_dev``: the same on the
    runner's device) of the step ``meta`` as a step of their own, grown to ``rows`` rows and ``batch`` requests.
    The kept rows keep their positions, requests and SWA slots (the runner's slot mapping at those rows); padded
    rows sit at position 0 of request 0 and write nothing (slot -1); padded requests read through an all-zero
    block-table row, as in :func:`pad_decode_meta`.  Its ``replay_start`` is each request's decoder SWA floor
    (:func:`kept_floors`; the decoder layers write no compressed entry, so nothing else reads it).
    Every row's result depends on its own inputs only, so the kept rows' results are those of the eager
    decoder layers on the same rows."""
    n, B, R = meta.num_reqs, batch, rows
    req = meta.token_req_idx[kept]
    counts = torch.bincount(req, minlength=n)[:n]
    qsl = torch.zeros(B + 1, dtype=meta.query_start_loc.dtype)
    qsl[1:n + 1] = torch.cumsum(counts, 0)
    qsl[n + 1:] = qsl[n]
    out = DSV41StepMetadata(
        num_reqs=B, num_tokens=R, req_ids=list(meta.req_ids) + [None] * (B - n), query_start_loc=qsl,
        seq_lens=_pad(meta.seq_lens, B, 1), context_lens=_pad(meta.context_lens, B, 0),
        positions=_pad(meta.positions[kept], R, 0), token_req_idx=_pad(req, R, 0),
        replay_start=_pad(kept_floors(meta, counts), B, 0), replay_window=meta.replay_window,
        lookback_token_ids=_pad(meta.lookback_token_ids, B, -1), is_prefill=_pad(meta.is_prefill, B, False),
        history_rows=_pad(meta.history_rows, B, -1))
    _add_groups(out, meta, lambda slots: _pad(slots[kept_dev], R, -1))
    return out


class StaticGroupView(GroupView):
    """A group's addressing for a :class:`StaticStep`: the block table (and a SWA group's runner slots) in
    fixed buffers refilled by :meth:`StaticStep.load`; a compressed or ring group's slots and ring block
    ids are computed from those buffers inside the step (so inside the captured graph, once per step,
    instead of by the metadata builder on the host)."""

    def __init__(self, md: DSV41GroupMetadata, device: torch.device, step: "StaticStep"):
        super().__init__(md, device)
        self.step = step
        # views of the step's packed buffers once StaticStep.__init__ has made them
        self.block_table_i32 = self.block_table_i32.clone()
        self.runner_slots = (md.runner_slots.to(device=device, dtype=torch.int64).clone()
                             if md.runner_slots is not None else None)

    @property
    def slot_mapping(self) -> torch.Tensor:
        if self.runner_slots is not None:
            return self.runner_slots
        return self.step.once(("slots", id(self)), self._compute_slots)

    @property
    def ring_block_ids(self) -> torch.Tensor | None:
        if self.kind != "ring":
            return None
        return self.step.once(("ring", id(self)), lambda: self.block_table_i32[:, 0].to(torch.int64))

    def _compute_slots(self) -> torch.Tensor:
        st, md = self.step, self.md
        pos, req = st.positions, st.req_idx
        return table_slots(self.kind, self.block_table_i32, pos, req,
                           lambda: st.once("replayed", lambda: replayed_mask(st.replay_start, req, pos,
                                                                             st.meta.replay_window)),
                           md.tokens_per_state, self.rows_per_block, md.block_size)


class StaticStep(Step):
    """A :class:`Step` whose device tensors are fixed buffers (refilled by :meth:`load`) and whose
    host-side bound on positions is the graph's context bucket."""

    def __init__(self, meta: DSV41StepMetadata, device: torch.device, context: int,
                 rows_per_request: int | None = None):
        super().__init__(meta, torch.zeros(meta.num_tokens, dtype=torch.long, device=device), device=device,
                         use_ops=True)
        self.context = context
        # the most rows any request has in the steps this one stands for (the decoder's kept rows: the window);
        # known, it bounds the blocks a gather plan can touch (gather_bounds), so attention may gather keys here
        self.rows_per_request = rows_per_request
        self._views: dict[str, GroupView] = {}
        made: dict[int, StaticGroupView] = {}
        for name, g in meta.groups.items():
            v = made.get(id(g))
            if v is None:
                v = made[id(g)] = StaticGroupView(g, device, self)
            self._views[name] = v
        self._group_views = list(made.values())  # each group's view once, in the metadata's order
        # every buffer load refills lives in one of three flat buffers (the step fields, int64; the block tables,
        # int32; the SWA groups' runner slots, int64) so a packed load refills each with one copy (see load)
        fields = {k: t.to(device=device, dtype=torch.int64) for k, t in self._fields(meta).items()}
        self._field_buf, views = _packed(list(fields.values()), torch.int64, device)
        self._dev.update(zip(fields, views))
        self._table_buf, tables = _packed([v.block_table_i32 for v in self._group_views], torch.int32, device)
        slotted = [v for v in self._group_views if v.runner_slots is not None]
        self._slot_buf, slots = _packed([v.runner_slots for v in slotted], torch.int64, device)
        for v, t in zip(self._group_views, tables):
            v.block_table_i32 = t
        for v, t in zip(slotted, slots):
            v.runner_slots = t

    # the metadata fields the model reads on the device (Step._on_device)
    FIELDS = ("positions", "token_req_idx", "query_start_loc", "seq_lens", "replay_start", "lookback_token_ids",
              "history_rows")

    @classmethod
    def _fields(cls, meta: DSV41StepMetadata) -> dict[str, torch.Tensor]:
        return {f: getattr(meta, f) for f in cls.FIELDS}

    @property
    def max_position(self) -> int:
        return self.context - 1

    def needs_pruning(self, window: int) -> bool:
        return False

    @property
    def gathers_when_static(self) -> bool:
        return self.rows_per_request is not None

    def gather_bounds(self, window: int, swa_rows_per_block: int, ratio: int, comp_rows_per_block: int
                      ) -> tuple[int, int]:
        """Bounds that hold for every step loaded into this one (a captured graph bakes them in): each of the
        bucket's requests has at most :attr:`rows_per_request` rows, so its rows' windows span at most
        ``rows_per_request + window - 1`` positions (at most ``(span - 1) // rows_per_block + 2`` blocks), plus one
        block for the padded rows (position 0 of request 0); it sees at most ``context // ratio`` compressed
        entries, in blocks of its own."""
        if self.rows_per_request is None:
            raise RuntimeError("gather_bounds: a static step without a bound on its rows per request")
        B, span = self.meta.num_reqs, self.rows_per_request + window - 1
        swa = B * ((span - 1) // swa_rows_per_block + 2) + 1
        comp = B * -(-(self.context // ratio) // comp_rows_per_block) if ratio else 0
        return swa, comp

    def group(self, layer_name: str) -> GroupView:
        return self._views[layer_name]

    def load(self, meta: DSV41StepMetadata, input_ids: torch.Tensor, n: int) -> None:
        """Copy a padded step of the same batch into the buffers (step fields from the host, block tables
        and slot mappings from the runner's device); ``input_ids[:n]`` are the real rows' ids (on the
        model's device), padded rows get id 0."""
        self.meta = meta
        self.scratch.clear()
        self._rows.clear()
        self.__dict__.pop("request_spans", None)  # Step's cached host facts of the previous step
        self.input_ids[:n].copy_(input_ids[:n])
        self.input_ids[n:].zero_()
        by_view: dict[int, DSV41GroupMetadata] = {}
        for name, g in meta.groups.items():
            by_view.setdefault(id(self._views[name]), g)
        missing = [v.md.layer_names[0] for v in self._group_views if id(v) not in by_view]
        if missing:
            raise ValueError(f"StaticStep.load: no metadata for the cache groups of {missing}")
        # in the buffers' own order (the packed refill writes the flat buffers front to back)
        pairs = [(v, by_view[id(v)]) for v in self._group_views]
        for v, _ in pairs:
            v._bt64 = None  # the int64 view (plain path only) is remade from the buffer when read
        fields = self._fields(meta)
        if packed_load():
            self._load_packed(fields, pairs)
            return
        for key, t in fields.items():
            self._dev[key].copy_(t, non_blocking=True)
        for v, g in pairs:
            v.block_table_i32.copy_(g.block_table, non_blocking=True)
            if v.runner_slots is not None:
                v.runner_slots.copy_(g.runner_slots, non_blocking=True)

    def _load_packed(self, fields: dict[str, torch.Tensor],
                     pairs: list[tuple["StaticGroupView", DSV41GroupMetadata]]) -> None:
        """:meth:`load`'s copies, one a flat buffer: the step fields gathered on the host into one pinned block and
        sent with one host-to-device copy, the block tables and runner slots concatenated on the device (one kernel
        each).  Per field, each tiny copy was a launch of its own between two replays (session 21's batch-1
        profile: ~0.5 ms a step of GPU idle between them)."""
        _refill(self._field_buf, [self._dev[k] for k in fields], list(fields.values()), "step field")
        _refill(self._table_buf, [v.block_table_i32 for v, _ in pairs], [g.block_table for _, g in pairs],
                "block table")
        slotted = [(v, g) for v, g in pairs if v.runner_slots is not None]
        _refill(self._slot_buf, [v.runner_slots for v, _ in slotted], [g.runner_slots for _, g in slotted],
                "runner slot mapping")


PACKED_LOAD_ENV = "VLLM_DSV41_PACKED_LOAD"


def packed_load() -> bool:
    """``VLLM_DSV41_PACKED_LOAD`` (default ``1``): :meth:`StaticStep.load` refills its buffers with one copy per flat
    buffer; ``0``: one copy per tensor (the earlier path, kept for comparison)."""
    v = os.environ.get(PACKED_LOAD_ENV, "1").strip().lower() or "1"
    if v not in ("0", "1", "true", "false", "on", "off", "yes", "no"):
        raise ValueError(f"{PACKED_LOAD_ENV}={v!r}: expected 0 or 1")
    return v in ("1", "true", "on", "yes")


def _packed(tensors: list[torch.Tensor], dtype: torch.dtype, device: torch.device
            ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A flat ``dtype`` buffer on ``device`` holding a copy of each tensor, and each tensor's view of it."""
    sizes = [t.numel() for t in tensors]
    flat = torch.empty(sum(sizes), dtype=dtype, device=device)
    if not tensors:
        return flat, []
    views = [part.view(t.shape) for part, t in zip(flat.split(sizes), tensors)]
    for view, t in zip(views, tensors):
        view.copy_(t)
    return flat, views


def _refill(flat: torch.Tensor, views: list[torch.Tensor], srcs: list[torch.Tensor], what: str) -> None:
    """Copy ``srcs`` into ``views`` (consecutive views of ``flat``, in order) with one copy: a concatenation into
    ``flat``; host sources through one pinned staging block when ``flat`` is on CUDA (non-blocking: the caching host
    allocator keeps the block until the copy ran).  A source of another shape than its view is an error, not a
    resize of the captured buffer."""
    for view, src in zip(views, srcs):
        if src.shape != view.shape:
            raise ValueError(f"StaticStep.load: {what} of shape {tuple(src.shape)} for a buffer of "
                             f"{tuple(view.shape)}")
    if not srcs:
        return
    parts = [src.reshape(-1) if src.dtype == flat.dtype else src.reshape(-1).to(flat.dtype) for src in srcs]
    if flat.device.type == "cuda" and parts[0].device.type == "cpu":
        staging = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        torch.cat(parts, out=staging)
        flat.copy_(staging, non_blocking=True)
    else:
        torch.cat(parts, out=flat)


PRIORITY_ENV = "VLLM_DSV41_GRAPH_PRIORITY"


def graph_priority() -> bool:
    """``VLLM_DSV41_GRAPH_PRIORITY``: ``1`` captures the graphs on a high-priority stream, so that their main-stream
    kernels outrank the side streams' (``overlap.py``) when both have blocks waiting for an SM; ``0`` (default, until
    a GPU measures it) at the default priority.  A captured kernel node keeps its capture stream's priority, and
    PyTorch instantiates graphs to honour the nodes' priorities (``cudaGraphInstantiateFlagUseNodePriority``)."""
    from vllm_dsv41.ops import env_flag

    return env_flag(PRIORITY_ENV, "0")


_CAPTURE_STREAMS: dict[tuple, torch.cuda.Stream] = {}


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream the graphs of ``device`` are captured on (one per device and priority, kept), with the split-K
    counters of ``fp8_gemv`` and ``moe_gemv`` reserved for it before any capture: counters made inside a capture
    would be graph memory that nothing zeroes until that graph first replays (PyTorch's own capture stream had
    none reserved)."""
    high = graph_priority()
    if device.index is None:  # the counters are keyed by the index the kernels' tensors carry
        device = torch.device("cuda", torch.cuda.current_device())
    key = (device.index, high)
    stream = _CAPTURE_STREAMS.get(key)
    if stream is None:
        # lower numbers are higher priorities; -1 is above the default 0 of every other stream of the process
        stream = _CAPTURE_STREAMS[key] = torch.cuda.Stream(device=device, priority=-1 if high else 0)
        from vllm_dsv41.ops import fp8_gemv

        fp8_gemv.reserve(device, (stream,))
    return stream


class _GraphSet:
    """What the two graph sets share: one memory pool, the captured entries by key, and a capture that, when an
    op turns out capture-unsafe, leaves the steps eager instead of failing the request."""

    what = ""  # the steps, for the log

    def __init__(self, max_context: int):
        self.max_context = max_context
        self.pool = None
        self.entries: dict[tuple, tuple] = {}
        self.entries_seen: set[tuple] = set()  # every key run, captured or not
        self.failed: str | None = None  # why capture failed; the steps then stay eager

    def _fits(self, meta: DSV41StepMetadata) -> bool:
        """Capture has not failed and the step's positions lie below the largest context served."""
        return self.failed is None and int(meta.positions.max()) < self.max_context

    def _context(self, meta: DSV41StepMetadata) -> int:
        """The step's context bucket: the largest position it serves, a power of two >= ``MIN_CONTEXT``."""
        return min(_pow2_at_least(int(meta.positions.max()) + 1, MIN_CONTEXT), _pow2_at_least(self.max_context))

    def _capture(self, step: StaticStep, fn: Callable[[], object]) -> tuple[object, object] | None:
        """(graph, outputs) of ``fn()`` captured over ``step`` (its per-step results recomputed inside) on
        :func:`capture_stream`, or None."""
        try:
            step.scratch.clear()
            graph = torch.cuda.CUDAGraph()
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            stream = capture_stream(step.device)
            with _static_step(), torch.cuda.graph(graph, pool=self.pool, stream=stream,
                                                  capture_error_mode="thread_local"):
                out = fn()
            return graph, out
        except Exception as e:  # a capture-unsafe op: serve eagerly rather than fail the request
            self.failed = f"{type(e).__name__}: {e}"
            self.entries.clear()
            logger.warning("vllm-dsv41: CUDA-graph capture of %s failed (%s); they run eagerly", self.what,
                           self.failed, exc_info=True)
            return None


class DecodeGraphs(_GraphSet):
    """Captured decode steps keyed by (batch bucket, context bucket); ``run_model(step)`` is the model's
    forward from a step to the final hidden states [num_tokens, H]."""

    what = "decode steps"

    def __init__(self, run_model: Callable[[Step], torch.Tensor], max_batch: int, max_context: int):
        super().__init__(max_context)
        self.run_model = run_model
        self.max_batch = max_batch

    def accepts(self, meta: DSV41StepMetadata) -> bool:
        return is_decode_step(meta, self.max_batch) and self._fits(meta)

    def key(self, meta: DSV41StepMetadata) -> tuple[int, ...]:
        return _pow2_at_least(meta.num_reqs), self._context(meta)

    def _padded(self, meta: DSV41StepMetadata, key: tuple[int, ...]) -> DSV41StepMetadata:
        return pad_decode_meta(meta, key[0])

    def _static_step(self, padded: DSV41StepMetadata, device: torch.device, key: tuple[int, ...]) -> StaticStep:
        return StaticStep(padded, device, key[-1])

    def run(self, meta: DSV41StepMetadata, input_ids: torch.Tensor, device: torch.device,
            capture: bool = True) -> torch.Tensor:
        """Hidden states of the step's real rows.  ``capture=False`` runs the padded static step eagerly
        (the CPU check of the padding)."""
        n = meta.num_tokens
        key = self.key(meta)
        self.entries_seen.add(key)
        padded = self._padded(meta, key)
        entry = self.entries.get(key)
        if entry is not None:
            step, graph, out = entry
            step.load(padded, input_ids, n)
            graph.replay()
            return out[:n]
        step = self._static_step(padded, device, key)
        step.load(padded, input_ids, n)
        with _static_step():
            h = self.run_model(step)  # eager: this step's answer, and the warm-up before capture
        got = self._capture(step, lambda: self.run_model(step)) if capture else None
        if got is not None:
            self.entries[key] = (step, *got)
        return h[:n]


class MixedGraphs(DecodeGraphs):
    """Captured mixed steps (several rows for some request, at most ``window`` for any, at most
    :data:`MAX_MIXED_ROWS` in all) keyed by (request bucket, row bucket, context bucket): the request bucket is a
    power of two plus the padding request of :func:`pad_mixed_meta`.  The static step knows that no request has more
    than ``window`` rows, so attention may gather keys inside it (``StaticStep.gather_bounds``).  Past
    :data:`MAX_MIXED_GRAPHS` captured keys, steps of new keys run eagerly (each keeps its activations)."""

    what = "mixed steps"

    def __init__(self, run_model: Callable[[Step], torch.Tensor], max_batch: int, max_context: int, window: int,
                 max_rows: int = MAX_MIXED_ROWS):
        super().__init__(run_model, max_batch, max_context)
        self.window, self.max_rows = window, max_rows

    def accepts(self, meta: DSV41StepMetadata) -> bool:
        """Not a decode step; within the row and request bounds; no request with more than a window of rows (the
        decoder would prune it, and the gather bounds assume at most that many); a captured key, or room for one (the
        one place :data:`MAX_MIXED_GRAPHS` holds: a step of a new key past it runs eagerly, uncaptured)."""
        if not (meta.num_reqs < meta.num_tokens <= self.max_rows and meta.num_reqs <= self.max_batch):
            return False
        if int(meta.query_lens.max()) > self.window or not self._fits(meta):
            return False
        return len(self.entries) < MAX_MIXED_GRAPHS or self.key(meta) in self.entries

    def key(self, meta: DSV41StepMetadata) -> tuple[int, ...]:
        """(a power of two >= the requests, plus the padding request; the row bucket; the context bucket).  The padding
        request comes on top of the power of two, so a step of 64 requests shares its key with one of 48 (the batch-64
        workload's tail step and its warm-up's, whose first requests finished early: with the padding request inside
        the power of two they were 128 and 64, and the timed run paid a capture, session 20)."""
        return _pow2_at_least(meta.num_reqs) + 1, mixed_row_bucket(meta.num_tokens), self._context(meta)

    def _padded(self, meta: DSV41StepMetadata, key: tuple[int, ...]) -> DSV41StepMetadata:
        return pad_mixed_meta(meta, key[1], key[0])

    def _static_step(self, padded: DSV41StepMetadata, device: torch.device, key: tuple[int, ...]) -> StaticStep:
        return StaticStep(padded, device, key[-1], rows_per_request=self.window)


class DecoderGraphs(_GraphSet):
    """The decoder layers of prefill steps on their kept rows, captured per (request bucket, row bucket, context
    bucket); ``run_decoder(step, S, pre, carry)`` is the model's decoder-layer loop from the boundary layer's
    outputs (S [R, C, H], pre [R, C]) over a step whose rows are the kept rows; ``carry`` holds what the decoder
    layers read from the encoder's per-step results (the boundary layer's top-k ids, candidate blocks), one row
    per kept row, padded with -1 (nothing selected)."""

    what = "the decoder layers of prefill steps"

    def __init__(self, run_decoder: Callable[[Step, torch.Tensor, torch.Tensor, dict],
                                             tuple[torch.Tensor, torch.Tensor]],
                 max_rows: int, max_context: int, window: int):
        super().__init__(max_context)
        self.run_decoder = run_decoder
        self.max_rows = max_rows
        self.window = window  # a request's kept rows: at most its last ``window`` (model.kept_rows_host)

    def key(self, meta: DSV41StepMetadata, n_kept: int) -> tuple[int, int, int]:
        return _pow2_at_least(meta.num_reqs), kept_row_bucket(n_kept), self._context(meta)

    def accepts(self, meta: DSV41StepMetadata, n_kept: int) -> bool:
        """Rows and requests within the captured sizes, and no request keeping more than a window of rows (prompt
        logprobs, poolers past the last row): the static step's gather bounds assume at most that many."""
        return (0 < n_kept <= self.max_rows and meta.num_reqs > 0 and self._fits(meta)
                and not bool((meta.keeps_rows & (meta.query_lens > self.window)).any()))

    def run(self, meta: DSV41StepMetadata, kept: torch.Tensor, kept_dev: torch.Tensor, S: torch.Tensor,
            pre: torch.Tensor, carry: dict, device: torch.device, capture: bool = True
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """(S, pre) of the kept rows after the decoder layers.  ``kept``: host row indices (``kept_dev`` on the
        device); ``S``, ``pre``: the boundary layer's outputs on those rows; ``carry``: see the class.
        ``capture=False`` runs the padded static step eagerly (the CPU check of the padding)."""
        n = kept.numel()
        key = self.key(meta, n)
        B, R, ctx = key
        self.entries_seen.add(key)
        kmeta = kept_step_meta(meta, kept, kept_dev, R, B)
        inputs = {"S": S, "pre": pre, **carry}
        entry = self.entries.get(key)
        if entry is not None and entry[2].keys() == inputs.keys():
            step, graph, bufs, (S_out, pre_out) = entry
            self._load(step, kmeta, bufs, inputs)
            graph.replay()
            return S_out[:n], pre_out[:n]
        step = StaticStep(kmeta, device, ctx, rows_per_request=self.window)
        bufs = {k: t.new_full((R, *t.shape[1:]), self._padding(k)) for k, t in inputs.items()}
        self._load(step, kmeta, bufs, inputs)

        def decoder():
            return self.run_decoder(step, bufs["S"], bufs["pre"], {k: bufs[k] for k in carry})

        with _static_step():
            S_eager, pre_eager = decoder()  # this step's answer, and the warm-up before capture
        # past MAX_DECODER_GRAPHS captured buckets, new ones run eagerly (each keeps its activations' memory)
        got = self._capture(step, decoder) if capture and len(self.entries) < MAX_DECODER_GRAPHS else None
        if got is not None:
            graph, outs = got
            self.entries[key] = (step, graph, bufs, outs)
        return S_eager[:n], pre_eager[:n]

    @staticmethod
    def _padding(key) -> int:
        """What a padded row of an input holds: zero streams (``S``, ``pre``), no selection (the carried ids)."""
        return 0 if key in ("S", "pre") else -1

    @classmethod
    def _load(cls, step: StaticStep, kmeta: DSV41StepMetadata, bufs: dict, inputs: dict) -> None:
        """The kept step's metadata into the step's buffers, each input into its buffer's first rows."""
        step.load(kmeta, step.input_ids, 0)
        for k, t in inputs.items():
            b = bufs[k]
            b[:t.shape[0]].copy_(t)
            b[t.shape[0]:].fill_(cls._padding(k))
