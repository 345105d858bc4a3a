"""Attention backend, metadata builder and per-step metadata of our caches.

Owns: ``DSV41CacheBackend`` (the backend every cache layer of the plugin
returns from ``get_attn_backend``), its metadata builder, and the two
dataclasses the model reads in ``forward``:

* ``DSV41StepMetadata``: per step, per request (row order of the runner's
  input batch): request ids, query_start_loc, seq_lens, context lengths,
  positions, token -> request index, ``replay_start``, Engram lookback ids and
  each request's row in the model's token history (:class:`TokenHistoryRows`).
* ``DSV41GroupMetadata``: per KV-cache group: block table, slot mapping (the
  runner's for SWA groups; computed from the table on first use for compressed
  and ring groups, :func:`compressed_slots` / :func:`ring_slots`, so a decode
  step served by a captured graph, which computes them inside the graph, never
  pays for them on the host), ring block ids; each links back to its step.

The backend does no attention math; the model does that in torch.  The
runner calls ``build`` once per KV-cache group; the per-request fields come
from the step context that ``runner_hooks`` publishes around the runner's
``_build_attention_metadata``.  Without the hooks (or outside model runner
V1) the builder still works, with ``replay_start`` 0 and lookback ids -1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from vllm.v1.kv_cache_interface import (
    CircularBufferSpec,
    KVCacheLayout,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheSpec

BACKEND_NAME = "DSV41_CACHE"
LOOKBACK_DEPTH = 3
PAD_SLOT = -1


def host_to_device(t: torch.Tensor, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``t.to(device, dtype)`` for a host tensor without waiting for the device: a plain ``.to`` of a host tensor
    synchronises the stream (PyTorch's blocking host-to-device copy), which in an eager prefill step stalls the host
    until the GPU has run every kernel queued so far.  Through pinned memory, non-blocking (the pinned block is not
    reused before the copy ran)."""
    dtype = dtype or t.dtype
    if t.device.type != "cpu" or torch.device(device).type != "cuda":
        return t.to(device=device, dtype=dtype)
    src = t.to(dtype)
    return (src if src.is_pinned() else src.pin_memory()).to(device, non_blocking=True)


