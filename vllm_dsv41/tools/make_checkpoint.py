"""Write a synthetic DeepSeek-V4.1 checkpoint in the official on-disk format.

Usage::

    python -m vllm_dsv41.tools.make_checkpoint OUT --preset tiny|bench|full \\
        [--seed N] [--set key=value ...] [--no-engram]

Every preset writes ``config.json`` (the official nested layout, architecture.md
§1.1/§1.4) and a tokenizer (:mod:`vllm_dsv41.tokenizer`).  ``tiny`` also writes
seeded random weights as safetensors shards with the official tensor names,
shapes, dtypes and scale layouts (§6.3); ``bench`` and ``full`` are meant for
``load_format="dummy"`` and memory arithmetic, so they carry no weights.

Values that depend on the tokenizer or on the Engram prime layout are derived
here unless given with ``--set``: ``vocab_size`` (when the preset leaves it
open), ``dspark_noise_token_id``, ``engram_compressed_vocab_size`` (from the
written tokenizer reloaded with ``AutoTokenizer``) and ``engram_num_embeddings``.

The weight distributions are module-level constants (``*_STD``, ``*_GAIN``,
``HC_*``) so they can be tuned against the reference model.  Every tensor is
drawn from its own ``torch.Generator`` seeded from (seed, tensor name): the
output is byte-identical for a given seed, and adding or removing a tensor does
not change any other tensor.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from vllm_dsv41 import formats, presets
from vllm_dsv41.checkpoint import BF16, E8M0, F32, FP8, I8, Spec
from vllm_dsv41.config import _OPTIONAL, _REQUIRED, ConfigError, DSV41Config, parse_config

# ----------------------------------------------------------------------------
# Weight-initialisation knobs (the lead tunes these against the reference model)
# ----------------------------------------------------------------------------
NORM_JITTER = 0.1  # every RMSNorm weight ~ 1 + NORM_JITTER * N(0, 1)
LINEAR_GAIN = 1.0  # linear weights ~ N(0, (LINEAR_GAIN / sqrt(in_features))^2)
OUT_PROJ_GAIN = 1.0  # extra factor on projections that write the residual (wo_b, w2, engram value)
EMBED_STD = 1.0  # embed.weight ~ N(0, EMBED_STD^2)
HEAD_STD = 1.0  # head.weight ~ N(0, HEAD_STD^2)
HC_FN_STD = 0.02  # hc_*_fn ~ N(0, (HC_FN_STD / sqrt(hc_mult * hidden))^2)
HC_PRE_BASE = 0.0  # pre = sigmoid(scale*m + base) ~ 0.5
HC_POST_BASE = 0.0  # post = 2 * sigmoid(scale*m + base) ~ 1
HC_COMB_DIAG = 2.0  # comb logits bias: streams mostly keep themselves
HC_BASE_JITTER = 0.05
HC_SCALE = (1.0, 1.0, 1.0)  # hc_*_scale (pre, post, comb)
HC_SCALE_JITTER = 0.05
SINK_STD = 0.1  # attn_sink ~ N(0, SINK_STD^2) (fp32)
ROUTER_GAIN = 1.0  # ffn.gate.weight ~ N(0, (ROUTER_GAIN / sqrt(hidden))^2)
ROUTER_BIAS_STD = 0.01  # ffn.gate.bias (fp32)
ENGRAM_TABLE_STD = 1.0  # engram.embed rows (stored FP8 + E8M0 per 32)
ENGRAM_QK_JITTER = 0.1  # engram.q_weight / k_weight ~ 1 + jitter * N(0, 1)
MARKOV_GAIN = 1.0  # markov_head.{embed,head} ~ N(0, (MARKOV_GAIN / sqrt(rank))^2)

CONFIG_TRANSFORMERS_VERSION = "5.19.0"  # written into config.json (fixed, for byte-identical output)
TINY_TARGET_SHARDS = 4  # tiny's tensors are packed into about this many shards

# Optional V4.1 text-config keys that may be set although no preset lists them.
EXTRA_TEXT_KEYS = frozenset({"enable_confidence_head", "draft_vocab_size", "sample_from_anchor",
                             "dspark_draft_topk", "n_group", "topk_group", "first_k_dense_replace",
                             "num_hash_layers"})



# ----------------------------------------------------------------------------
# Logical weights: one entry per parameter, before quantisation
# ----------------------------------------------------------------------------
@dataclass(frozen=True)
class _Logical:
    """One logical parameter.

    ``kind``: "fp8" (block-FP8 linear: ``name.weight`` + ``name.scale``),
    "mxfp4" (expert linear, same two names), "rows" (Engram table: FP8 rows +
    E8M0 per 32), "bf16"/"f32" (stored as-is under ``name``).
    ``init``: ("normal", std) | ("ones_jitter", jitter) | ("hc_base", None) |
    ("hc_scale", None).
    """

    name: str
    kind: str
    shape: tuple[int, ...]
    init: tuple[str, Any]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _linear(out: list[_Logical], name: str, rows: int, cols: int, quantized: bool,
            gain: float = LINEAR_GAIN, force_fp8: bool = False) -> None:
    kind = "fp8" if (quantized or force_fp8) else "bf16"
    full = name if kind == "fp8" else f"{name}.weight"
    out.append(_Logical(full, kind, (rows, cols), ("normal", gain / math.sqrt(cols))))


def _norm(out: list[_Logical], name: str, dim: int) -> None:
    out.append(_Logical(name, "bf16", (dim,), ("ones_jitter", NORM_JITTER)))


def _layer(out: list[_Logical], cfg: DSV41Config, prefix: str, layer_id: int) -> None:
    plan = cfg.plans[layer_id]
    q = cfg.quantized
    H, D, C = cfg.hidden_size, cfg.head_dim, cfg.hc_mult
    n_mix = (2 + C) * C
    _norm(out, f"{prefix}.attn_norm.weight", H)
    _norm(out, f"{prefix}.ffn_norm.weight", H)
    for b in ("attn", "ffn"):
        out.append(_Logical(f"{prefix}.hc_{b}_fn", "f32", (n_mix, C * H), ("normal", HC_FN_STD / math.sqrt(C * H))))
        out.append(_Logical(f"{prefix}.hc_{b}_base", "f32", (n_mix,), ("hc_base", C)))
        out.append(_Logical(f"{prefix}.hc_{b}_scale", "f32", (3,), ("hc_scale", None)))

    a = f"{prefix}.attn"
    heads, Q, O, G = cfg.num_attention_heads, cfg.q_lora_rank, cfg.o_lora_rank, cfg.o_groups
    _linear(out, f"{a}.wq_a", Q, H, q)
    _norm(out, f"{a}.q_norm.weight", Q)
    _linear(out, f"{a}.wkv", D, H, q)
    _norm(out, f"{a}.kv_norm.weight", D)
    _linear(out, f"{a}.wq_b", heads * D, Q, q)
    _linear(out, f"{a}.wo_a", G * O, (heads // G) * D, q)
    _linear(out, f"{a}.wo_b", H, G * O, q, gain=LINEAR_GAIN * OUT_PROJ_GAIN)
    out.append(_Logical(f"{a}.attn_sink", "f32", (heads,), ("normal", SINK_STD)))
    if plan.owns_compressor:
        out.append(_Logical(f"{a}.compressor.wkv.weight", "bf16", (D, H), ("normal", LINEAR_GAIN / math.sqrt(H))))
        if plan.compress_ratio == 2:
            out.append(_Logical(f"{a}.compressor.wgate.weight", "bf16", (D, H),
                                ("normal", LINEAR_GAIN / math.sqrt(H))))
        _norm(out, f"{a}.compressor.norm.weight", D)
        out.append(_Logical(f"{a}.indexer.wk.weight", "bf16", (cfg.index_head_dim, D),
                            ("normal", LINEAR_GAIN / math.sqrt(D))))
        _norm(out, f"{a}.indexer.k_norm.weight", cfg.index_head_dim)
    if plan.owns_indexer:
        _linear(out, f"{a}.indexer.wq_b", cfg.index_n_heads * cfg.index_head_dim, Q, q)
        out.append(_Logical(f"{a}.indexer.weights_proj.weight", "bf16", (cfg.index_n_heads, H),
                            ("normal", LINEAR_GAIN / math.sqrt(H))))

    f = f"{prefix}.ffn"
    E, inter = plan.n_routed_experts, cfg.moe_intermediate_size
    out.append(_Logical(f"{f}.gate.weight", "bf16", (E, H), ("normal", ROUTER_GAIN / math.sqrt(H))))
    out.append(_Logical(f"{f}.gate.bias", "f32", (E,), ("normal", ROUTER_BIAS_STD)))
    ekind = ("mxfp4" if cfg.experts_fp4 else "fp8") if q else "bf16"
    for e in range(E):
        for w, rows, cols, gain in (("w1", inter, H, LINEAR_GAIN), ("w3", inter, H, LINEAR_GAIN),
                                    ("w2", H, inter, LINEAR_GAIN * OUT_PROJ_GAIN)):
            base = f"{f}.experts.{e}.{w}"
            out.append(_Logical(base if ekind != "bf16" else f"{base}.weight", ekind, (rows, cols),
                                ("normal", gain / math.sqrt(cols))))
    Is = inter * cfg.n_shared_experts
    _linear(out, f"{f}.shared_experts.w1", Is, H, q)
    _linear(out, f"{f}.shared_experts.w3", Is, H, q)
    _linear(out, f"{f}.shared_experts.w2", H, Is, q, gain=LINEAR_GAIN * OUT_PROJ_GAIN)

    if plan.has_engram:
        k = list(cfg.engram_layer_ids).index(layer_id)
        rows, hd = int(cfg.engram_num_embeddings[k]), cfg.engram_head_dim
        g = f"{prefix}.engram"
        out.append(_Logical(f"{g}.embed", "rows", (rows, hd), ("normal", ENGRAM_TABLE_STD)))
        # The Engram key/value projection is FP8 in every official checkpoint.
        _linear(out, f"{g}.wkv", (C + 1) * H, cfg.engram_n_columns * hd, q, force_fp8=True,
                gain=LINEAR_GAIN * OUT_PROJ_GAIN)
        out.append(_Logical(f"{g}.q_weight", "bf16", (C, H), ("ones_jitter", ENGRAM_QK_JITTER)))
        out.append(_Logical(f"{g}.k_weight", "bf16", (C, H), ("ones_jitter", ENGRAM_QK_JITTER)))


def logical_weights(cfg: DSV41Config) -> list[_Logical]:
    """Every parameter of an official checkpoint for ``cfg``, in file order."""
    H, V = cfg.hidden_size, cfg.vocab_size
    out: list[_Logical] = [_Logical("embed.weight", "bf16", (V, H), ("normal", EMBED_STD))]
    for L in range(cfg.n_layers):
        _layer(out, cfg, f"layers.{L}", L)
    _norm(out, "norm.weight", H)
    out.append(_Logical("head.weight", "bf16", (V, H), ("normal", HEAD_STD)))
    nd = cfg.n_draft_layers
    for k in range(nd):
        p = f"mtp.{k}"
        if k == 0:
            n_in = len(cfg.dspark_target_layer_ids) * H
            _linear(out, "mtp.0.main_proj", H, n_in, cfg.quantized)
            _norm(out, "mtp.0.main_norm.weight", H)
        _layer(out, cfg, p, cfg.n_layers + k)
        if k == nd - 1:
            _norm(out, f"{p}.norm.weight", H)
            r = cfg.dspark_markov_rank
            for part in ("embed", "head"):
                out.append(_Logical(f"{p}.markov_head.{part}.weight", "bf16", (V, r),
                                    ("normal", MARKOV_GAIN / math.sqrt(r))))
    return out


def _on_disk(lw: _Logical) -> dict[str, Spec]:
    rows = lw.shape[0]
    if lw.kind == "fp8":
        cols = lw.shape[1]
        return {f"{lw.name}.weight": ((rows, cols), FP8),
                f"{lw.name}.scale": ((_cdiv(rows, 32), _cdiv(cols, 32)), E8M0)}
    if lw.kind == "mxfp4":
        cols = lw.shape[1]
        return {f"{lw.name}.weight": ((rows, cols // 2), I8), f"{lw.name}.scale": ((rows, cols // 32), E8M0)}
    if lw.kind == "rows":
        cols = lw.shape[1]
        return {f"{lw.name}.weight": ((rows, cols), FP8), f"{lw.name}.scale": ((rows, cols // 32), E8M0)}
    return {lw.name: (lw.shape, BF16 if lw.kind == "bf16" else F32)}


def expected_tensors(cfg: DSV41Config) -> dict[str, Spec]:
    """name -> (shape, torch dtype) of every tensor an official checkpoint for ``cfg`` holds."""
    out: dict[str, Spec] = {}
    for lw in logical_weights(cfg):
        out.update(_on_disk(lw))
    return out


# ----------------------------------------------------------------------------
# Random values
# ----------------------------------------------------------------------------
def _tensor_seed(seed: int, name: str) -> int:
    h = hashlib.blake2b(f"{int(seed)}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


def _values(lw: _Logical, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(_tensor_seed(seed, lw.name))
    how, arg = lw.init
    z = torch.randn(lw.shape, generator=g, dtype=torch.float32)
    if how == "normal":
        return z * float(arg)
    if how == "ones_jitter":
        return 1.0 + float(arg) * z
    if how == "hc_base":
        C = int(arg)
        base = torch.zeros(lw.shape, dtype=torch.float32)
        base[0:C] = HC_PRE_BASE
        base[C:2 * C] = HC_POST_BASE
        base[2 * C:] = (HC_COMB_DIAG * torch.eye(C)).reshape(-1)
        return base + HC_BASE_JITTER * z
    if how == "hc_scale":
        return torch.tensor(HC_SCALE, dtype=torch.float32) * (1.0 + HC_SCALE_JITTER * z)
    raise ValueError(f"unknown init {how!r} for {lw.name}")


def _materialise(lw: _Logical, seed: int) -> dict[str, torch.Tensor]:
    v = _values(lw, seed)
    if lw.kind == "fp8":
        w, s = formats.quant_fp8_block(v, 32)
        return {f"{lw.name}.weight": w, f"{lw.name}.scale": s}
    if lw.kind == "mxfp4":
        w, s = formats.quant_mxfp4(v)
        return {f"{lw.name}.weight": w, f"{lw.name}.scale": s}
    if lw.kind == "rows":
        w, s = formats.quant_fp8_rowblock(v, 32)
        return {f"{lw.name}.weight": w, f"{lw.name}.scale": s}
    return {lw.name: v.to(BF16 if lw.kind == "bf16" else F32).contiguous()}


# ----------------------------------------------------------------------------
# Config assembly
# ----------------------------------------------------------------------------
def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, ValueError):
        return text


def parse_set_args(items: Sequence[str] | None) -> dict[str, Any]:
    """``["key=value", ...]`` -> dict; values are JSON where they parse, else strings."""
    out: dict[str, Any] = {}
    for item in items or ():
        key, sep, val = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        out[key] = _parse_value(val)
    return out


def _top_level(text: Mapping[str, Any], image_token_id: int) -> dict[str, Any]:
    return {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "image_token_id": int(image_token_id),
        "quantization_config": dict(presets.QUANTIZATION_CONFIG),
        "text_config": {"model_type": "deepseek_v41_text", **text},
        # A v5 version here tells transformers the >100k-id tokenizer next to it
        # is not an old Mistral one (it would warn about a "regex fix" otherwise).
        "transformers_version": CONFIG_TRANSFORMERS_VERSION,
    }


def _check_keys(text: Mapping[str, Any], overrides: Mapping[str, Any]) -> None:
    known = set(text) | set(_REQUIRED) | set(_OPTIONAL) | EXTRA_TEXT_KEYS
    for key in overrides:
        if key not in known:
            raise ConfigError(f"config key {key!r}: not a DeepSeek-V4.1 text_config key (--set)")


def _provisional(text: dict[str, Any]) -> dict[str, Any]:
    """Stand-ins for derived values, so a bad override fails before any work."""
    t = dict(text)
    if t.get("vocab_size") is None:
        t["vocab_size"] = 1024
    if t.get("dspark_noise_token_id") is None:
        t["dspark_noise_token_id"] = 0
    if t.get("engram_compressed_vocab_size") is None:
        t["engram_compressed_vocab_size"] = 1
    if t.get("engram_num_embeddings") is None:
        t["engram_num_embeddings"] = [1] * len(t.get("engram_layer_ids") or [])
    return t


def build_text_config(preset: str, overrides: Mapping[str, Any] | None, no_engram: bool,
                      tokenizer_dir: str) -> tuple[dict[str, Any], Any]:
    """Text config with every derived value filled; writes the tokenizer to ``tokenizer_dir``."""
    from transformers import AutoTokenizer

    from vllm_dsv41.engram import build_compressed_token_map, engram_layout
    from vllm_dsv41.tokenizer import build_tokenizer

    overrides = dict(overrides or {})
    text = presets.preset(preset)
    _check_keys(text, overrides)
    text.update(overrides)
    if no_engram:
        text["engram_layer_ids"] = []
        text["engram_num_embeddings"] = []
    parse_config({"text_config": _provisional(text), "quantization_config": presets.QUANTIZATION_CONFIG})

    try:
        info = build_tokenizer(text.get("vocab_size"), tokenizer_dir,
                               model_max_length=int(text.get("max_position_embeddings") or 1048576))
    except ValueError as e:
        raise ConfigError(f"config key 'vocab_size': {e}") from None
    text["vocab_size"] = info.vocab_size
    if "dspark_noise_token_id" not in overrides:
        text["dspark_noise_token_id"] = info.noise_id
    if "engram_compressed_vocab_size" not in overrides:
        tok = AutoTokenizer.from_pretrained(tokenizer_dir)
        text["engram_compressed_vocab_size"] = int(build_compressed_token_map(tok)[1])
    if "engram_num_embeddings" not in overrides or no_engram:
        ids = text.get("engram_layer_ids") or []
        if ids:
            lay = engram_layout(ids, text["engram_max_ngram_size"], text["engram_n_heads"], text["engram_vocab_size"])
            text["engram_num_embeddings"] = [x.rows for x in lay]
        else:
            text["engram_num_embeddings"] = []
    return text, info


# ----------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------
def _nbytes(spec: Spec) -> int:
    shape, dtype = spec
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def _unit_of(name: str) -> str:
    """Shard-packing unit: a backbone layer, a draft stage, or the globals."""
    parts = name.split(".")
    if parts[0] in ("layers", "mtp"):
        return f"{parts[0]}.{parts[1]}"
    return parts[0]


def _plan_shards(lws: list[_Logical], target_shards: int) -> list[list[_Logical]]:
    units: list[tuple[str, list[_Logical], int]] = []
    for lw in lws:
        u = _unit_of(lw.name)
        size = sum(_nbytes(s) for s in _on_disk(lw).values())
        if units and units[-1][0] == u:
            units[-1][1].append(lw)
            units[-1] = (u, units[-1][1], units[-1][2] + size)
        else:
            units.append((u, [lw], size))
    total = sum(u[2] for u in units)
    limit = max(1, _cdiv(total, max(1, target_shards)))
    shards: list[list[_Logical]] = [[]]
    cur = 0
    for _, group, size in units:
        if cur >= limit:
            shards.append([])
            cur = 0
        shards[-1].extend(group)
        cur += size
    return shards


def write_weights(out_dir: str, cfg: DSV41Config, seed: int, target_shards: int = TINY_TARGET_SHARDS) -> int:
    """Write the sharded safetensors + index; returns the total tensor bytes."""
    from safetensors.torch import save_file

    shards = _plan_shards(logical_weights(cfg), target_shards)
    n = len(shards)
    weight_map: dict[str, str] = {}
    total = 0
    for i, group in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        for lw in group:
            tensors.update(_materialise(lw, seed))
        for k, t in tensors.items():
            weight_map[k] = fname
            total += t.numel() * t.element_size()
        path = os.path.join(out_dir, fname)
        save_file(tensors, path, metadata={"format": "pt"})
        os.chmod(path, 0o644)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)
        f.write("\n")
    return total


def _remove_stale_weights(out_dir: str) -> None:
    """Drop weight files a previous run left behind (a different shard count would linger)."""
    for fn in os.listdir(out_dir):
        if fn == "model.safetensors.index.json" or fn == "model.safetensors" or (
                fn.startswith("model-") and fn.endswith(".safetensors") and "-of-" in fn):
            os.remove(os.path.join(out_dir, fn))


def make_checkpoint(out_dir: str | os.PathLike, preset: str = "tiny", seed: int = 0,
                    overrides: Mapping[str, Any] | None = None, no_engram: bool = False) -> DSV41Config:
    """Write config.json + tokenizer (+ weights for ``tiny``) into ``out_dir``.

    Raises :class:`ConfigError` (naming the key) before anything is written
    when the resulting config is invalid.
    """
    if preset not in presets.PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; choose one of {sorted(presets.PRESETS)}")
    out = os.fspath(out_dir)
    with tempfile.TemporaryDirectory(prefix="dsv41_tok_") as tmp:
        text, info = build_text_config(preset, overrides, no_engram, tmp)
        obj = _top_level(text, info.image_id)
        cfg = parse_config(obj)
        os.makedirs(out, exist_ok=True)
        _remove_stale_weights(out)
        for fn in sorted(os.listdir(tmp)):
            shutil.copyfile(os.path.join(tmp, fn), os.path.join(out, fn))
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")
    if preset == "tiny":
        write_weights(out, cfg, seed)
    return cfg


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vllm_dsv41.tools.make_checkpoint",
                                 description="Write a synthetic DeepSeek-V4.1 checkpoint.")
    ap.add_argument("out", metavar="OUT", help="output directory")
    ap.add_argument("--preset", default="tiny", choices=sorted(presets.PRESETS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="override a text_config key (value parsed as JSON, else string); repeatable")
    ap.add_argument("--no-engram", action="store_true", help="engram_layer_ids = []")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    try:
        cfg = make_checkpoint(args.out, preset=args.preset, seed=args.seed,
                              overrides=parse_set_args(args.sets), no_engram=args.no_engram)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    dt = time.perf_counter() - t0
    size = sum(os.path.getsize(os.path.join(args.out, f)) for f in os.listdir(args.out))
    print(f"wrote {args.preset} checkpoint to {args.out}: vocab {cfg.vocab_size}, "
          f"{cfg.n_layers}+{cfg.n_draft_layers} layers, engram rows {list(cfg.engram_num_embeddings)}, "
          f"compressed vocab {cfg.engram_compressed_vocab_size}, {size / 1e6:.1f} MB in {dt:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
