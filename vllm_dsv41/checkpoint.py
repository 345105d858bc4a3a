"""The official V4.1 checkpoint: tensor inventory, reading and validation.

Owns ``expected_tensors(cfg)`` — every tensor name, shape and dtype a checkpoint
in the official format carries for a given config (architecture.md §6.3) — and
``open_checkpoint(dir)``, which reads the safetensors shards lazily and refuses a
checkpoint with a missing tensor, a wrong shape or a wrong dtype with a
:class:`CheckpointError` naming it.  Also the dequantisation of one logical
weight (FP8 32x32 blocks, MXFP4 experts, FP8 Engram rows) for consumers that
compute in plain floats (the reference model, the CPU path).
"""

from __future__ import annotations

import json
import os
from typing import Iterator

import torch

from vllm_dsv41 import formats
from vllm_dsv41.config import DSV41Config, load_config

FP8 = torch.float8_e4m3fn
E8M0 = torch.float8_e8m0fnu
BF16 = torch.bfloat16
F32 = torch.float32
I8 = torch.int8

Spec = tuple[tuple[int, ...], torch.dtype]


class CheckpointError(ValueError):
    """A checkpoint tensor is missing, unexpected, or of the wrong shape/dtype."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _fp8_linear(out: dict[str, Spec], name: str, rows: int, cols: int, quantized: bool) -> None:
    if quantized:
        out[f"{name}.weight"] = ((rows, cols), FP8)
        out[f"{name}.scale"] = ((_cdiv(rows, 32), _cdiv(cols, 32)), E8M0)
    else:
        out[f"{name}.weight"] = ((rows, cols), BF16)


def _expert(out: dict[str, Spec], name: str, rows: int, cols: int, fp4: bool) -> None:
    if fp4:
        out[f"{name}.weight"] = ((rows, cols // 2), I8)
        out[f"{name}.scale"] = ((rows, cols // 32), E8M0)
    else:
        _fp8_linear(out, name, rows, cols, True)


def _layer_tensors(out: dict[str, Spec], cfg: DSV41Config, p: str, layer_id: int, q: bool) -> None:
    plan = cfg.plan(layer_id)
    H, D, C = cfg.hidden_size, cfg.head_dim, cfg.hc_mult
    mix = (2 + C) * C
    out[f"{p}.attn_norm.weight"] = ((H,), BF16)
    out[f"{p}.ffn_norm.weight"] = ((H,), BF16)
    for b in ("attn", "ffn"):
        out[f"{p}.hc_{b}_fn"] = ((mix, C * H), F32)
        out[f"{p}.hc_{b}_base"] = ((mix,), F32)
        out[f"{p}.hc_{b}_scale"] = ((3,), F32)
    a = f"{p}.attn"
    _fp8_linear(out, f"{a}.wq_a", cfg.q_lora_rank, H, q)
    out[f"{a}.q_norm.weight"] = ((cfg.q_lora_rank,), BF16)
    _fp8_linear(out, f"{a}.wkv", D, H, q)
    out[f"{a}.kv_norm.weight"] = ((D,), BF16)
    _fp8_linear(out, f"{a}.wq_b", cfg.num_attention_heads * D, cfg.q_lora_rank, q)
    _fp8_linear(out, f"{a}.wo_a", cfg.o_groups * cfg.o_lora_rank, cfg.heads_per_group * D, q)
    _fp8_linear(out, f"{a}.wo_b", H, cfg.o_groups * cfg.o_lora_rank, q)
    out[f"{a}.attn_sink"] = ((cfg.num_attention_heads,), F32)
    if plan.owns_compressor:
        out[f"{a}.compressor.wkv.weight"] = ((D, H), BF16)
        if plan.compress_ratio == 2:
            out[f"{a}.compressor.wgate.weight"] = ((D, H), BF16)
        out[f"{a}.compressor.norm.weight"] = ((D,), BF16)
        out[f"{a}.indexer.wk.weight"] = ((cfg.index_head_dim, D), BF16)
        out[f"{a}.indexer.k_norm.weight"] = ((cfg.index_head_dim,), BF16)
    if plan.owns_indexer:
        _fp8_linear(out, f"{a}.indexer.wq_b", cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank, q)
        out[f"{a}.indexer.weights_proj.weight"] = ((cfg.index_n_heads, H), BF16)
    f = f"{p}.ffn"
    E, I = plan.n_routed_experts, cfg.moe_intermediate_size
    out[f"{f}.gate.weight"] = ((E, H), BF16)
    out[f"{f}.gate.bias"] = ((E,), F32)
    fp4 = cfg.experts_fp4 or not q
    for e in range(E):
        if q:
            _expert(out, f"{f}.experts.{e}.w1", I, H, fp4)
            _expert(out, f"{f}.experts.{e}.w3", I, H, fp4)
            _expert(out, f"{f}.experts.{e}.w2", H, I, fp4)
        else:
            for w, r, c in (("w1", I, H), ("w3", I, H), ("w2", H, I)):
                out[f"{f}.experts.{e}.{w}.weight"] = ((r, c), BF16)
    Is = I * cfg.n_shared_experts
    _fp8_linear(out, f"{f}.shared_experts.w1", Is, H, q)
    _fp8_linear(out, f"{f}.shared_experts.w3", Is, H, q)
    _fp8_linear(out, f"{f}.shared_experts.w2", H, Is, q)
    if plan.has_engram:
        k = cfg.engram_layer_ids.index(layer_id)
        rows, hd = cfg.engram_num_embeddings[k], cfg.engram_head_dim
        out[f"{p}.engram.embed.weight"] = ((rows, hd), FP8)
        out[f"{p}.engram.embed.scale"] = ((rows, hd // 32), E8M0)
        _fp8_linear(out, f"{p}.engram.wkv", (C + 1) * H, cfg.engram_n_columns * hd, True)
        out[f"{p}.engram.q_weight"] = ((C, H), BF16)
        out[f"{p}.engram.k_weight"] = ((C, H), BF16)


def expected_tensors(cfg: DSV41Config, include_draft: bool = True) -> dict[str, Spec]:
    """Every tensor of an official-format checkpoint for ``cfg``: name -> (shape, dtype)."""
    q = cfg.quantized
    H, V = cfg.hidden_size, cfg.vocab_size
    out: dict[str, Spec] = {
        "embed.weight": ((V, H), BF16),
        "head.weight": ((V, H), BF16),
        "norm.weight": ((H,), BF16),
    }
    for L in range(cfg.n_layers):
        _layer_tensors(out, cfg, f"layers.{L}", L, q)
    nd = cfg.n_draft_layers if include_draft else 0
    for k in range(nd):
        _layer_tensors(out, cfg, f"mtp.{k}", cfg.n_layers + k, q)
    if nd:
        _fp8_linear(out, "mtp.0.main_proj", H, len(cfg.dspark_target_layer_ids) * H, q)
        out["mtp.0.main_norm.weight"] = ((H,), BF16)
        last = f"mtp.{nd - 1}"
        out[f"{last}.norm.weight"] = ((H,), BF16)
        out[f"{last}.markov_head.embed.weight"] = ((V, cfg.dspark_markov_rank), BF16)
        out[f"{last}.markov_head.head.weight"] = ((V, cfg.dspark_markov_rank), BF16)
    return out


OPTIONAL_PREFIXES = ("vision.", "aligner.", "image_")
OPTIONAL_SUFFIXES = ("confidence_head.proj.weight",)


class Checkpoint:
    """Lazily opened safetensors shards of one checkpoint directory."""

    def __init__(self, path: str | os.PathLike, cfg: DSV41Config | None = None):
        from safetensors import safe_open

        self.path = os.fspath(path)
        self.cfg = cfg if cfg is not None else load_config(self.path)
        index = os.path.join(self.path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                weight_map: dict[str, str] = json.load(f)["weight_map"]
        else:
            files = sorted(f for f in os.listdir(self.path) if f.endswith(".safetensors"))
            if not files:
                raise CheckpointError(f"no .safetensors files in {self.path}")
            weight_map = {}
            for fn in files:
                with safe_open(os.path.join(self.path, fn), "pt") as h:
                    for k in h.keys():
                        weight_map[k] = fn
        self._files = {fn: safe_open(os.path.join(self.path, fn), "pt") for fn in set(weight_map.values())}
        self.weight_map = weight_map

    def names(self) -> list[str]:
        return list(self.weight_map)

    def get(self, name: str) -> torch.Tensor:
        fn = self.weight_map.get(name)
        if fn is None:
            raise CheckpointError(f"checkpoint tensor {name!r} is missing")
        return self._files[fn].get_tensor(name)

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.weight_map:
            yield name, self.get(name)

    def validate(self, include_draft: bool = True) -> None:
        """Refuse a missing, unexpected, mis-shaped or mis-typed tensor, naming it."""
        want = expected_tensors(self.cfg, include_draft=include_draft)
        for name, (shape, dtype) in want.items():
            if name not in self.weight_map:
                raise CheckpointError(f"checkpoint tensor {name!r} is missing (expected {dtype} {list(shape)})")
            fn = self.weight_map[name]
            sl = self._files[fn].get_slice(name)
            got_shape = tuple(sl.get_shape())
            got_dtype = _SAFETENSORS_DTYPES.get(sl.get_dtype())
            if got_shape != shape:
                raise CheckpointError(f"checkpoint tensor {name!r} has shape {list(got_shape)}, "
                                      f"expected {list(shape)}")
            if got_dtype != dtype:
                raise CheckpointError(f"checkpoint tensor {name!r} has dtype {sl.get_dtype()}, expected {dtype}")
        for name in self.weight_map:
            if name in want or name.startswith(OPTIONAL_PREFIXES) or name.endswith(OPTIONAL_SUFFIXES):
                continue
            if not include_draft and name.startswith("mtp."):
                continue
            raise CheckpointError(f"checkpoint tensor {name!r} is not part of the V4.1 format for this config")

    def dense(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Weight ``name`` (without ``.weight``) dequantised to ``dtype``."""
        w = self.get(f"{name}.weight")
        if w.dtype == FP8:
            return formats.dequant_fp8_block(w, self.get(f"{name}.scale"), 32, dtype)
        if w.dtype == I8:
            return formats.dequant_mxfp4(w, self.get(f"{name}.scale"), dtype)
        return w.to(dtype)

    def engram_table(self, prefix: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return formats.dequant_fp8_rowblock(self.get(f"{prefix}.embed.weight"),
                                            self.get(f"{prefix}.embed.scale"), 32, dtype)


_SAFETENSORS_DTYPES = {
    "F8_E4M3": FP8, "F8_E8M0": E8M0, "BF16": BF16, "F32": F32, "I8": I8, "F16": torch.float16,
    "U8": torch.uint8, "I32": torch.int32, "I64": torch.int64,
}


def open_checkpoint(path: str | os.PathLike, validate: bool = True, include_draft: bool = True) -> Checkpoint:
    ckpt = Checkpoint(path)
    if validate:
        ckpt.validate(include_draft=include_draft)
    return ckpt