@dataclass
class DSV41StepMetadata:
    """What one engine step schedules, request by request (CPU tensors).

    Rows follow the runner's input batch; ``req_ids[i]`` is ``None`` for rows
    without a request (dummy/profile runs).  Tokens are flattened request by
    request: request ``i`` owns ``query_start_loc[i]:query_start_loc[i+1]``.
    """

    num_reqs: int
    num_tokens: int
    req_ids: list[str | None]
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32, context + this step's tokens
    context_lens: torch.Tensor  # [num_reqs] int32, tokens computed before
    positions: torch.Tensor  # [num_tokens] int64
    token_req_idx: torch.Tensor  # [num_tokens] int64, row of each token
    # Position below which the request holds no SWA KV (bounded replay after
    # a prefix hit); 0 when nothing was replayed.  Constant per request.
    replay_start: torch.Tensor  # [num_reqs] int32
    # Tokens the scheduler replays after a hit (the SWA window); 0 if off.
    replay_window: int
    # lookback_token_ids[i, j] = token id at position context_lens[i] - 1 - j
    # (nearest first, like vLLM's own ``lookback_token_ids``); -1 if unknown.
    lookback_token_ids: torch.Tensor  # [num_reqs, 3] int32
    is_prefill: torch.Tensor  # [num_reqs] bool, still inside the prompt
    # Each request's row in the model's device token history (``step.TokenHistory``), which supplies the lookback
    # ids the host does not know (generated tokens under async scheduling); -1: none.
    history_rows: torch.Tensor | None = None  # [num_reqs] int32; None -> all -1
    # Requests whose every row is read (prompt logprobs, poolers past the last row): the decoder layers never trim
    # them (§3.2).
    keeps_rows: torch.Tensor | None = None  # [num_reqs] bool; None -> all False
    # Layer name -> metadata of the KV-cache group that layer belongs to.
    groups: dict[str, DSV41GroupMetadata] = field(default_factory=dict, repr=False)
    _on: dict = field(default_factory=dict, repr=False)  # (name, device) -> copy, see ``on``

    def __post_init__(self):
        if self.history_rows is None:
            self.history_rows = torch.full((self.num_reqs,), -1, dtype=torch.int32)
        if self.keeps_rows is None:
            self.keeps_rows = torch.zeros(self.num_reqs, dtype=torch.bool)

    def trimmed(self, window: int) -> torch.Tensor:
        """[num_reqs] bool (host): the requests whose rows the decoder layers trim to their last ``window`` (CED
        pruning, §3.2): more rows than that, and no reader of every row's logits."""
        return (self.query_lens > window) & ~self.keeps_rows

    def on(self, name: str, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Tensor field ``name`` (or ``replayed``, the replayed-token mask) on ``device`` (as ``dtype``),
        copied once per step for all groups' builders and the model."""
        key = (name, str(device), dtype)
        got = self._on.get(key)
        if got is None:
            t = self.replayed_token_mask() if name == "replayed" else getattr(self, name)
            got = self._on[key] = host_to_device(t, device, dtype)
        return got

    @property
    def query_lens(self) -> torch.Tensor:
        return self.query_start_loc[1:] - self.query_start_loc[:-1]

    def for_layer(self, layer_name: str) -> DSV41GroupMetadata:
        return self.groups[layer_name]

    def replayed_token_mask(self) -> torch.Tensor:
        """[num_tokens] bool: tokens the scheduler replays after a prefix hit
        (their cached global KV must not be rewritten)."""
        return replayed_mask(self.replay_start, self.token_req_idx, self.positions, self.replay_window)


def replayed_mask(replay_start: torch.Tensor, req_idx: torch.Tensor, positions: torch.Tensor,
                  window: int) -> torch.Tensor:
    """[T] bool: token t (of request ``req_idx[t]``, at ``positions[t]``) lies in its request's replayed
    range [replay_start, replay_start + window); requests with replay_start 0 replayed nothing."""
    start = replay_start.to(torch.int64)[req_idx]
    return (start > 0) & (positions >= start) & (positions < start + window)


def compressed_slots(block_table: torch.Tensor, positions: torch.Tensor, req_idx: torch.Tensor,
                     replayed: torch.Tensor, tokens_per_state: int, rows_per_block: int) -> torch.Tensor:
    """[T] int64 rows of a compressed group written by the step's tokens: entry j = p // r is written by
    the token with (p + 1) % r == 0 at row table[j // E] * E + j % E (E rows per block); replayed tokens
    and tokens of rows without blocks (block 0: dummy and padded rows) write nothing (-1)."""
    r, e = tokens_per_state, rows_per_block
    if positions.numel() == 0:
        return torch.empty(0, dtype=torch.int64, device=block_table.device)
    entry = positions // r
    col = (entry // e).clamp_(max=block_table.shape[1] - 1)
    blocks = block_table[req_idx, col].to(torch.int64)
    writes = ((positions + 1) % r == 0) & (blocks > 0) & ~replayed
    return torch.where(writes, blocks * e + entry % e, PAD_SLOT)


def ring_slots(ring_block_ids: torch.Tensor, positions: torch.Tensor, req_idx: torch.Tensor,
               capacity: int) -> torch.Tensor:
    """[T] int64 rows of a ring group: row p % capacity of the token's request's ring block; -1 for
    requests without one (block 0)."""
    ring = ring_block_ids.to(torch.int64)[req_idx]
    return torch.where(ring > 0, ring * capacity + positions % capacity, PAD_SLOT)


def table_slots(kind: str, block_table: torch.Tensor, positions: torch.Tensor, req_idx: torch.Tensor,
                replayed: Callable[[], torch.Tensor], tokens_per_state: int, rows_per_block: int,
                block_size: int) -> torch.Tensor:
    """[T] int64 slots of a compressed group (:func:`compressed_slots`; ``replayed()`` gives the replayed-token
    mask, asked for only here) or a ring group (:func:`ring_slots`, the ring block is the table's first
    column), computed from the group's block table."""
    if kind == "compressed":
        return compressed_slots(block_table, positions, req_idx, replayed(), tokens_per_state, rows_per_block)
    if kind == "ring":
        return ring_slots(block_table[:, 0], positions, req_idx, block_size)
    raise ValueError(f"{kind} group: its slots are not computed from the table (the runner's slot mapping is needed)")


@dataclass
class DSV41GroupMetadata:
    """Addressing of one KV-cache group for the current step.

    ``slot`` ``s`` is row ``s % rows_per_block`` of block
    ``s // rows_per_block`` in the layer's cache (see ``caches.py``).
    """

    kind: str  # "swa" | "compressed" | "ring"
    block_size: int  # original tokens per block (ring: capacity)
    tokens_per_state: int  # tokens per row (compressed ratio; 1 otherwise)
    rows_per_block: int
    # [num_reqs, max_blocks] int32, the runner's own table on its device (no host copy per step)
    block_table: torch.Tensor
    layer_names: list[str]
    step: DSV41StepMetadata = field(repr=False)
    # [num_tokens] slots the builder was given: the runner's slot mapping of a SWA group (None for the
    # groups whose slots are computed from the table, see ``slot_mapping``)
    runner_slots: torch.Tensor | None = None
    _slots: torch.Tensor | None = field(default=None, repr=False)

    @property
    def slot_mapping(self) -> torch.Tensor:
        """[num_tokens] int64 row each token writes, -1 = no write.  swa: the token's own row (the
        runner's); compressed: row of entry p // r, written only by the token with (p + 1) % r == 0 and
        never for replayed tokens; ring: row p % capacity of the request's ring block.  Computed on
        first use."""
        if self._slots is None:
            self._slots = self._make_slots()
        return self._slots

    def _make_slots(self) -> torch.Tensor:
        if self.runner_slots is not None:
            return self.runner_slots.to(torch.int64)
        st, dev = self.step, self.block_table.device
        return table_slots(self.kind, self.block_table, st.on("positions", dev, torch.int64),
                           st.on("token_req_idx", dev, torch.int64), lambda: st.on("replayed", dev),
                           self.tokens_per_state, self.rows_per_block, self.block_size)

    @property
    def ring_block_ids(self) -> torch.Tensor | None:
        """[num_reqs] int32 ring block of each request (ring groups: the table's first column), else None."""
        return self.block_table[:, 0] if self.kind == "ring" else None

    def slots_of_entries(self, req_idx: int, entries: torch.Tensor) -> torch.Tensor:
        """Rows of a request's entries (token positions for swa, compressed
        indices j for compressed groups) through its block table."""
        e = self.rows_per_block
        entries = entries.to(torch.int64)
        blocks = self.block_table[req_idx].to(torch.int64)[entries // e]
        return blocks * e + entries % e


def current_step() -> DSV41StepMetadata | None:
    """The step metadata of the running forward; None without attention
    metadata (profile/dummy runs that skip attention)."""
    if not is_forward_context_available():
        return None
    attn_metadata = get_forward_context().attn_metadata
    if not isinstance(attn_metadata, dict):
        return None
    for value in attn_metadata.values():
        if isinstance(value, DSV41GroupMetadata):
            return value.step
    return None


def layer_metadata(layer_name: str) -> DSV41GroupMetadata | None:
    """The group metadata of one cache layer in the running forward."""
    if not is_forward_context_available():
        return None
    attn_metadata = get_forward_context().attn_metadata
    if not isinstance(attn_metadata, dict):
        return None
    value = attn_metadata.get(layer_name)
    return value if isinstance(value, DSV41GroupMetadata) else None


# --------------------------------------------------------------------------
# Step context: published by runner_hooks around one metadata build.


@dataclass
class RunnerStepInfo:
    """Per-request facts only the model runner knows (numpy, row order)."""

    req_ids: list[str]
    replay_start: np.ndarray  # [n] int32
    replay_window: int
    lookback_token_ids: np.ndarray  # [n, LOOKBACK_DEPTH] int32
    is_prefill: np.ndarray  # [n] bool
    history_rows: np.ndarray | None = None  # [n] int32, see DSV41StepMetadata.history_rows
    keeps_rows: np.ndarray | None = None  # [n] bool, see DSV41StepMetadata.keeps_rows
    step: DSV41StepMetadata | None = None  # built by the first group


def history_capacity(max_num_seqs: int) -> int:
    """Rows of the model's token history (``step.TokenHistory``) and of :class:`TokenHistoryRows`: room for the
    running requests and for as many again that were preempted or paused, so that the least recently scheduled
    request is evicted only when more than that are alive."""
    return max(1024, 4 * max_num_seqs)


class TokenHistoryRows:
    """Assigns each request a row of the model's device token history (``step.TokenHistory``): on its first step,
    kept until it finishes (:meth:`release`).  When every row is taken the least recently scheduled request not in
    the step loses its row: a request resumed after preemption brings all its token ids to the runner again, so its
    host lookback ids are known and its old row is not needed; a request that was only paused would read another
    request's ids (:func:`history_capacity` makes that need more than 3x ``max_num_seqs`` requests alive)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.rows: dict[str, int] = {}  # insertion order = least recently scheduled first
        self.free = list(range(capacity - 1, -1, -1))
        self.evicted = 0

    def rows_for(self, req_ids: list) -> np.ndarray:
        out = np.full(len(req_ids), -1, dtype=np.int32)
        step = set(req_ids)
        for i, r in enumerate(req_ids):
            if r is None:
                continue
            row = self.rows.pop(r, None)
            if row is None:
                row = self.free.pop() if self.free else self._evict(step)
            self.rows[r] = row  # re-inserted: most recently scheduled
            out[i] = row
        return out

    def _evict(self, keep: set) -> int:
        victim = next(r for r in self.rows if r not in keep)
        self.evicted += 1
        return self.rows.pop(victim)

    def release(self, req_ids) -> None:
        for r in req_ids:
            row = self.rows.pop(r, None)
            if row is not None:
                self.free.append(row)


_pending: RunnerStepInfo | None = None


def set_pending_step_info(info: RunnerStepInfo | None) -> None:
    global _pending
    _pending = info


def _build_step(
    cm: CommonAttentionMetadata, info: RunnerStepInfo | None, cpu_seq_lens_exact: bool = False
) -> DSV41StepMetadata:
    """The step's host metadata.  ``cpu_seq_lens_exact``: the runner's CPU bound on ``seq_lens`` is exact
    (no speculative decoding), so nothing is read back from the device: a read-back would wait for the
    previous step's kernels and undo async scheduling's overlap."""
    num_reqs = cm.num_reqs
    qsl = cm.query_start_loc_cpu[: num_reqs + 1].to(torch.int32)
    num_tokens = int(qsl[-1])
    query_lens = (qsl[1:] - qsl[:-1]).to(torch.int64)
    if cpu_seq_lens_exact and cm.seq_lens_cpu_upper_bound is not None:
        seq_lens = cm.seq_lens_cpu_upper_bound[:num_reqs].to(torch.int32)
    else:
        seq_lens = cm.seq_lens[:num_reqs].to("cpu", torch.int32)
    context_lens = seq_lens - query_lens.to(torch.int32)
    # each request's positions run from its context length on (text-only: no M-RoPE positions)
    positions = _positions_from(context_lens, query_lens)
    token_req_idx = torch.repeat_interleave(torch.arange(num_reqs), query_lens)

    replay_start = torch.zeros(num_reqs, dtype=torch.int32)
    lookback = torch.full((num_reqs, LOOKBACK_DEPTH), -1, dtype=torch.int32)
    is_prefill = torch.zeros(num_reqs, dtype=torch.bool)
    history_rows = torch.full((num_reqs,), -1, dtype=torch.int32)
    keeps_rows = torch.zeros(num_reqs, dtype=torch.bool)
    req_ids: list[str | None] = [None] * num_reqs
    replay_window = 0
    if info is not None:
        n = min(len(info.req_ids), num_reqs)
        req_ids[:n] = info.req_ids[:n]
        replay_start[:n] = torch.from_numpy(info.replay_start[:n])
        lookback[:n] = torch.from_numpy(info.lookback_token_ids[:n])
        is_prefill[:n] = torch.from_numpy(info.is_prefill[:n])
        if info.history_rows is not None:
            history_rows[:n] = torch.from_numpy(info.history_rows[:n])
        if info.keeps_rows is not None:
            keeps_rows[:n] = torch.from_numpy(info.keeps_rows[:n])
        replay_window = info.replay_window
    elif cm.is_prefilling is not None:
        is_prefill[:] = cm.is_prefilling[:num_reqs].cpu()

    return DSV41StepMetadata(
        num_reqs=num_reqs,
        num_tokens=num_tokens,
        req_ids=req_ids,
        query_start_loc=qsl,
        seq_lens=seq_lens,
        context_lens=context_lens,
        positions=positions,
        token_req_idx=token_req_idx,
        replay_start=replay_start,
        replay_window=replay_window,
        lookback_token_ids=lookback,
        is_prefill=is_prefill,
        history_rows=history_rows,
        keeps_rows=keeps_rows,
    )


def _positions_from(context_lens: torch.Tensor, query_lens: torch.Tensor):
    starts = torch.repeat_interleave(context_lens.to(torch.int64), query_lens)
    offsets = torch.arange(int(query_lens.sum())) - torch.repeat_interleave(
        torch.cumsum(query_lens, 0) - query_lens, query_lens
    )
    return starts + offsets


# --------------------------------------------------------------------------
# Backend and builder.


def _spec_kind(spec: KVCacheSpec) -> str:
    if isinstance(spec, SlidingWindowMLASpec):
        return "swa"
    if isinstance(spec, CircularBufferSpec):
        return "ring"
    if isinstance(spec, MLAAttentionSpec):
        return "compressed"
    raise TypeError(f"{BACKEND_NAME} does not handle {type(spec).__name__}")


class DSV41CacheMetadataBuilder(AttentionMetadataBuilder[DSV41GroupMetadata]):
    """Turns the runner's per-group metadata into ``DSV41GroupMetadata``."""

    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.kind = _spec_kind(kv_cache_spec)
        tps = kv_cache_spec.tokens_per_state
        self.tokens_per_state = int(tps) if self.kind == "compressed" else 1
        self.rows_per_block = kv_cache_spec.block_size // self.tokens_per_state
        self.cpu_seq_lens_exact = vllm_config.speculative_config is None

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> DSV41GroupMetadata:
        del common_prefix_len, fast_build
        cm = common_attn_metadata
        info = _pending
        if info is not None and info.step is not None:
            step = info.step
        else:
            step = _build_step(cm, info, self.cpu_seq_lens_exact)
            if info is not None:
                info.step = step

        n, t = step.num_reqs, step.num_tokens
        metadata = DSV41GroupMetadata(
            kind=self.kind,
            block_size=self.kv_cache_spec.block_size,
            tokens_per_state=self.tokens_per_state,
            rows_per_block=self.rows_per_block,
            block_table=cm.block_table_tensor[:n],  # stays on the runner's device
            layer_names=list(self.layer_names),
            step=step,
            runner_slots=cm.slot_mapping[:t] if self.kind == "swa" else None,
        )
        for name in self.layer_names:
            step.groups[name] = metadata
        return metadata


class DSV41CacheBackend(AttentionBackend):
    """Storage-only backend: allocation constraints and metadata, no kernels."""

    supported_dtypes = [torch.float32, torch.bfloat16, torch.float16]
    supported_kv_cache_dtypes = []  # any; our layers pick their own dtype

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> Any:
        raise NotImplementedError(f"{BACKEND_NAME} has no attention impl")

    @staticmethod
    def get_builder_cls() -> type[DSV41CacheMetadataBuilder]:
        return DSV41CacheMetadataBuilder

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # Our groups mix page sizes (32-token SWA pages, compressed pages,
        # fp32 rings); only block-outermost layouts let vLLM pack them side by
        # side in one block instead of unifying page sizes.
        return (KVCacheLayout.BLHNC, KVCacheLayout.BLNHC)


_registered = False


def register_cache_backend() -> None:
    """Add ``DSV41_CACHE`` to ``AttentionBackendEnum`` once per process."""
    global _registered
    if _registered:
        return
    from vllm.v1.attention.backends.registry import (
        AttentionBackendEnum,
        register_backend,
    )

    path = f"{DSV41CacheBackend.__module__}.{DSV41CacheBackend.__qualname__}"
    if BACKEND_NAME in AttentionBackendEnum.__members__:
        register_backend(AttentionBackendEnum[BACKEND_NAME], path)
    else:
        register_backend(BACKEND_NAME, path)
    _registered = True
