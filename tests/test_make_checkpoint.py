"""Synthetic checkpoint writer (vllm_dsv41/tools/make_checkpoint.py) and tokenizer."""

from __future__ import annotations

import hashlib
import json
import os
import time

import pytest
import torch

from vllm_dsv41 import formats, presets
from vllm_dsv41.config import ConfigError, load_config
from vllm_dsv41.engram import build_compressed_token_map, engram_layout
from vllm_dsv41.tokenizer import (
    ASSISTANT_TOKEN,
    BOS_TOKEN,
    EOS_TOKEN,
    IMAGE_TOKEN,
    NOISE_TOKEN,
    PAD_TOKEN,
    THINK_END,
    THINK_START,
    USER_TOKEN,
)
from vllm_dsv41.tools.make_checkpoint import expected_tensors, main, make_checkpoint, parse_set_args

CHATS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
     {"role": "user", "content": "How are you?"}],
]


def _digest(d: str) -> dict[str, str]:
    return {f: hashlib.sha256(open(os.path.join(d, f), "rb").read()).hexdigest() for f in sorted(os.listdir(d))}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("tiny_mc"))
    t0 = time.perf_counter()
    cfg = make_checkpoint(out, preset="tiny", seed=0)
    return out, cfg, time.perf_counter() - t0


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("bench_mc"))
    return out, make_checkpoint(out, preset="bench")


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("full_mc"))
    return out, make_checkpoint(out, preset="full")


def _read_all(d: str) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    with open(os.path.join(d, "model.safetensors.index.json")) as f:
        index = json.load(f)
    files = sorted(set(index["weight_map"].values()))
    out = {}
    for fn in files:
        with safe_open(os.path.join(d, fn), "pt") as h:
            for k in h.keys():
                assert k not in out, f"{k} in two shards"
                assert index["weight_map"][k] == fn
                out[k] = h.get_tensor(k)
    assert set(out) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in out.values())
    return out


# ----------------------------------------------------------------------------
# tiny: weights
# ----------------------------------------------------------------------------
def test_tiny_files_size_and_time(tiny):
    out, cfg, dt = tiny
    files = sorted(os.listdir(out))
    shards = [f for f in files if f.endswith(".safetensors")]
    n = len(shards)
    assert n >= 2 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "model.safetensors.index.json"):
        assert f in files
    size = sum(os.path.getsize(os.path.join(out, f)) for f in files)
    assert size < 20e6
    assert dt < 10.0


def test_tiny_tensors_match_inventory(tiny):
    out, cfg, _ = tiny
    want = expected_tensors(cfg)
    got = _read_all(out)
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    assert not missing and not extra, (missing[:5], extra[:5])
    for k, (shape, dtype) in want.items():
        assert tuple(got[k].shape) == shape, k
        assert got[k].dtype == dtype, k


