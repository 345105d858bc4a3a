"""A broken checkpoint is refused with an error that names the tensor or config key."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm_dsv41.checkpoint import CheckpointError, expected_tensors, open_checkpoint
from vllm_dsv41.config import ConfigError, load_config

VICTIM = "layers.3.attn.wq_b.weight"


def _copy(tiny_ckpt, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, d)
    return d


def _edit(d, name, fn):
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shard = d / index["weight_map"][name]
    tensors = load_file(str(shard))
    new = fn(tensors.pop(name))
    if new is not None:
        tensors[name] = new
    else:
        del index["weight_map"][name]
        (d / "model.safetensors.index.json").write_text(json.dumps(index))
    save_file(tensors, str(shard))


def test_tiny_checkpoint_is_valid_and_complete(tiny_ckpt):
    ck = open_checkpoint(tiny_ckpt)
    assert set(ck.names()) == set(expected_tensors(ck.cfg))


@pytest.mark.parametrize("edit,words", [
    (lambda t: None, "missing"),
    (lambda t: t[:-32], "shape"),
    (lambda t: t.float().to(torch.bfloat16), "dtype"),
])
def test_broken_tensor_is_named(tiny_ckpt, tmp_path, edit, words):
    d = _copy(tiny_ckpt, tmp_path)
    _edit(d, VICTIM, edit)
    with pytest.raises(CheckpointError, match=rf"{VICTIM}.*{words}|{words}.*{VICTIM}"):
        open_checkpoint(d)
    from vllm_dsv41.reference import Transformer

    with pytest.raises(CheckpointError, match=VICTIM.replace(".", r"\.")):
        Transformer(str(d))


def test_unexpected_tensor_is_named(tiny_ckpt, tmp_path):
    d = _copy(tiny_ckpt, tmp_path)
    _edit(d, VICTIM, lambda t: t)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    save_file({"layers.0.attn.bogus.weight": torch.zeros(2)}, str(d / "extra.safetensors"))
    index["weight_map"]["layers.0.attn.bogus.weight"] = "extra.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="bogus"):
        open_checkpoint(d)


@pytest.mark.parametrize("key,value", [
    ("o_groups", 3),
    ("compress_ratios", [0, 0, 4] + [2] * 3 + [1] * 6 + [0, 0, 0]),
    ("kv_source_layer_ids", [0, 4, 6]),
    ("candidate_source_layer_id", 7),
    ("sliding_window", "wide"),
    ("index_topk", 0),
])
def test_bad_config_value_is_named(tiny_ckpt, tmp_path, key, value):
    d = _copy(tiny_ckpt, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["text_config"][key] = value
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=key):
        load_config(d)


def test_missing_config_key_is_named(tiny_ckpt, tmp_path):
    d = _copy(tiny_ckpt, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["text_config"]["head_dim"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="'head_dim'.*missing"):
        load_config(d)
