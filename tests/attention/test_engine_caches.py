"""End-to-end proof that engine-allocated caches reach the model (CPU, V1).

A toy model registered under its own architecture name owns one SWA cache,
one ratio-2 compressed KV cache + its index-K cache, and one compressor ring
(all ``vllm_dsv41.attention`` layers).  Every step it writes records for its
tokens at the slots the metadata gives and reads back, through the block
tables, every record the step's last token may attend to, asserting the
content.  Records are content-addressed (token ids + position), so entries
another request wrote (prefix-cache hits) can be checked against prompts.

The engine runs generate on prompts that share a 128-token prefix, so the
scheduler takes prefix-cache hits and, because the SWA spec declares
``prefix_replay_tokens``, rewinds by the window and sets ``replay_start``,
which must reach the model through ``runner_hooks``.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

from vllm_dsv41.attention import specs

ARCH = "DSV41AttentionCachesToy"
D = 128  # toy head_dim: SWA record 132 B, compressed 72 B
D_INDEX = 64  # index record 36 B
W = 32  # sliding window
RATIO = 2
BLOCK = 64  # compressed block size in tokens (32 entries per block)
VOCAB = 512
LOG: list[dict] = []  # what the toy saw, step by step (single process)


def test_record_sizes_and_spec_flags():
    assert specs.swa_record_bytes(512) == 528
    assert specs.compressed_record_bytes(512) == 288
    assert specs.index_record_bytes(128) == 68
    swa = specs.make_swa_spec(512, 128)
    assert (swa.block_size, swa.page_size_bytes) == (32, 32 * 528)
    assert not swa.prefix_cacheable and swa.prefix_replay_tokens == 128
    comp = specs.make_compressed_spec(512, 2, 128)
    assert comp.prefix_cacheable and comp.num_states == 64
    assert comp.page_size_bytes == 64 * 288
    idx = specs.make_index_spec(128, 2, 128)
    assert idx.page_size_bytes == 64 * 68
    ring = specs.make_ring_spec(512)
    assert ring.page_size_bytes == 8 * 1024 * 4
    assert not ring.prefix_cacheable and not ring.uses_slot_mapping
    bf16 = specs.make_swa_spec(512, 128, fmt="bf16")
    assert bf16.dtype == torch.bfloat16 and bf16.page_size_bytes == 32 * 1024


def _pattern(n: int, *keys: int) -> torch.Tensor:
    acc = sum((int(k) + 1) * (7 + 13 * i) for i, k in enumerate(keys))
    return ((acc + torch.arange(n, dtype=torch.int64) * 31) % 251).to(torch.uint8)


def _next_token(tok: int) -> int:
    return (tok * 5 + 3) % VOCAB


class CacheToy(nn.Module):
    """Carries no weights that matter: hidden[:, 0] is the input token id and
    the logits pick ``_next_token`` of it, so outputs are predictable."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__()
        from vllm_dsv41.attention import CompressedCache, CompressorRing, SWACache

        self.dummy = nn.Parameter(torch.zeros(1))
        self.swa = SWACache("model.layers.0.attn.swa_cache", D, W)
        self.kv = CompressedCache("model.layers.0.attn.kv_cache", D, RATIO, BLOCK)
        self.index = CompressedCache(
            "model.layers.0.attn.indexer.k_cache", D_INDEX, RATIO, BLOCK, index=True
        )
        self.ring = CompressorRing("model.layers.0.attn.compressor.state_cache", D)
        self.history: dict[str, dict[int, int]] = {}

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(input_ids.shape[0], 8)

    def forward(self, input_ids, positions, intermediate_tensors=None,
                inputs_embeds=None, **kwargs):
        from vllm_dsv41.attention import current_step

        step = current_step()
        if step is not None:
            self._step(step, input_ids[: step.num_tokens].cpu(), positions)
        hidden = torch.zeros(input_ids.shape[0], 8)
        hidden[:, 0] = input_ids.float()
        return hidden

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        nxt = (hidden_states[:, 0].round().long() * 5 + 3) % VOCAB
        logits = torch.full((hidden_states.shape[0], VOCAB), -100.0)
        logits[torch.arange(nxt.shape[0]), nxt] = 100.0
        return logits

    def load_weights(self, weights):
        return {name for name, _ in self.named_parameters()}

    # ---------------------------------------------------------------------
    def _step(self, step, ids: torch.Tensor, runner_positions: torch.Tensor):
        swa, kv, index, ring = (
            m.metadata() for m in (self.swa, self.kv, self.index, self.ring)
        )
        pos, req = step.positions, step.token_req_idx
        assert torch.equal(pos, runner_positions[: step.num_tokens].cpu())
        assert torch.equal(
            pos, step.context_lens.long()[req] + torch.arange(step.num_tokens)
            - step.query_start_loc.long()[req]
        )
        # compressed KV and index K land in one KV-cache group (one table)
        assert torch.equal(kv.block_table, index.block_table)
        LOG.append(dict(
            req_ids=list(step.req_ids), context=step.context_lens.tolist(),
            query_lens=step.query_lens.tolist(), replay=step.replay_start.tolist(),
            lookback=step.lookback_token_ids.tolist(),
            rings=ring.ring_block_ids.tolist(),
            kinds={m.kind: (m.block_size, m.rows_per_block)
                   for m in (swa, kv, index, ring)},
            layout=(tuple(self.swa.kv_cache.stride()),
                    tuple(self.ring.kv_cache.stride())),
        ))

        # SWA: every token writes its own row (through vLLM's slot mapping).
        n_swa = self.swa.blocks.shape[-1]
        assert bool((swa.slot_mapping >= swa.rows_per_block).all()), "null block"
        self.swa.write(swa.slot_mapping, torch.stack(
            [_pattern(n_swa, t, p) for t, p in zip(ids.tolist(), pos.tolist())]))

        # Compressor: entry j pools positions 2j, 2j+1; the partner of an odd
        # position comes from this step or, across steps, from the ring.
        n_kv, n_ix = self.kv.blocks.shape[-1], self.index.blocks.shape[-1]
        kv_rows = torch.zeros(len(ids), n_kv, dtype=torch.uint8)
        ix_rows = torch.zeros(len(ids), n_ix, dtype=torch.uint8)
        for t in range(len(ids)):
            p, i = int(pos[t]), int(req[t])
            if (p + 1) % RATIO:
                continue
            if t > 0 and int(req[t - 1]) == i:
                prev = int(ids[t - 1])
            else:
                row = self.ring.read(
                    ring.ring_block_ids[i].long() * ring.block_size
                    + (p - 1) % ring.block_size)
                assert int(row[1]) == p - 1, ("ring row", p, row[:2].tolist())
                prev = int(row[0])
            kv_rows[t] = _pattern(n_kv, prev, int(ids[t]), p // RATIO)
            ix_rows[t] = _pattern(n_ix, prev, int(ids[t]), p // RATIO, 1)
        writers = kv.slot_mapping >= 0
        # Replayed tokens (a prefix hit's last window) must leave the cached,
        # possibly shared, global KV alone.
        hit_end = step.replay_start.long()[req] + W
        assert not bool((writers & (pos < hit_end)
                         & (step.replay_start.long()[req] > 0)).any())
        assert bool((kv.slot_mapping[writers] >= kv.rows_per_block).all())
        self.kv.write(kv.slot_mapping, kv_rows)
        self.index.write(index.slot_mapping, ix_rows)

        # Ring: only each request's last `capacity` positions (rows repeat).
        ring_rows = torch.zeros(len(ids), self.ring.blocks.shape[-1])
        ring_rows[:, 0], ring_rows[:, 1] = ids.float(), pos.float()
        keep = pos >= step.seq_lens.long()[req] - self.ring.capacity
        self.ring.write(torch.where(keep, ring.slot_mapping, -1), ring_rows)

        for i in range(step.num_reqs):
            self._check_request(step, i, ids, swa, kv, index)

    def _check_request(self, step, i, ids, swa, kv, index):
        rid = step.req_ids[i]
        seen = self.history.setdefault(rid, {})
        context = int(step.context_lens[i])
        for j in range(3):  # lookback: nearest first
            p = context - 1 - j
            if p in seen:
                assert int(step.lookback_token_ids[i, j]) == seen[p], (rid, p)
            if p < 0:
                assert int(step.lookback_token_ids[i, j]) == -1
        a, b = int(step.query_start_loc[i]), int(step.query_start_loc[i + 1])
        for t in range(a, b):
            seen[int(step.positions[t])] = int(ids[t])
        last = int(step.positions[b - 1])

        # The SWA window of the last token, clamped at replay_start.
        lo = max(last - W + 1, int(step.replay_start[i]))
        ps = torch.arange(lo, last + 1)
        got = self.swa.read(swa.slots_of_entries(i, ps))
        for k, p in enumerate(ps.tolist()):
            assert torch.equal(got[k], _pattern(got.shape[-1], seen[p], p)), (rid, p)

        # Every compressed entry visible to the last token.
        js = torch.arange((last + 1) // RATIO)
        got_kv = self.kv.read(kv.slots_of_entries(i, js))
        got_ix = self.index.read(index.slots_of_entries(i, js))
        for j in js.tolist():
            pair = (seen.get(2 * j), seen.get(2 * j + 1))
            if None in pair:  # written by another request: checked later
                LOG.append(dict(foreign=(rid, j, got_kv[j].clone())))
                continue
            assert torch.equal(got_kv[j], _pattern(got_kv.shape[-1], *pair, j))
            assert torch.equal(got_ix[j], _pattern(got_ix.shape[-1], *pair, j, 1))


def _write_toy_config(path) -> str:
    config = dict(
        architectures=[ARCH], model_type="llama", hidden_size=64,
        intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
        num_hidden_layers=1, vocab_size=VOCAB, max_position_embeddings=1024,
        rms_norm_eps=1e-6, torch_dtype="float32", bos_token_id=1, eos_token_id=2,
    )
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


@pytest.mark.engine
def test_engine_allocates_and_addresses_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, ModelRegistry, SamplingParams
    from vllm.distributed import cleanup_dist_env_and_memory
    from vllm.inputs import TokensPrompt

    ModelRegistry.register_model(ARCH, CacheToy)
    LOG.clear()
    llm = LLM(
        model=_write_toy_config(tmp_path), skip_tokenizer_init=True,
        load_format="dummy", enforce_eager=True, dtype="float32",
        max_model_len=512, max_num_seqs=4, max_num_batched_tokens=45,
        enable_prefix_caching=True, enable_chunked_prefill=True, seed=0,
    )
    try:
        runner = (llm.llm_engine.engine_core.engine_core.model_executor
                  .driver_worker.worker.model_runner)
        groups = runner.kv_cache_config.kv_cache_groups
        assert sorted(g.kv_cache_spec.block_size for g in groups) == [8, 32, 64]
        assert runner.cache_config.kv_cache_layout == "BLHNC"
        sent = {}  # what the scheduler sends in NewRequestData
        hooked_update = runner._update_states

        def spy(scheduler_output):
            for new in scheduler_output.scheduled_new_reqs:
                sent[new.req_id] = (new.replay_start, new.num_computed_tokens)
            return hooked_update(scheduler_output)

        runner._update_states = spy

        params = SamplingParams(max_tokens=6, temperature=0.0, detokenize=False,
                                ignore_eos=True)
        shared = [(7 * k) % 500 + 3 for k in range(128)]
        prompts = {
            "a": shared + [11, 12, 13, 14, 15],
            "c": [5, 6, 7, 8, 9, 10, 11],
            "b": shared + [21, 22, 23],  # hits 128 tokens -> replays 96..127
            "d": shared[:70] + [31, 32, 33, 34, 35],  # hits 64 -> replays 32..63
        }
        outputs = {}
        for batch in (("a", "c"), ("b",), ("d",)):
            outs = llm.generate(
                [TokensPrompt(prompt_token_ids=prompts[k]) for k in batch], params)
            outputs.update(zip(batch, outs))
        left_over = dict(runner.__dict__.get("_dsv41_replay_start", {}))
        modes = {  # runner_hooks keeps runner V1 from slot-mapping ring groups
            g.kv_cache_spec.block_size: t.slot_mapping_mode.name
            for g, t in zip(groups, runner.input_batch.block_table.block_tables)
        }
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        cleanup_dist_env_and_memory()

    for key, out in outputs.items():  # the toy's next-token rule held
        toks = [prompts[key][-1]]
        for _ in range(6):
            toks.append(_next_token(toks[-1]))
        assert list(out.outputs[0].token_ids) == toks[1:], key

    # The engine runs requests under "<request_id>-<suffix>" internally.
    internal = {r for e in LOG if "req_ids" in e for r in e["req_ids"]}
    rid = {
        k: next(r for r in internal if r.split("-")[0] == o.request_id)
        for k, o in outputs.items()
    }
    assert outputs["a"].num_cached_tokens == 0
    assert outputs["b"].num_cached_tokens == 128
    assert outputs["d"].num_cached_tokens == 64

    steps = [e for e in LOG if "req_ids" in e]
    first = {}
    for e in steps:
        for i, r in enumerate(e["req_ids"]):
            first.setdefault(r, (e["context"][i], e["replay"][i], e["lookback"][i]))
    assert first[rid["a"]] == (0, 0, [-1, -1, -1])
    assert first[rid["b"]][:2] == (96, 96)  # rewound to replay_start
    assert first[rid["b"]][2] == prompts["b"][95:92:-1]
    assert first[rid["d"]][:2] == (32, 32)
    assert sent[rid["b"]] == (96, 96) and sent[rid["d"]] == (32, 32)
    assert sent[rid["a"]] == (0, 0) and sent[rid["c"]] == (0, 0)
    assert modes == {32: "TOKEN_TO_KV_SLOT", 64: "TOKEN_TO_KV_SLOT", 8: "NONE"}
    # Finished requests are forgotten when the next step reports them; only
    # the last one, reported after generate returned, may still be there.
    assert set(left_over) <= {rid["d"]}
    for e in steps:  # replay_start is constant per request
        for i, r in enumerate(e["req_ids"]):
            assert e["replay"][i] == {rid["b"]: 96, rid["d"]: 32}.get(r, 0)

    kinds = steps[0]["kinds"]
    assert kinds == {"swa": (32, 32), "compressed": (64, 32), "ring": (8, 8)}
    swa_stride, ring_stride = steps[0]["layout"]
    assert swa_stride[0] == ring_stride[0] * 4  # one packed block stride (bytes)
    both = [e["rings"] for e in steps if len(e["rings"]) == 2]
    assert both and all(r[0] != r[1] and min(r) > 0 for r in both)

    # Entries the hit requests read but never computed match the shared prompt.
    foreign = [e["foreign"] for e in LOG if "foreign" in e]
    assert {r for r, _, _ in foreign} <= {rid["b"], rid["d"]} and foreign
    for r, j, record in foreign:
        prompt = prompts["b"] if r == rid["b"] else prompts["d"]
        expect = _pattern(record.shape[-1], prompt[2 * j], prompt[2 * j + 1], j)
        assert torch.equal(record, expect), (r, j)
