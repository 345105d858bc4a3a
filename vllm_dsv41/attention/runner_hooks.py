"""Version-pinned hooks on vLLM 0.32's model runner V1 (``GPUModelRunner``,
which ``CPUModelRunner`` inherits).

Owns: carrying to our metadata builder what model runner V1 knows but never
forwards to attention metadata:

* ``replay_start`` per request.  The scheduler sets it on a prefix-cache hit
  when a KV-cache group declares ``prefix_replay_tokens`` (our bounded-replay
  SWA spec) and sends it in ``NewRequestData.replay_start``; runner V1 drops
  it.  A wrapper around ``_update_states`` records it per request id.
  Requests resumed after preemption come as cached requests, which carry no
  ``replay_start``; for them it is inferred as their admitted
  ``num_computed_tokens`` (the scheduler rewinds exactly to ``replay_start``
  when it replays; wrong only with a KV connector that restores the window).
* ring groups take no token slot mapping: runner V1 computes one for every
  non-Mamba group, which for a ``CircularBufferSpec`` group (block table of
  one real column) reads past the block-table row (and, at long contexts,
  past its buffer: a segfault on CPU).  The ``_update_states`` wrapper sets
  those groups' ``BlockTable.slot_mapping_mode`` to ``NONE``; the builder
  computes ring slots itself.
* the request ids, row order and Engram lookback ids of the step, read from
  the runner's input batch (``token_ids_cpu`` holds every known token id;
  generated ids are -1 placeholders under async scheduling, which the CPU
  platform turns off), and each request's row in the model's device token
  history (``backend.TokenHistoryRows``, released when the scheduler reports
  the request finished), from which the model takes the ids the host lacks;
* which requests read every prompt row (the runner's ``num_prompt_logprobs``:
  prompt logprobs asked for, still in prefill; pooling requests whose pooler
  reads more than the last row: ``MEAN`` / ``CLS`` sequence pooling,
  token-level tasks): the decoder layers keep all their rows instead of the
  last window (§3.2).

A wrapper around ``_build_attention_metadata`` publishes them to the builder
(``backend.set_pending_step_info``) for the duration of one build.

``install_runner_hooks()`` is idempotent; cache layers call it when they are
constructed (inside the worker, before the runner's first step).
"""

from __future__ import annotations

import functools
import logging

import numpy as np

from vllm_dsv41.attention.backend import (
    LOOKBACK_DEPTH,
    RunnerStepInfo,
    TokenHistoryRows,
    history_capacity,
    set_pending_step_info,
)

logger = logging.getLogger(__name__)

#: vLLM versions whose runner V1 internals these hooks were checked against.
PINNED_VLLM_PREFIX = "0.32."
_MARK = "_dsv41_hooked"
_RING_BATCH = "_dsv41_ring_batch"  # runner attr: input batch already adjusted


def install_runner_hooks() -> bool:
    """Patch ``GPUModelRunner`` once; return True if the hooks are active."""
    import vllm
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner, _MARK, False):
        return True
    if not vllm.__version__.startswith(PINNED_VLLM_PREFIX):
        logger.warning(
            "vllm_dsv41 runner hooks are pinned to vLLM %s*, found %s; "
            "replay_start and lookback ids will not reach the model.",
            PINNED_VLLM_PREFIX,
            vllm.__version__,
        )
        return False
    for name in ("_update_states", "_build_attention_metadata"):
        if not callable(getattr(GPUModelRunner, name, None)):
            logger.warning("GPUModelRunner.%s missing; hooks not installed", name)
            return False

    update_states = GPUModelRunner._update_states
    build_metadata = GPUModelRunner._build_attention_metadata

    @functools.wraps(update_states)
    def _update_states(self, scheduler_output):
        _record_replay_starts(self, scheduler_output)
        _skip_ring_slot_mappings(self)
        return update_states(self, scheduler_output)

    @functools.wraps(build_metadata)
    def _build_attention_metadata(self, *args, **kwargs):
        set_pending_step_info(_collect_step_info(self))
        try:
            return build_metadata(self, *args, **kwargs)
        finally:
            set_pending_step_info(None)

    GPUModelRunner._update_states = _update_states
    GPUModelRunner._build_attention_metadata = _build_attention_metadata
    setattr(GPUModelRunner, _MARK, True)
    return True


def replay_starts(runner) -> dict[str, int]:
    """req_id -> replay_start as recorded for this runner."""
    return runner.__dict__.setdefault("_dsv41_replay_start", {})


