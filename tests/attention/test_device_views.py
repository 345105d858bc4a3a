"""What the ops path reads without the engine: flat 2-D cache views over a packed pool, batched slot
lookup through block tables, and the device-side Engram lookback windows (CPU)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from vllm_dsv41.attention.backend import DSV41GroupMetadata, DSV41StepMetadata
from vllm_dsv41.attention.caches import DSV41CacheLayer
from vllm_dsv41.model_executor.step import Step


def _layer(pool: torch.Tensor, nb: int, rows: int, row: int, block_stride: int, offset: int) -> DSV41CacheLayer:
    """A cache layer bound to a strided view of ``pool`` (no vLLM config needed)."""
    layer = DSV41CacheLayer.__new__(DSV41CacheLayer)
    nn.Module.__init__(layer)
    layer.prefix, layer.spec = "model.layers.0.attn.test_cache", SimpleNamespace(num_states=rows)
    layer.kv_cache = pool.as_strided((nb, 1, rows, row), (block_stride, rows * row, row, 1), offset)
    return layer


@pytest.mark.parametrize("row,block_stride,offset", [(17, 6784, 0), (36, 6784, 544), (66, 6784, 1696),
                                                     (36, 32 * 36, 0), (528, 113920, 4352)],
                         ids=["odd-row", "packed", "packed-even", "dense", "full-size"])
def test_flat_rows_address_the_same_bytes(row, block_stride, offset):
    nb, rows = 6, 32
    pool = torch.zeros(nb * block_stride + offset, dtype=torch.uint8)
    layer = _layer(pool, nb, rows, row, block_stride, offset)
    g = torch.Generator().manual_seed(0)
    slots = torch.tensor([-1, 0, 5, rows - 1, rows, 3 * rows + 7, nb * rows - 1])
    recs = torch.randint(0, 256, (slots.numel(), row), dtype=torch.uint8, generator=g)
    layer.write(slots, recs)
    flat, bstep, rstep = layer.flat_rows()
    fs = layer.flat_slots(slots)
    assert fs[0] == -1 and (fs[1:] >= 0).all()
    every = torch.cat((torch.full((3,), -1), torch.arange(nb * rows)))
    want = torch.where(every >= 0, every // rows * bstep + every % rows * rstep, -1)
    assert torch.equal(layer.flat_slots(every), want)
    assert torch.equal(flat[fs[1:]], recs[1:]) and torch.equal(layer.read(slots[1:]), recs[1:])
    if block_stride == rows * row:
        assert torch.equal(fs, slots)  # dense blocks: the identity
    flat[fs[2]] = 7  # writes through the flat view land in the slot's row
    assert (layer.read(slots[2:3]) == 7).all() and torch.equal(layer.read(slots[3:]), recs[3:])


def _step(qsl: list[int], ctx: list[int], lookback: list[list[int]], ids: list[int]) -> Step:
    n = len(ctx)
    qlen = [qsl[i + 1] - qsl[i] for i in range(n)]
    pos = torch.cat([torch.arange(c, c + q) for c, q in zip(ctx, qlen)])
    req = torch.repeat_interleave(torch.arange(n), torch.tensor(qlen))
    meta = DSV41StepMetadata(
        num_reqs=n, num_tokens=qsl[-1], req_ids=[str(i) for i in range(n)],
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor([c + q for c, q in zip(ctx, qlen)], dtype=torch.int32),
        context_lens=torch.tensor(ctx, dtype=torch.int32), positions=pos, token_req_idx=req,
        replay_start=torch.zeros(n, dtype=torch.int32), replay_window=0,
        lookback_token_ids=torch.tensor(lookback, dtype=torch.int32), is_prefill=torch.zeros(n, dtype=torch.bool))
    return Step(meta, torch.tensor(ids))


def _windows_loop(step: Step, depth: int) -> torch.Tensor:
    """The per-request loop the model used before (oracle)."""
    T = step.num_tokens
    out = torch.full((T, depth), -1, dtype=torch.long)
    qsl = step.meta.query_start_loc.tolist()
    look = step.meta.lookback_token_ids.to(torch.long)
    ids = step.input_ids.to(torch.long)
    for i in range(step.num_reqs):
        a, b = qsl[i], qsl[i + 1]
        if b <= a:
            continue
        hist = torch.cat((look[i, : depth - 1].flip(0), ids[a:b]))
        for k in range(depth):
            out[a:b, k] = hist[depth - 1 - k: depth - 1 - k + (b - a)]
    pos = step.meta.positions[:, None] - torch.arange(depth)[None, :]
    return torch.where(pos >= 0, out, torch.full_like(out, -1))


@pytest.mark.parametrize("depth", [1, 3, 4])
def test_token_windows_match_the_per_request_loop(depth):
    # a prefill from 0, a decode row, a chunk after 1 token of context, a chunk deep in the sequence
    qsl, ctx = [0, 5, 6, 8, 12], [0, 40, 1, 100]
    lookback = [[-1, -1, -1], [71, 72, 73], [81, -1, -1], [91, 92, 93]]
    step = _step(qsl, ctx, lookback, list(range(200, 212)))
    assert torch.equal(step.token_windows(depth), _windows_loop(step, depth))


def test_group_view_slots_of_matches_slots_of_entries():
    step = _step([0, 3, 5], [10, 60], [[-1] * 3, [-1] * 3], list(range(5)))
    bt = torch.tensor([[4, 9, 2, 0], [7, 3, 5, 8]], dtype=torch.int32)
    md = DSV41GroupMetadata(kind="compressed", block_size=64, tokens_per_state=2, rows_per_block=32,
                            block_table=bt, runner_slots=torch.full((5,), -1),
                            layer_names=["x"], step=step.meta)
    step.meta.groups["x"] = md
    view = step.group("x")
    ent = torch.tensor([[0, 31, 32, 70, -1], [5, 64, 127, -1, -1]])
    got = view.slots_of(torch.tensor([0, 1]), ent)
    for r in range(2):
        valid = ent[r] >= 0
        assert torch.equal(got[r][valid], md.slots_of_entries(r, ent[r][valid]))
        assert (got[r][~valid] == -1).all()


def _slots_by_loop(kind: str, bt: torch.Tensor, meta: DSV41StepMetadata, r: int, e: int, cap: int) -> list[int]:
    """The slot each token writes, one token at a time from the definitions (DSV41GroupMetadata.slot_mapping)."""
    out = []
    for t in range(meta.num_tokens):
        p, i = int(meta.positions[t]), int(meta.token_req_idx[t])
        if kind == "ring":
            out.append(int(bt[i, 0]) * cap + p % cap if bt[i, 0] > 0 else -1)
            continue
        j = p // r
        block = int(bt[i, min(j // e, bt.shape[1] - 1)])
        start = int(meta.replay_start[i])
        replayed = start > 0 and start <= p < start + meta.replay_window
        out.append(block * e + j % e if (p + 1) % r == 0 and block > 0 and not replayed else -1)
    return out


@pytest.mark.parametrize("kind", ["compressed", "ring"])
def test_group_slots_from_the_table_and_inside_a_static_step(kind):
    """Compressed and ring slots are computed from the block table on first use: by the metadata (eager
    steps) and, for a padded static decode step, by its view from the step's own buffers (what a captured
    graph replays); both give the definition's slot for every token, padded rows write nothing."""
    from vllm_dsv41.model_executor.graphs import StaticStep, pad_decode_meta

    # four decode rows: plain, a closing position (p + 1 divisible by r), a replayed closing one, a row without blocks
    step = _step([0, 1, 2, 3, 4], [40, 63, 99, 7], [[-1] * 3] * 4, [5, 6, 7, 8])
    meta = step.meta
    meta.replay_start[2], meta.replay_window = 96, 8
    r, e, cap = (4, 16, 0) if kind == "compressed" else (1, 1, 128)
    bt = torch.tensor([[3, 9, 2], [5, 6, 7], [8, 4, 1], [0, 0, 0]], dtype=torch.int32)
    md = DSV41GroupMetadata(kind=kind, block_size=cap or 64, tokens_per_state=r, rows_per_block=e,
                            block_table=bt, layer_names=["x"], step=meta)
    meta.groups["x"] = md
    want = _slots_by_loop(kind, bt, meta, r, e, cap)
    assert md.slot_mapping.tolist() == want and step.group("x").slot_mapping.tolist() == want
    assert -1 in want and any(s >= 0 for s in want)

    padded = pad_decode_meta(meta, 8)
    static = StaticStep(padded, torch.device("cpu"), context=1024)
    static.load(padded, torch.tensor([5, 6, 7, 8]), 4)
    assert static.group("x").slot_mapping.tolist() == want + [-1] * 4
    if kind == "ring":
        assert static.group("x").ring_block_ids.tolist() == [3, 5, 8, 0] + [0] * 4