def test_inventory_contents(tiny):
    _, cfg, _ = tiny
    inv = expected_tensors(cfg)
    H, C = cfg.hidden_size, cfg.hc_mult
    # global
    assert inv["embed.weight"] == ((cfg.vocab_size, H), torch.bfloat16)
    assert inv["head.weight"] == ((cfg.vocab_size, H), torch.bfloat16)
    # attention / output projection layout
    assert inv["layers.0.attn.wo_a.weight"] == ((cfg.o_groups * cfg.o_lora_rank,
                                                 cfg.heads_per_group * cfg.head_dim), torch.float8_e4m3fn)
    assert inv["layers.0.attn.wo_b.scale"][0] == (-(-H // 32), -(-cfg.o_groups * cfg.o_lora_rank // 32))
    assert inv["layers.0.hc_attn_fn"] == (((2 + C) * C, C * H), torch.float32)
    assert inv["layers.0.attn.attn_sink"] == ((cfg.num_attention_heads,), torch.float32)
    # roles
    for p in cfg.plans:
        pre = f"layers.{p.layer_id}" if not p.is_draft else f"mtp.{p.layer_id - cfg.n_layers}"
        assert (f"{pre}.attn.compressor.wkv.weight" in inv) == p.owns_compressor
        assert (f"{pre}.attn.compressor.wgate.weight" in inv) == (p.owns_compressor and p.compress_ratio == 2)
        assert (f"{pre}.attn.indexer.wk.weight" in inv) == p.owns_compressor
        assert (f"{pre}.attn.indexer.wq_b.weight" in inv) == p.owns_indexer
        assert (f"{pre}.engram.embed.weight" in inv) == p.has_engram
        E = p.n_routed_experts
        assert f"{pre}.ffn.experts.{E - 1}.w2.weight" in inv and f"{pre}.ffn.experts.{E}.w1.weight" not in inv
        assert inv[f"{pre}.ffn.gate.bias"] == ((E,), torch.float32)
    I = cfg.moe_intermediate_size
    assert inv["layers.3.ffn.experts.0.w1.weight"] == ((I, H // 2), torch.int8)
    assert inv["layers.3.ffn.experts.0.w1.scale"] == ((I, H // 32), torch.float8_e8m0fnu)
    assert inv["layers.3.ffn.experts.0.w2.weight"] == ((H, I // 2), torch.int8)
    assert inv["layers.3.ffn.shared_experts.w2.scale"] == ((H // 32, I // 32), torch.float8_e8m0fnu)
    for k, L in enumerate(cfg.engram_layer_ids):
        rows, hd = cfg.engram_num_embeddings[k], cfg.engram_head_dim
        assert inv[f"layers.{L}.engram.embed.weight"] == ((rows, hd), torch.float8_e4m3fn)
        assert inv[f"layers.{L}.engram.embed.scale"] == ((rows, hd // 32), torch.float8_e8m0fnu)
        assert inv[f"layers.{L}.engram.wkv.weight"] == (((C + 1) * H, cfg.engram_n_columns * hd),
                                                        torch.float8_e4m3fn)
        assert inv[f"layers.{L}.engram.q_weight"] == ((C, H), torch.bfloat16)
    # DSpark
    nd = cfg.n_draft_layers
    assert inv["mtp.0.main_proj.weight"] == ((H, len(cfg.dspark_target_layer_ids) * H), torch.float8_e4m3fn)
    assert "mtp.0.main_norm.weight" in inv
    assert inv[f"mtp.{nd - 1}.markov_head.embed.weight"] == ((cfg.vocab_size, cfg.dspark_markov_rank),
                                                             torch.bfloat16)
    assert f"mtp.{nd - 1}.markov_head.head.weight" in inv and f"mtp.{nd - 1}.norm.weight" in inv
    assert "mtp.0.markov_head.embed.weight" not in inv or nd == 1
    assert not any(k.startswith(("vision.", "aligner.", "image_")) for k in inv)


def test_inventory_agrees_with_checkpoint_module(tiny, bench, full):
    ckpt = pytest.importorskip("vllm_dsv41.checkpoint")
    for cfg in (tiny[1], bench[1], full[1]):
        assert expected_tensors(cfg) == ckpt.expected_tensors(cfg)


def test_full_inventory_size(full):
    _, cfg = full
    inv = expected_tensors(cfg)
    n_bytes = sum(torch.empty((), dtype=dt).element_size() * int(torch.Size(s).numel()) for s, dt in inv.values())
    # §6.1 ([P]): ~510 GB in 96,085 tensors.  Text-only inventory + vision tower (259 vision.*, 4 aligner.*,
    # 3 image_*) + confidence head (1) + one vision routing bias per MoE layer (40 + 3) gives that count.
    assert len(inv) + 259 + 4 + 3 + 1 + (cfg.n_layers + cfg.n_draft_layers) == 96085
    assert 495e9 < n_bytes < 515e9


def test_tiny_values_sane(tiny):
    out, cfg, _ = tiny
    t = _read_all(out)
    for k, v in t.items():
        if v.dtype in (torch.float32, torch.bfloat16):
            assert torch.isfinite(v.float()).all(), k
    norms = torch.cat([t[k].float() for k in t if k.endswith("norm.weight")])
    assert abs(norms.mean().item() - 1.0) < 0.05
    # block-FP8 linear ~ N(0, 1/in)
    w = formats.dequant_fp8_block(t["layers.0.attn.wq_a.weight"], t["layers.0.attn.wq_a.scale"])
    assert torch.isfinite(w).all()
    assert 0.7 < w.std().item() * cfg.hidden_size ** 0.5 < 1.3
    e = formats.dequant_mxfp4(t["layers.0.ffn.experts.0.w1.weight"], t["layers.0.ffn.experts.0.w1.scale"])
    assert e.shape == (cfg.moe_intermediate_size, cfg.hidden_size) and torch.isfinite(e).all()
    assert 0.6 < e.std().item() * cfg.hidden_size ** 0.5 < 1.4
    L = cfg.engram_layer_ids[0]
    tab = formats.dequant_fp8_rowblock(t[f"layers.{L}.engram.embed.weight"], t[f"layers.{L}.engram.embed.scale"])
    assert torch.isfinite(tab).all() and 0.8 < tab.std().item() < 1.2
    base = t["layers.0.hc_attn_base"]
    C = cfg.hc_mult
    pre = torch.sigmoid(base[:C])
    assert ((pre > 0.3) & (pre < 0.7)).all()
    assert t["layers.0.hc_attn_scale"].shape == (3,)


def test_tiny_deterministic(tiny, tmp_path):
    out, _, _ = tiny
    make_checkpoint(str(tmp_path / "again"), preset="tiny", seed=0)
    assert _digest(out) == _digest(str(tmp_path / "again"))
    make_checkpoint(str(tmp_path / "seed1"), preset="tiny", seed=1)
    a, b = _digest(out), _digest(str(tmp_path / "seed1"))
    assert a["config.json"] == b["config.json"] and a["tokenizer.json"] == b["tokenizer.json"]
    assert all(a[f] != b[f] for f in a if f.endswith(".safetensors"))


# ----------------------------------------------------------------------------
# config.json
# ----------------------------------------------------------------------------
def test_config_round_trip_and_format(tiny):
    out, cfg, _ = tiny
    with open(os.path.join(out, "config.json")) as f:
        obj = json.load(f)
    assert obj["architectures"] == ["DeepseekV41ForCausalLM"]
    assert obj["model_type"] == "deepseek_v41"
    assert obj["dtype"] == "bfloat16"
    assert (obj["bos_token_id"], obj["eos_token_id"], obj["pad_token_id"]) == (0, 1, 2)
    assert obj["quantization_config"] == presets.QUANTIZATION_CONFIG
    assert obj["text_config"]["model_type"] == "deepseek_v41_text"
    assert obj.get("vision_config", {}).get("num_hidden_layers", 0) == 0
    assert not any(v is None for k, v in obj["text_config"].items() if k in presets.TINY and presets.TINY[k] is None)
    again = load_config(out)
    assert dict(again.raw) == dict(cfg.raw)
    assert dict(again.quant) == dict(cfg.quant)
    assert again.plans == cfg.plans


def test_derived_values(tiny):
    from transformers import AutoTokenizer

    out, cfg, _ = tiny
    tok = AutoTokenizer.from_pretrained(out)
    assert cfg.vocab_size == len(tok) and cfg.vocab_size % 64 == 0 and 512 <= cfg.vocab_size <= 2048
    assert cfg.dspark_noise_token_id == tok.convert_tokens_to_ids(NOISE_TOKEN)
    assert cfg.engram_compressed_vocab_size == build_compressed_token_map(tok)[1]
    lay = engram_layout(cfg.engram_layer_ids, cfg.engram_max_ngram_size, cfg.engram_n_heads, cfg.engram_vocab_size)
    assert list(cfg.engram_num_embeddings) == [x.rows for x in lay]
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["image_token_id"] == tok.convert_tokens_to_ids(IMAGE_TOKEN)


def test_vllm_config_class_reads_it(tiny):
    pytest.importorskip("vllm")
    from vllm.transformers_utils.config import get_config

    out, cfg, _ = tiny
    hf = get_config(out, trust_remote_code=False)
    assert type(hf).__name__ == "DeepseekV41Config"
    assert hf.vocab_size == cfg.vocab_size and hf.hidden_size == cfg.hidden_size
    assert list(hf.engram_layer_ids) == list(cfg.engram_layer_ids)
    assert list(hf.engram_num_embeddings) == list(cfg.engram_num_embeddings)
    assert hf.engram_compressed_vocab_size == cfg.engram_compressed_vocab_size
    assert hf.expert_dtype == "fp4" and hf.vision_n_layers == 0


# ----------------------------------------------------------------------------
# --set / --no-engram
# ----------------------------------------------------------------------------
def test_parse_set_args():
    got = parse_set_args(["index_topk=8", "rope_theta=2e4", "hidden_act=silu", "engram_layer_ids=[1]",
                          "attention_bias=false", "x=a=b"])
    assert got == {"index_topk": 8, "rope_theta": 2e4, "hidden_act": "silu", "engram_layer_ids": [1],
                   "attention_bias": False, "x": "a=b"}
    with pytest.raises(ConfigError):
        parse_set_args(["novalue"])


def test_set_override_via_cli(tmp_path):
    out = str(tmp_path / "ovr")
    rc = main([out, "--preset", "tiny", "--set", "index_topk=8", "--set", "sliding_window=32",
               "--set", "engram_layer_ids=[3]"])
    assert rc == 0
    cfg = load_config(out)
    assert cfg.index_topk == 8 and cfg.sliding_window == 32
    assert list(cfg.engram_layer_ids) == [3] and len(cfg.engram_num_embeddings) == 1
    names = set(json.load(open(os.path.join(out, "model.safetensors.index.json")))["weight_map"])
    assert "layers.3.engram.embed.weight" in names and "layers.1.engram.embed.weight" not in names


def test_bad_set_fails_naming_key(tmp_path):
    out = tmp_path / "bad"
    with pytest.raises(ConfigError, match="o_groups"):
        make_checkpoint(str(out), preset="tiny", overrides={"o_groups": 3})
    assert not out.exists() or not any(out.iterdir())
    with pytest.raises(ConfigError, match="compress_ratios"):
        make_checkpoint(str(out), preset="tiny", overrides={"compress_ratios": [0, 4] + [0] * 13})
    with pytest.raises(ConfigError, match="engram_layer_idz"):
        make_checkpoint(str(out), preset="tiny", overrides={"engram_layer_idz": []})
    with pytest.raises(ConfigError, match="vocab_size"):
        make_checkpoint(str(out), preset="tiny", overrides={"vocab_size": 200})
    assert main([str(out), "--set", "o_groups=3"]) == 2
    assert not out.exists() or not any(out.iterdir())


def test_no_engram(tmp_path):
    out = str(tmp_path / "noeng")
    # write into a directory that already holds weights: stale shards must not survive
    os.makedirs(out)
    stale = os.path.join(out, "model-00009-of-00009.safetensors")
    open(stale, "wb").close()
    cfg = make_checkpoint(out, preset="tiny", no_engram=True)
    assert not os.path.exists(stale)
    assert list(cfg.engram_layer_ids) == [] and list(cfg.engram_num_embeddings) == []
    names = json.load(open(os.path.join(out, "model.safetensors.index.json")))["weight_map"]
    assert not any(".engram." in k for k in names)
    assert set(names) == set(expected_tensors(cfg))


# ----------------------------------------------------------------------------
# tokenizer
# ----------------------------------------------------------------------------
def test_autotokenizer_special_ids(tiny):
    from transformers import AutoTokenizer

    out, cfg, _ = tiny
    tok = AutoTokenizer.from_pretrained(out)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    V = cfg.vocab_size
    top = [tok.convert_tokens_to_ids(t) for t in (USER_TOKEN, ASSISTANT_TOKEN, THINK_START, THINK_END,
                                                   NOISE_TOKEN, IMAGE_TOKEN, "｜DSML｜", "<｜System｜>")]
    assert len(set(top)) == len(top) and all(V - 32 <= i < V for i in top)
    ids = tok.encode("Hello world")
    assert ids[0] == 0 and tok.decode(ids, skip_special_tokens=True) == "Hello world"
    enc = tok.encode(f"{USER_TOKEN}Hi{ASSISTANT_TOKEN}{THINK_END}", add_special_tokens=False)
    assert enc[0] == tok.convert_tokens_to_ids(USER_TOKEN) and enc[-2:] == top[1:2] + top[3:4]
    assert tok.decode(tok.encode("The café in Zürich is naïve.", add_special_tokens=False)) == \
        "The café in Zürich is naïve."


def test_hf_chat_template_matches_v41_encoder(tiny):
    pytest.importorskip("vllm")
    from transformers import AutoTokenizer
    from vllm.tokenizers.deepseek_v41_encoding import encode_messages

    tok = AutoTokenizer.from_pretrained(tiny[0])
    for chat in CHATS:
        s = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        assert s == encode_messages(chat, thinking_mode="chat")
        s = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False, thinking=True)
        assert s == encode_messages(chat, thinking_mode="thinking")


def test_vllm_deepseek_v41_tokenizer(tiny):
    pytest.importorskip("vllm")
    from vllm.tokenizers.deepseek_v41_encoding import encode_messages
    from vllm.tokenizers.registry import get_tokenizer

    out, cfg, _ = tiny
    tok = get_tokenizer(out, tokenizer_mode="deepseek_v41")
    assert "DSV41" in type(tok).__name__
    for chat in CHATS:
        ids = tok.apply_chat_template(chat, thinking=False)
        text = encode_messages(chat, thinking_mode="chat")
        assert ids == tok.encode(text, add_special_tokens=False)
        assert ids[0] == cfg.bos_token_id
        assert ids[-2:] == [tok.convert_tokens_to_ids(ASSISTANT_TOKEN), tok.convert_tokens_to_ids(THINK_END)]
        assert tok.decode(ids) == text
        ids = tok.apply_chat_template(chat)  # vLLM default: thinking, effort "high"
        assert ids[-1] == tok.convert_tokens_to_ids(THINK_START)
    assert len(tok) == cfg.vocab_size
    # the default ("hf") mode uses the Jinja template
    hf = get_tokenizer(out)
    assert hf.apply_chat_template(CHATS[1], add_generation_prompt=True, tokenize=False) == \
        encode_messages(CHATS[1], thinking_mode="chat")


# ----------------------------------------------------------------------------
# bench / full
# ----------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["bench", "full"])
def test_bench_full_config_and_tokenizer(which, bench, full):
    from transformers import AutoTokenizer

    out, cfg = {"bench": bench, "full": full}[which]
    assert not any(f.endswith(".safetensors") or f.endswith(".index.json") for f in os.listdir(out))
    again = load_config(out)
    assert dict(again.raw) == dict(cfg.raw)
    assert cfg.vocab_size == 129280 and cfg.hidden_size == 5120 and cfg.n_layers == 40
    tok = AutoTokenizer.from_pretrained(out)
    assert len(tok) == 129280
    official = {USER_TOKEN: 128803, ASSISTANT_TOKEN: 128804, THINK_END: 128822, NOISE_TOKEN: 128799,
                IMAGE_TOKEN: 129264, BOS_TOKEN: 0, EOS_TOKEN: 1, PAD_TOKEN: 2}
    for t, i in official.items():
        assert tok.convert_tokens_to_ids(t) == i, t
    assert cfg.dspark_noise_token_id == 128799
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["image_token_id"] == 129264
    assert cfg.engram_compressed_vocab_size == build_compressed_token_map(tok)[1]
    if which == "bench":
        assert cfg.n_routed_experts == 32
        assert all(0.9e6 < r < 1.1e6 for r in cfg.engram_num_embeddings)
    else:
        assert list(cfg.engram_num_embeddings) == [384006168, 384016682]
        assert cfg.n_routed_experts == 384
