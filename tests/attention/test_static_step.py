"""``StaticStep.load``: the fixed buffers a captured decode step reads are refilled with each step's metadata, the
packed way (one copy per flat buffer, ``VLLM_DSV41_PACKED_LOAD=1``, the default) and the per-tensor way, with the
same contents and without moving a buffer (a captured graph keeps reading the same addresses).  CPU; on CUDA the
packed step fields go through one pinned staging block (the same code past the device check)."""

from __future__ import annotations

import pytest
import torch

from vllm_dsv41.attention.backend import DSV41GroupMetadata, DSV41StepMetadata
from vllm_dsv41.model_executor import graphs


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


def _meta(n: int, seed: int, width: int = 5, device: str = "cpu") -> DSV41StepMetadata:
    """A decode step of ``n`` requests with three KV-cache groups (SWA with runner slots shared by two layers, a
    compressed and a ring group), random contents; the step fields on the host, the block tables and runner slots
    on ``device`` (as the runner has them)."""
    g = torch.Generator().manual_seed(seed)

    def ints(shape, hi, dtype):
        return torch.randint(0, hi, shape, generator=g).to(dtype)

    meta = DSV41StepMetadata(
        num_reqs=n, num_tokens=n, req_ids=[f"r{i}" for i in range(n)],
        query_start_loc=torch.arange(n + 1, dtype=torch.int32), seq_lens=ints((n,), 900, torch.int32) + 1,
        context_lens=ints((n,), 900, torch.int32), positions=ints((n,), 900, torch.int64),
        token_req_idx=torch.arange(n), replay_start=ints((n,), 50, torch.int32), replay_window=128,
        lookback_token_ids=ints((n, 3), 1000, torch.int32), is_prefill=torch.zeros(n, dtype=torch.bool),
        history_rows=ints((n,), 8, torch.int32))
    for kind, names, slots in (("swa", ["l0.swa", "l1.swa"], True), ("compressed", ["l0.comp"], False),
                               ("ring", ["l0.ring"], False)):
        md = DSV41GroupMetadata(kind=kind, block_size=32, tokens_per_state=4 if kind == "compressed" else 1,
                                rows_per_block=8 if kind == "compressed" else 32,
                                block_table=ints((n, width), 60, torch.int32).to(device), layer_names=names,
                                step=meta, runner_slots=ints((n,), 2000, torch.int64).to(device) if slots else None)
        for name in names:
            meta.groups[name] = md
    return meta


def _buffers(step: graphs.StaticStep) -> dict[str, torch.Tensor]:
    out = {f: step._dev[f] for f in graphs.StaticStep.FIELDS}
    for name, v in step._views.items():
        out[f"{name}.table"] = v.block_table_i32
        if v.runner_slots is not None:
            out[f"{name}.slots"] = v.runner_slots
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("packed", ["1", "0"])
def test_load_refills_every_buffer_in_place(packed, device, monkeypatch):
    monkeypatch.setenv(graphs.PACKED_LOAD_ENV, packed)
    first = graphs.pad_decode_meta(_meta(3, 0, device=device), 4)
    step = graphs.StaticStep(first, torch.device(device), 1024)
    before = {k: t.data_ptr() for k, t in _buffers(step).items()}
    for seed in (1, 2):  # twice: a second load must not see the first one's values
        nxt = graphs.pad_decode_meta(_meta(4 if seed == 1 else 2, seed, device=device), 4)
        if seed == 2:  # groups listed in another order: each buffer still gets its own group's table
            nxt.groups = dict(reversed(list(nxt.groups.items())))
        ids = torch.arange(7, 7 + nxt.num_tokens, device=device)
        step.load(nxt, ids, nxt.num_tokens)
        bufs = {k: t.cpu() for k, t in _buffers(step).items()}  # (on CUDA: after the copies, stream order)
        assert {k: t.data_ptr() for k, t in _buffers(step).items()} == before, "a buffer moved"
        for f in graphs.StaticStep.FIELDS:
            assert bufs[f].dtype == torch.int64 and torch.equal(bufs[f], getattr(nxt, f).to(torch.int64)), f
        for name, g in nxt.groups.items():
            assert torch.equal(bufs[f"{name}.table"], g.block_table.cpu()), name
            if g.runner_slots is not None:
                assert torch.equal(bufs[f"{name}.slots"], g.runner_slots.cpu()), name
        assert torch.equal(step.input_ids, ids)
    # the two views of the shared SWA group are one buffer, filled once
    assert step._views["l0.swa"] is step._views["l1.swa"]


def test_packed_load_names_a_mismatched_table(monkeypatch):
    monkeypatch.setenv(graphs.PACKED_LOAD_ENV, "1")
    step = graphs.StaticStep(graphs.pad_decode_meta(_meta(2, 0), 2), torch.device("cpu"), 1024)
    with pytest.raises(ValueError, match=r"block table of shape \(2, 6\) for a buffer of \(2, 5\)"):
        step.load(_meta(2, 1, width=6), torch.zeros(2, dtype=torch.long), 2)


def test_packed_load_switch_rejects_other_values(monkeypatch):
    monkeypatch.setenv(graphs.PACKED_LOAD_ENV, "maybe")
    with pytest.raises(ValueError, match="VLLM_DSV41_PACKED_LOAD='maybe'"):
        graphs.packed_load()


def test_graph_priority_switch(monkeypatch):
    monkeypatch.delenv(graphs.PRIORITY_ENV, raising=False)
    assert not graphs.graph_priority()
    monkeypatch.setenv(graphs.PRIORITY_ENV, "1")
    assert graphs.graph_priority()
    monkeypatch.setenv(graphs.PRIORITY_ENV, "high")
    with pytest.raises(ValueError, match="VLLM_DSV41_GRAPH_PRIORITY='high'"):
        graphs.graph_priority()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA streams")
@pytest.mark.parametrize("high", ["0", "1"])
def test_capture_stream_has_its_counters_and_priority(high, monkeypatch):
    """The graphs' capture stream: one per device and priority, above the default priority with the switch on, and
    fp8_gemv's split-K counters (moe_gemv's too) exist for it, zeroed, before any capture."""
    from vllm_dsv41.ops import fp8_gemv

    monkeypatch.setenv(graphs.PRIORITY_ENV, high)
    dev = torch.device("cuda", torch.cuda.current_device())
    s = graphs.capture_stream(dev)
    assert graphs.capture_stream(dev) is s
    assert s.priority < torch.cuda.current_stream(dev).priority if high == "1" else s.priority == 0
    locks = fp8_gemv._LOCKS[(dev.type, dev.index, s.cuda_stream)]
    assert locks.numel() >= 4096 and not locks.any()