def test_kept_step_meta_is_the_kept_rows_as_a_step():
    """The decoder graphs' step over the kept rows: each kept row keeps its position, request and SWA slot (the
    runner's, at that row); padded rows sit at position 0 of request 0 and write nothing; padded requests read the
    null block; the kept step's query starts count each request's kept rows; its replay starts are the decoder
    floors (a trimmed request's first kept row, the replay start of a request kept whole)."""
    from vllm_dsv41.model_executor.graphs import StaticStep, kept_step_meta

    step = _step([0, 6, 7, 12], [0, 40, 10], [[-1] * 3] * 3, list(range(12)))  # rows: 6, 1 (decode), 5
    meta = step.meta
    runner = torch.arange(100, 112)
    bt = torch.tensor([[1, 2], [3, 4], [5, 6]], dtype=torch.int32)
    meta.groups["swa"] = DSV41GroupMetadata(kind="swa", block_size=32, tokens_per_state=1, rows_per_block=32,
                                            block_table=bt, layer_names=["swa"], step=meta, runner_slots=runner)
    kept = torch.tensor([3, 4, 5, 6, 9, 10, 11])  # the last 3 rows of each request (the window)
    k = kept_step_meta(meta, kept, kept, rows=10, batch=4)
    assert (k.num_reqs, k.num_tokens) == (4, 10)
    assert k.positions.tolist() == [3, 4, 5, 40, 12, 13, 14, 0, 0, 0]
    assert k.token_req_idx.tolist() == [0, 0, 0, 1, 2, 2, 2, 0, 0, 0]
    assert k.query_start_loc.tolist() == [0, 3, 4, 7, 7]
    assert k.seq_lens.tolist() == [6, 41, 15, 1] and k.replay_start.tolist() == [3, 0, 12, 0]
    whole = kept_step_meta(meta, torch.arange(12), torch.arange(12), rows=16, batch=4)  # nothing trimmed
    assert whole.replay_start.tolist() == [0, 0, 0, 0] and whole.query_start_loc.tolist() == [0, 6, 7, 12, 12]
    g = k.groups["swa"]
    assert g.runner_slots.tolist() == [103, 104, 105, 106, 109, 110, 111, -1, -1, -1]
    assert g.block_table.tolist() == [[1, 2], [3, 4], [5, 6], [0, 0]]
    static = StaticStep(k, torch.device("cpu"), context=1024)
    static.load(k, static.input_ids, 0)
    assert static.group("swa").slot_mapping.tolist() == g.runner_slots.tolist()
    assert static.positions.tolist() == k.positions.tolist() and static.max_position == 1023
    assert not static.gathers_when_static
    with pytest.raises(RuntimeError, match="without a bound on its rows per request"):
        static.gather_bounds(3, 32, 2, 16)

    # as the decoder graphs make it: at most 3 kept rows a request (the window), so the bounds hold for any step of
    # the bucket: 4 requests x ((3 + 3 - 2) // 32 + 2) SWA blocks + the padded rows' one; 4 x 1024 // 2 / 16 entries
    static = StaticStep(k, torch.device("cpu"), context=1024, rows_per_request=3)
    assert static.gathers_when_static and static.gather_bounds(3, 32, 2, 16) == (9, 128)
    assert static.gather_bounds(3, 32, 0, 16)[1] == 0
    eager_swa, eager_comp = step.gather_bounds(3, 32, 2, 16)  # the eager step's own, from its spans
    assert eager_swa <= 9 and eager_comp <= 128


