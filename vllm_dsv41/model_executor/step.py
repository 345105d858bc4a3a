"""The model's view of one engine step: the attention backend's metadata plus per-step scratch.

Owns :class:`Step`, a thin wrapper over ``DSV41StepMetadata`` that adds what the
layers compute once per step and share (top-k selections, candidate blocks), the
Engram lookback windows built from this step's ids, the runner's history and the device token history
(:class:`TokenHistory`, for the ids the host does not know under async scheduling), and
the move of the (CPU) metadata to the activations' device: every tensor field the
model reads is copied to ``device`` once per step and cached (on CPU the copy is
the tensor itself).  Host-side decisions (loop bounds, shapes) read the ``*_cpu``
fields, so they never wait for the device.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from vllm_dsv41.attention.backend import DSV41GroupMetadata, DSV41StepMetadata


class GroupView:
    """One KV-cache group's addressing for this step, on the step's device.

    ``block_table`` is int64 (indexing dtype), ``block_table_i32`` the int32 table the ops take;
    ``slot_mapping`` / ``ring_block_ids`` (int64) as in :class:`DSV41GroupMetadata`, moved on first use.
    """

    def __init__(self, md: DSV41GroupMetadata, device: torch.device):
        self.md = md
        self.device = device
        self.kind = md.kind
        self.rows_per_block = md.rows_per_block
        self.block_table_i32 = md.block_table.to(device=device, dtype=torch.int32)
        self._bt64: torch.Tensor | None = None
        self._slots: torch.Tensor | None = None

    @property
    def slot_mapping(self) -> torch.Tensor:
        if self._slots is None:
            self._slots = self.md.slot_mapping.to(device=self.device, dtype=torch.int64)
        return self._slots

    @property
    def ring_block_ids(self) -> torch.Tensor | None:
        """A ring group's block of each request: the table's first column (int64)."""
        return self.block_table[:, 0] if self.kind == "ring" else None

    @property
    def block_table(self) -> torch.Tensor:
        """The table as int64 (the plain path's indexing dtype), made on first use."""
        if self._bt64 is None:
            self._bt64 = self.block_table_i32.to(torch.int64)
        return self._bt64

    def slots_of_entries(self, req_idx: int, entries: torch.Tensor) -> torch.Tensor:
        """Rows of one request's entries (token positions for swa, compressed indices j for
        compressed groups) through its block table (all entries valid, >= 0)."""
        e = self.rows_per_block
        entries = entries.to(torch.int64)
        return self.block_table[req_idx][entries // e] * e + entries % e

    def slots_of(self, req: torch.Tensor, entries: torch.Tensor, flat: tuple[int, int] | None = None) -> torch.Tensor:
        """Batched form: ``req`` [R] request of each row, ``entries`` [R, K] (-1 = none) -> slots
        [R, K] int64, -1 where the entry is -1.  ``flat = (bstep, rstep)``: rows of the cache's flat view
        instead (``CacheLayer.flat_slots`` of the slots, in the same pass).  One ``dsv41::paged_rows``."""
        from vllm_dsv41.ops.paged_rows import paged_rows

        e = self.rows_per_block
        bstep, rstep = flat if flat is not None else (e, 1)
        return paged_rows(self.block_table_i32, req, entries, e, bstep, rstep)


@dataclass
class Step:
    meta: DSV41StepMetadata
    input_ids: torch.Tensor | None  # [T] this step's token ids (on the model's device)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    use_ops: bool = False  # route the math through torch.ops.dsv41 (model.ops_mode / use_ops)
    scratch: dict = field(default_factory=dict)  # per-step results shared across layers
    _dev: dict = field(default_factory=dict, repr=False)  # cached device copies of metadata
    _groups: dict = field(default_factory=dict, repr=False)  # id(group metadata) -> GroupView
    _aranges: dict = field(default_factory=dict, repr=False)  # n -> arange(n), see all_rows / take
    _rows: dict = field(default_factory=dict, repr=False)  # id(token index) -> (it, positions, requests), rows_of

    def all_rows(self, n: int) -> torch.Tensor:
        """``arange(n)`` on the step's device, one object per length: indexing a length-n tensor with it
        is the identity, which :meth:`take` skips (decode steps and unpruned prefill select all rows)."""
        got = self._aranges.get(n)
        if got is None:
            got = self._aranges[n] = torch.arange(n, device=self.device)
        return got

    def once(self, key, make):
        """``make()``, computed once per step under ``key`` in :attr:`scratch` (shared by the layers that
        ask for the same key); ``key`` None computes without keeping it."""
        if key is None:
            return make()
        got = self.scratch.get(key)
        if got is None:
            got = self.scratch[key] = make()
        return got

    def take(self, t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """``t[idx]`` along dim 0, without a gather when ``idx`` is :meth:`all_rows` of ``t``'s length."""
        return t if idx is self._aranges.get(t.shape[0]) else t[idx]

    def rows_of(self, tok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions, request index) of the step rows ``tok``: the step's own tensors when ``tok`` is every row,
        else gathered once per index tensor and step (the decoder layers share their pruned rows).  The step keeps
        ``tok`` alive with the result, so both results are step-held objects: per-step caches may key on their
        ``id``."""
        pos = self.positions
        if tok is self._aranges.get(pos.shape[0]):  # as take(): every row
            return pos, self.req_idx
        got = self._rows.get(id(tok))
        if got is None:
            got = self._rows[id(tok)] = (tok, pos[tok], self.req_idx[tok])
        return got[1], got[2]

    def _on_device(self, name: str) -> torch.Tensor:
        """Metadata field ``name`` as int64 on the step's device: the builders' copy when they made one
        (``DSV41StepMetadata.on``), so each field crosses to the device once per step."""
        got = self._dev.get(name)
        if got is None:
            got = self._dev[name] = self.meta.on(name, self.device, torch.int64)
        return got

    # -- host-side facts (CPU tensors / ints: loop bounds and shapes, no device sync)
    @property
    def num_reqs(self) -> int:
        return self.meta.num_reqs

    @property
    def num_tokens(self) -> int:
        return self.meta.num_tokens

    @property
    def positions_cpu(self) -> torch.Tensor:
        return self.meta.positions

    @property
    def query_start_loc_cpu(self) -> torch.Tensor:
        return self.meta.query_start_loc

    @functools.cached_property
    def max_position(self) -> int:
        """Largest position of the step (-1 for an empty step), read on the host."""
        p = self.meta.positions
        return int(p.max()) if p.numel() else -1

    # -- device tensors (moved once per step)
    @property
    def positions(self) -> torch.Tensor:
        return self._on_device("positions")

    @property
    def req_idx(self) -> torch.Tensor:
        return self._on_device("token_req_idx")

    @property
    def query_start_loc(self) -> torch.Tensor:
        return self._on_device("query_start_loc")

    @property
    def seq_lens(self) -> torch.Tensor:
        return self._on_device("seq_lens")

    @property
    def replay_start(self) -> torch.Tensor:
        return self._on_device("replay_start")

    @functools.cached_property
    def request_spans(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(first, last) position of every request's rows in this step, host int64 [num_reqs] (a request without
        rows: first 0, last -1)."""
        qsl = self.meta.query_start_loc.to(torch.int64)
        p = self.meta.positions.to(torch.int64)
        has = qsl[1:] > qsl[:-1]
        if p.numel() == 0:
            return torch.zeros_like(has, dtype=torch.int64), torch.full_like(has, -1, dtype=torch.int64)
        first = torch.where(has, p[qsl[:-1].clamp(max=p.numel() - 1)], 0)
        last = torch.where(has, p[(qsl[1:] - 1).clamp(min=0)], -1)
        return first, last

    #: Whether attention may take the gathered-keys path (``ops.sparse_attn_gathered``) in this step when it runs
    #: as a static step (no host read allowed: its plans need static bounds, :meth:`gather_bounds`).
    gathers_when_static = False

    def gather_bounds(self, window: int, swa_rows_per_block: int, ratio: int, comp_rows_per_block: int
                      ) -> tuple[int, int]:
        """Host bounds on the SWA and compressed cache blocks this step's attention lists can touch (so the gather
        plans are made without a host read): from the requests' position spans (:attr:`request_spans`); the
        compressed bound is 0 for ``ratio`` 0."""
        from vllm_dsv41.ops.sparse_attn_gathered import entry_block_bound, swa_block_bound

        first, last = self.request_spans
        swa = swa_block_bound(first, last, window, swa_rows_per_block)
        return swa, entry_block_bound(last, ratio, comp_rows_per_block) if ratio else 0

    def needs_pruning(self, window: int) -> bool:
        """Decoder pruning pays off only when some request brings more than ``window`` rows (and none of its rows'
        logits is read: prompt logprobs)."""
        return bool(self.meta.trimmed(window).any())

    def views_of_kind(self, kind: str) -> list[GroupView]:
        """Every KV-cache group of ``kind`` (``swa``, ``compressed``, ``ring``), each once, in the metadata's order."""
        views: dict[int, GroupView] = {}
        for name in self.meta.groups:
            v = self.group(name)
            if v.kind == kind:
                views.setdefault(id(v), v)
        return list(views.values())

    def group(self, layer_name: str) -> GroupView:
        md = self.meta.for_layer(layer_name)
        view = self._groups.get(id(md))
        if view is None:
            view = self._groups[id(md)] = GroupView(md, self.device)
        return view

    def token_windows(self, depth: int, history: "TokenHistory | None" = None) -> torch.Tensor:
        """[T, depth] ids of positions p, p-1, ..., p-depth+1 of every token; -1 before position 0.

        Lookbacks inside the step come from ``input_ids``, older ones from the runner's lookback ids
        (nearest first) or, where the host does not know them (-1: generated ids under async scheduling), from
        ``history``, which then takes this step's ids; computed on the device of ``input_ids`` without a host
        round trip.  Once per step and depth (the history is read before it is written)."""
        return self.once(("token_windows", depth, history is not None),
                         lambda: self._token_windows(depth, history))

    def _token_windows(self, depth: int, history: "TokenHistory | None") -> torch.Tensor:
        ids = self.input_ids.to(device=self.device, dtype=torch.long)
        dev = self.device
        T = ids.numel()
        req, pos = self.req_idx, self.positions
        starts = self.query_start_loc[req]
        look = self._on_device("lookback_token_ids")
        t = torch.arange(T, device=dev)
        k = torch.arange(depth, device=dev)
        off = (t - starts)[:, None]  # offset of each token inside its request's chunk
        in_chunk = off >= k[None, :]
        from_ids = ids[(t[:, None] - k[None, :]).clamp(min=0)]
        li = k[None, :] - off - 1  # lookback index, nearest first
        have = (li >= 0) & (li < look.shape[1])
        from_look = look[req[:, None], li.clamp(0, look.shape[1] - 1)]
        from_look = torch.where(have, from_look, torch.full_like(from_look, -1))
        if history is not None:
            hist_row = self._on_device("history_rows")[req]
            from_look = torch.where(from_look >= 0, from_look, history.read(hist_row, pos[:, None] - k[None, :]))
            history.write(hist_row, pos, self.seq_lens[req] - 1, ids)
        out = torch.where(in_chunk, from_ids, from_look)
        return torch.where(pos[:, None] - k[None, :] >= 0, out, torch.full_like(out, -1))


class TokenHistory:
    """Each request's latest token ids on the device: row ``history_rows[i]`` of request i (assigned by the runner
    hooks, ``backend.TokenHistoryRows``) holds the id of position p at column p % SPAN, for the last SPAN positions
    the request brought to a step.  Under async scheduling the runner's host token table holds placeholders for the
    generated ids (they stay on the GPU), so the Engram lookback of a step's first rows comes from here.

    A step reads positions before its rows' first and then writes its rows, so a later write can clobber a position
    still to be read only when a step brings more than ``SPAN - LOOKBACK_DEPTH`` rows of a request that are not all
    kept (speculative verify rows: the rejected ones); hence SPAN well above any draft length.  The last row is
    the sink of rows without a request (padding), never read: reads of rows without one give -1."""

    SPAN = 32

    def __init__(self, requests: int, device: torch.device):
        self.requests = requests
        self.ids = torch.full((requests + 1, self.SPAN), -1, dtype=torch.int32, device=device)

    def read(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Ids at ``positions`` [T, k] of the requests' ``rows`` [T] (int64, -1 = none) -> [T, k] int64, -1 where
        the row is -1."""
        r = rows[:, None].expand_as(positions)
        got = self.ids[r.clamp(min=0), positions % self.SPAN].to(torch.int64)
        return torch.where(r >= 0, got, torch.full_like(got, -1))

    def write(self, rows: torch.Tensor, positions: torch.Tensor, last: torch.Tensor, ids: torch.Tensor) -> None:
        """Store ``ids`` [T] at ``positions`` [T] of ``rows`` [T], keeping each request's positions after
        ``last - SPAN`` (``last`` [T]: its request's last position in the step); other rows go to the sink."""
        keep = (rows >= 0) & (positions > last - self.SPAN)
        self.ids[torch.where(keep, rows, self.requests), positions % self.SPAN] = ids.to(torch.int32)