def _replay_window(runner) -> int:
    config = getattr(runner, "kv_cache_config", None)
    if config is None:
        return 0
    return max(
        (g.kv_cache_spec.prefix_replay_tokens for g in config.kv_cache_groups),
        default=0,
    )


def _skip_ring_slot_mappings(runner) -> None:
    """Stop runner V1 from computing token slots for ring groups."""
    batch = getattr(runner, "input_batch", None)
    config = getattr(runner, "kv_cache_config", None)
    if batch is None or config is None or runner.__dict__.get(_RING_BATCH) is batch:
        return
    from vllm.v1.kv_cache_interface import CircularBufferSpec, iter_layer_specs
    from vllm.v1.worker.block_table import SlotMappingMode

    tables = batch.block_table.block_tables
    if len(tables) == len(config.kv_cache_groups):
        for table, group in zip(tables, config.kv_cache_groups):
            if all(
                isinstance(s, CircularBufferSpec)
                for s in iter_layer_specs(group.kv_cache_spec)
            ):
                table.slot_mapping_mode = SlotMappingMode.NONE
    runner.__dict__[_RING_BATCH] = batch


def history_rows(runner) -> TokenHistoryRows:
    """This runner's assignment of token-history rows to requests."""
    got = runner.__dict__.get("_dsv41_history")
    if got is None:
        got = runner.__dict__["_dsv41_history"] = TokenHistoryRows(history_capacity(runner.max_num_reqs))
    return got


def _record_replay_starts(runner, scheduler_output) -> None:
    starts = replay_starts(runner)
    for req_id in scheduler_output.finished_req_ids:
        starts.pop(req_id, None)
    history_rows(runner).release(scheduler_output.finished_req_ids)
    for new_req in scheduler_output.scheduled_new_reqs:
        starts[new_req.req_id] = int(getattr(new_req, "replay_start", 0))
    cached = scheduler_output.scheduled_cached_reqs
    if cached.resumed_req_ids:
        replays = _replay_window(runner) > 0
        for i, req_id in enumerate(cached.req_ids):
            if req_id in cached.resumed_req_ids:
                computed = int(cached.num_computed_tokens[i])
                starts[req_id] = computed if replays else 0


def _pools_every_row(runner, req_id: str) -> bool:
    """A pooling request whose pooler reads more than its last row's hidden state: token-level tasks, and sequence
    pooling other than ``LAST`` (``MEAN``, ``CLS``; the model config's pooler)."""
    params = getattr(runner.input_batch, "pooling_params", None) or {}
    pp = params.get(req_id)
    if pp is None:
        return False
    if getattr(pp, "task", None) not in ("embed", "classify"):
        return True
    pc = getattr(runner.model_config, "pooler_config", None)
    return str(getattr(pc, "seq_pooling_type", None) or "LAST").upper() != "LAST"


def _collect_step_info(runner) -> RunnerStepInfo:
    batch = runner.input_batch
    n = batch.num_reqs
    req_ids = list(batch.req_ids[:n])
    starts = replay_starts(runner)
    replay_start = np.array([starts.get(r, 0) for r in req_ids], dtype=np.int32)

    computed = batch.num_computed_tokens_cpu[:n].astype(np.int64)
    pos = computed[:, None] - np.arange(1, LOOKBACK_DEPTH + 1)[None, :]
    known = batch.num_tokens_no_spec[:n].astype(np.int64)[:, None]
    valid = (pos >= 0) & (pos < known)
    rows = np.arange(n)[:, None]
    ids = batch.token_ids_cpu[rows, np.clip(pos, 0, None)]
    lookback = np.where(valid, ids, -1).astype(np.int32)

    is_prefill = computed < batch.num_prompt_tokens[:n]
    history = history_rows(runner)
    evicted = history.evicted
    hist_rows = history.rows_for(req_ids)
    if history.evicted > evicted and history.evicted & (history.evicted - 1) == 0:  # at 1, 2, 4, 8, ... evictions
        logger.warning("vllm-dsv41: %d token-history rows were reassigned (more than %d requests alive); a request "
                       "that comes back without being resumed may see wrong Engram lookback ids",
                       history.evicted, history.capacity)
    asks = getattr(runner, "num_prompt_logprobs", None) or {}  # the runner's prompt-logprobs requests in prefill
    keeps_rows = np.array([r in asks or _pools_every_row(runner, r) for r in req_ids], dtype=np.bool_)
    return RunnerStepInfo(
        req_ids=req_ids,
        replay_start=replay_start,
        replay_window=_replay_window(runner),
        lookback_token_ids=lookback,
        is_prefill=is_prefill,
        history_rows=hist_rows,
        keeps_rows=keeps_rows,
    )