def test_graph_capture_plumbing(monkeypatch, caplog):
    """The capture both graph sets share (``_GraphSet._capture``), with CUDA's graph API stood in for: the step's
    per-step results are dropped first (recomputed inside the graph), the capture runs in static-step mode in the
    set's pool; a capture-unsafe op leaves the set eager (``failed``, entries cleared, one warning naming the steps)
    instead of failing the request."""
    import contextlib
    from types import SimpleNamespace

    from vllm_dsv41.model_executor import graphs

    captures = []

    @contextlib.contextmanager
    def fake_graph(graph, pool=None, stream=None, capture_error_mode=None):
        captures.append((pool, stream, capture_error_mode, graphs.in_static_step()))
        yield

    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: "graph")
    monkeypatch.setattr(torch.cuda, "graph", fake_graph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(graphs, "capture_stream", lambda device: f"capture stream of {device}")
    for cls in (graphs.DecodeGraphs, graphs.DecoderGraphs):
        gs = cls(lambda *a: None, 8, 1024, *([128] if cls is graphs.DecoderGraphs else []))
        step = SimpleNamespace(scratch={"stale": 1}, device="dev")
        seen = []
        got = gs._capture(step, lambda: seen.append(dict(step.scratch)) or torch.ones(2))
        assert got is not None and got[0] == "graph" and torch.equal(got[1], torch.ones(2))
        # captured in the set's pool, on the graphs' own capture stream (graphs.capture_stream), in static-step mode
        assert seen == [{}] and gs.pool == "pool"
        assert captures[-1] == ("pool", "capture stream of dev", "thread_local", True)
        assert not graphs.in_static_step() and gs.failed is None
        gs.entries[("k",)] = "captured earlier"

        def unsafe():
            raise RuntimeError("operation not permitted when stream is capturing")

        with caplog.at_level("WARNING"):
            assert gs._capture(step, unsafe) is None
        assert gs.failed.startswith("RuntimeError") and gs.entries == {}
        assert f"capture of {cls.what} failed" in caplog.text


def test_kept_row_buckets():
    """Decoder-graph row buckets: powers of two from 256 to 1,024, then multiples of 256 (a mixed 16k step's ~2,070
    kept rows take 2,304, not 4,096); every bucket holds its rows."""
    from vllm_dsv41.model_executor.graphs import kept_row_bucket

    assert [kept_row_bucket(n) for n in (1, 256, 257, 600, 1024, 1025, 2048, 2070, 8191)] == [
        256, 256, 512, 1024, 1024, 1280, 2048, 2304, 8192]
    assert all(n <= kept_row_bucket(n) < n + 1024 for n in range(1, 9000, 7))


def test_graph_modes_default_to_capture_on_cuda_with_the_ops(monkeypatch):
    """Both graph switches default to capture on CUDA with the ops path (the prefill decoder graphs since session 18),
    but not when the user asked for eager execution (then only ``1`` captures), ``0`` turns either off, ``static``
    runs the padded steps uncaptured, the CPU never captures, and a misspelt value names the variable."""
    from vllm_dsv41.model_executor import graphs

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for env, mode in ((graphs.GRAPH_ENV, graphs.graph_mode), (graphs.PREFILL_GRAPH_ENV, graphs.prefill_graph_mode)):
        monkeypatch.delenv(env, raising=False)
        assert (mode(cuda, True), mode(cuda, False), mode(cpu, True)) == ("capture", "off", "off"), env
        assert mode(cuda, True, eager=True) == "off"
        monkeypatch.setenv(env, "1")
        assert (mode(cuda, True, eager=True), mode(cuda, True)) == ("capture", "capture")
        monkeypatch.setenv(env, "0")
        assert mode(cuda, True) == "off"
        monkeypatch.setenv(env, "static")
        assert (mode(cpu, True), mode(cpu, False)) == ("static", "off")
        monkeypatch.setenv(env, "sometimes")
        with pytest.raises(ValueError, match=env):
            mode(cuda, True)


def test_decoder_graphs_capture_at_most_max_buckets(monkeypatch):
    """Past ``MAX_DECODER_GRAPHS`` captured buckets a new bucket's decoder steps run eagerly (the same answer) and
    nothing more is captured; below it the step is captured."""
    from vllm_dsv41.model_executor import graphs

    step = _step([0, 6, 7, 12], [0, 40, 10], [[-1] * 3] * 3, list(range(12)))
    kept = torch.tensor([3, 4, 5, 6, 9, 10, 11])
    captured = []
    monkeypatch.setattr(graphs._GraphSet, "_capture",
                        lambda self, st, fn: captured.append(st) or ("graph", fn()))

    def decoder(st, S, pre, carry):
        return S * 2, pre + 1

    S, pre = torch.randn(7, 4, 8), torch.randn(7, 4)
    for full in (False, True):
        gs = graphs.DecoderGraphs(decoder, max_rows=64, max_context=1024, window=3)
        if full:
            gs.entries = {("other", i): None for i in range(graphs.MAX_DECODER_GRAPHS)}
        captured.clear()
        S_out, pre_out = gs.run(step.meta, kept, kept, S, pre, {}, torch.device("cpu"))
        assert torch.equal(S_out, S * 2) and torch.equal(pre_out, pre + 1)
        assert len(captured) == (0 if full else 1)
        assert len(gs.entries) == graphs.MAX_DECODER_GRAPHS if full else list(gs.entries) == [gs.key(step.meta, 7)]
