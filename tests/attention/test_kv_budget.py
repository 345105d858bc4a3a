"""KV-cache cost, read from the specs and from what the engine actually allocates.

The tiny model's engine-side caches must be exactly ``model_cache_specs(cfg)``; for the bench and full
configs (too big to build on CPU) a cache-only stand-in model declares those same specs and the real
engine allocates them, so the bytes per token are the engine's own numbers.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

from tests.e2e.conftest import engine
from vllm_dsv41.attention.specs import kv_bytes, model_cache_specs
from vllm_dsv41.config import load_config, parse_config
from vllm_dsv41.presets import BENCH, FULL, QUANTIZATION_CONFIG


def _cfg(name):
    text = dict(FULL if name == "full" else BENCH)
    if text.get("engram_num_embeddings") is None:
        text["engram_num_embeddings"] = [1003416, 1008878]
    return parse_config({"text_config": text, "quantization_config": QUANTIZATION_CONFIG})


def _engine_groups(llm):
    kcc = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
    return kcc


def _allocated(kcc) -> dict:
    """Bytes the engine lays out per block for each group kind, from its KV tensors."""
    from vllm.v1.kv_cache_interface import CircularBufferSpec, SlidingWindowMLASpec

    kind = {}
    for g in kcc.kv_cache_groups:
        k = ("ring" if isinstance(g.kv_cache_spec, CircularBufferSpec)
             else "swa" if isinstance(g.kv_cache_spec, SlidingWindowMLASpec) else "global")
        for name in g.layer_names:
            kind[name] = (k, g.kv_cache_spec.block_size)
    out = {"global": 0.0, "swa_layers": {}}
    for t in kcc.kv_cache_tensors:
        k, bs = kind[t.layers[0]]
        if k == "global":
            out["global"] += t.layer_stride * len(t.layers) / bs if t.layer_stride else t.block_stride / bs
        elif k == "swa":
            for name in t.layers:
                out["swa_layers"][name] = (t.layer_stride or t.block_stride // len(t.layers), bs)
    return out


@pytest.mark.parametrize("name", ["bench", "full"])
def test_spec_bytes(name):
    cfg = _cfg(name)
    b = kv_bytes(model_cache_specs(cfg))
    W = cfg.sliding_window
    print(f"{name}: global KV {b['global_bytes_per_token']:.1f} B/token; per request SWA "
          f"{b['swa_bytes_per_request'] / 2**20:.2f} MiB (window {W}), ring {b['ring_bytes_per_request'] / 1024:.0f} KiB")
    assert b["global_bytes_per_token"] <= 900
    # SWA per request: at most ceil((W-1)/32)+1 blocks of 32 records per layer, whatever the context length
    assert b["swa_bytes_per_request"] <= cfg.n_layers * (W + 32) * 528


class _CacheOnly(nn.Module):
    """Declares the V4.1 caches of the config named in $DSV41_SPEC_PRESET and nothing else."""

    def __init__(self, *, vllm_config, prefix=""):
        super().__init__()
        from vllm_dsv41.attention.caches import DSV41CacheLayer

        cfg = _cfg(os.environ["DSV41_SPEC_PRESET"])
        self.caches = nn.ModuleList(DSV41CacheLayer(n, s) for n, s in model_cache_specs(cfg).items())

    def embed_input_ids(self, ids):
        return torch.zeros(ids.shape[0], 8)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kw):
        return torch.zeros(positions.shape[0], 8)

    def compute_logits(self, h):
        return torch.zeros(h.shape[0], 512)

    def load_weights(self, weights):
        return set()


@pytest.mark.parametrize("name", ["bench", "full"])
def test_engine_allocation_full_size(name, tmp_path, monkeypatch):
    from vllm import ModelRegistry

    ModelRegistry.register_model("DSV41CacheOnlyForTest", _CacheOnly)
    monkeypatch.setenv("DSV41_SPEC_PRESET", name)
    (tmp_path / "config.json").write_text(json.dumps(dict(
        architectures=["DSV41CacheOnlyForTest"], model_type="llama", hidden_size=64, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=1, vocab_size=512,
        max_position_embeddings=4096, torch_dtype="float32")))
    with engine(str(tmp_path), exact=False, skip_tokenizer_init=True, load_format="dummy",
                max_model_len=2048, max_num_seqs=4, enable_prefix_caching=True) as llm:
        got = _allocated(_engine_groups(llm))
    cfg = _cfg(name)
    swa = sum(stride * (-(-(cfg.sliding_window - 1) // bs) + 1) for stride, bs in got["swa_layers"].values())
    print(f"{name} (engine-allocated): global KV {got['global']:.1f} B/token; SWA per request "
          f"{swa / 2**20:.2f} MiB over {len(got['swa_layers'])} layers")
    assert got["global"] <= 900
    assert len(got["swa_layers"]) == cfg.n_layers
    assert swa <= cfg.n_layers * (cfg.sliding_window + 32) * 528


def test_tiny_engine_declares_model_cache_specs(tiny_ckpt):
    cfg = load_config(tiny_ckpt)
    want = model_cache_specs(cfg)
    with engine(tiny_ckpt, exact=False, num_gpu_blocks_override=64, max_model_len=256) as llm:
        kcc = _engine_groups(llm)
        names = {n for g in kcc.kv_cache_groups for n in g.layer_names}
        got = _allocated(kcc)
    assert names == set(want)
    b = kv_bytes(want)
    print(f"tiny: spec {b['global_bytes_per_token']:.1f} B/token, engine {got['global']:.1f} B/token")
    assert abs(got["global"] - b["global_bytes_per_token"]) <= 0.05 * b["global_bytes_per_token"]
