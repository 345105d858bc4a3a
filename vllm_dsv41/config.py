"""Parse and validate a DeepSeek-V4.1 ``config.json``; derive every layer's role.

Owns: :class:`DSV41Config` (the flat text config plus the quantisation facts the
model needs) and :class:`LayerPlan` (one frozen record per backbone and draft
layer).  Every role — KV source, index source, candidate source/consumer,
which compressed cache a layer reads, Engram layers, the encoder/decoder
boundary, the DSpark target layers — is derived here from the config alone
(architecture.md §1.3, §3.1).  Nothing else in the package hard-codes a layer
number, window or top-k.

A bad config fails with :class:`ConfigError`, whose message names the key.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping


class ConfigError(ValueError):
    """A config.json value is missing, of the wrong type or inconsistent."""


@dataclass(frozen=True)
class RopeParams:
    """RoPE of one layer: base and (optional) YaRN frequency interpolation."""

    theta: float
    yarn_factor: float = 1.0
    original_max_position: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class LayerPlan:
    """What one layer is, derived from the config (architecture.md §1.3)."""

    layer_id: int
    compress_ratio: int  # 0 = SWA only, 1 or 2 = reads compressed KV
    is_draft: bool
    kv_source: int | None  # layer whose compressed KV / index K this layer reads
    index_source: int | None  # layer whose top-k this layer uses
    owns_compressor: bool  # layer is a KV source (compressor + caches)
    owns_indexer: bool  # layer runs an indexer (top-k selection)
    is_candidate_source: bool
    is_candidate_consumer: bool
    has_engram: bool
    is_decoder: bool  # after the encoder/decoder boundary (prunable in prefill)
    n_routed_experts: int
    experts_per_tok: int
    rope: RopeParams

    @property
    def is_kv_source(self) -> bool:
        return self.owns_compressor

    @property
    def reindexes(self) -> bool:
        """An indexer that reads another layer's index K (no own wk/k_norm)."""
        return self.owns_indexer and not self.owns_compressor


# Keys every text config must carry, with their Python types.
_REQUIRED: dict[str, type | tuple[type, ...]] = {
    "vocab_size": int,
    "hidden_size": int,
    "num_hidden_layers": int,
    "num_attention_heads": int,
    "head_dim": int,
    "qk_rope_head_dim": int,
    "q_lora_rank": int,
    "o_lora_rank": int,
    "o_groups": int,
    "sliding_window": int,
    "rms_norm_eps": (int, float),
    "rope_theta": (int, float),
    "compress_rope_theta": (int, float),
    "n_routed_experts": int,
    "num_experts_per_tok": int,
    "n_shared_experts": int,
    "moe_intermediate_size": int,
    "routed_scaling_factor": (int, float),
    "swiglu_limit": (int, float),
    "compress_ratios": list,
    "kv_source_layer_ids": list,
    "index_source_layer_ids": list,
    "candidate_source_layer_id": int,
    "candidate_topk_blocks": int,
    "candidate_block_size": int,
    "index_topk": int,
    "index_n_heads": int,
    "index_head_dim": int,
    "hc_mult": int,
    "hc_sinkhorn_iters": int,
    "hc_eps": (int, float),
}

# Optional keys and their defaults.
_OPTIONAL: dict[str, Any] = {
    "num_key_value_heads": 1,
    "max_position_embeddings": 1048576,
    "rope_scaling": None,
    "hidden_act": "silu",
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "engram_layer_ids": [],
    "engram_num_embeddings": [],
    "engram_max_ngram_size": 4,
    "engram_vocab_size": 16000000,
    "engram_n_heads": 8,
    "engram_head_dim": 256,
    "engram_pad_token_id": 2,
    "engram_compressed_vocab_size": 0,
    "num_nextn_predict_layers": 0,
    "dspark_block_size": 5,
    "dspark_noise_token_id": 0,
    "dspark_target_layer_ids": [],
    "dspark_markov_rank": 256,
    "dspark_n_routed_experts": None,
    "dspark_num_experts_per_tok": None,
}


@dataclass(frozen=True)
class DSV41Config:
    """The flat V4.1 text config, validated, plus the per-layer plan."""

    raw: Mapping[str, Any] = field(repr=False)  # the flat text config as read
    quant: Mapping[str, Any] = field(repr=False)  # quantization_config ({} if bf16)
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int = 2

    def __getattr__(self, name: str) -> Any:  # flat access to config keys
        raw = object.__getattribute__(self, "raw")
        if name in raw:
            return raw[name]
        raise AttributeError(name)

    # -- derived values ------------------------------------------------------
    @property
    def n_layers(self) -> int:
        return self.raw["num_hidden_layers"]

    @property
    def n_draft_layers(self) -> int:
        return self.raw["num_nextn_predict_layers"]

    @property
    def nope_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.o_groups

    @property
    def boundary_layer(self) -> int:
        """Last encoder layer: the newest KV source (architecture.md §3.1)."""
        return max(self.kv_source_layer_ids)

    @property
    def decoder_prunable(self) -> bool:
        """Decoder-side pruning is valid only in the layouts of §3.4."""
        b = self.boundary_layer
        return (
            b < self.n_layers - 1
            and self.compress_ratios[b] <= 1
            and all(e < b for e in self.engram_layer_ids)
        )

    @property
    def topk_fill_context(self) -> int:
        """Context from which every row's compressed top-k list is full: the largest compression ratio x
        ``index_topk`` (below it, the lists end in -1; ``sparse_attn``'s ``skip_empty`` hint uses it)."""
        return max(self.compress_ratios[:self.n_layers], default=0) * self.index_topk

    @property
    def fp8_block(self) -> int:
        wbs = self.quant.get("weight_block_size") or [32, 32]
        return int(wbs[0])

    @property
    def experts_fp4(self) -> bool:
        return self.quant.get("expert_dtype") == "fp4"

    @property
    def quantized(self) -> bool:
        return bool(self.quant)

    @property
    def engram_n_columns(self) -> int:
        """Hash columns per Engram layer: (max_ngram - 1) orders x heads."""
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    def plan(self, layer_id: int) -> LayerPlan:
        return self.plans[layer_id]

    @property
    def plans(self) -> tuple[LayerPlan, ...]:
        cached = self.__dict__.get("_plans")
        if cached is None:
            cached = _derive_plans(self)
            object.__setattr__(self, "_plans", cached)
        return cached

    def to_text_dict(self) -> dict[str, Any]:
        return dict(self.raw)


def _rope_for(cfg: Mapping[str, Any], ratio: int) -> RopeParams:
    if ratio == 0:
        return RopeParams(theta=float(cfg["rope_theta"]))
    rs = cfg.get("rope_scaling") or {}
    if "compress" in rs:  # nested {"main":..,"compress":..} form
        rs = rs["compress"]
    factor = float(rs.get("factor", 1.0)) if rs else 1.0
    if rs and rs.get("rope_type", "yarn") not in ("yarn", "deepseek_yarn"):
        raise ConfigError(f"rope_scaling.rope_type={rs.get('rope_type')!r}: only 'yarn' is supported")
    return RopeParams(
        theta=float(cfg["compress_rope_theta"]),
        yarn_factor=factor,
        original_max_position=int(rs.get("original_max_position_embeddings", 0)) if rs else 0,
        beta_fast=float(rs.get("beta_fast", 32)) if rs else 32.0,
        beta_slow=float(rs.get("beta_slow", 1)) if rs else 1.0,
    )


def _latest_at_or_below(ids: list[int], layer: int) -> int | None:
    below = [i for i in ids if i <= layer]
    return max(below) if below else None


def _derive_plans(c: DSV41Config) -> tuple[LayerPlan, ...]:
    raw = c.raw
    n, nd = c.n_layers, c.n_draft_layers
    kv_src = sorted(raw["kv_source_layer_ids"])
    idx_src = sorted(raw["index_source_layer_ids"])
    cand = raw["candidate_source_layer_id"]
    boundary = max(kv_src)
    plans = []
    for L in range(n + nd):
        draft = L >= n
        ratio = raw["compress_ratios"][L] if L < len(raw["compress_ratios"]) else 0
        if ratio > 0:
            kv = _latest_at_or_below(kv_src, L)
            ix = _latest_at_or_below(idx_src, L)
        else:
            kv = ix = None
        n_exp = raw["n_routed_experts"]
        k_exp = raw["num_experts_per_tok"]
        if draft:
            n_exp = raw.get("dspark_n_routed_experts") or n_exp
            k_exp = raw.get("dspark_num_experts_per_tok") or k_exp
        plans.append(
            LayerPlan(
                layer_id=L,
                compress_ratio=ratio,
                is_draft=draft,
                kv_source=kv,
                index_source=ix,
                owns_compressor=L in kv_src,
                owns_indexer=L in idx_src,
                is_candidate_source=L == cand,
                is_candidate_consumer=(L in idx_src and L > cand),
                has_engram=L in raw["engram_layer_ids"],
                is_decoder=(not draft) and L > boundary,
                n_routed_experts=n_exp,
                experts_per_tok=k_exp,
                rope=_rope_for(raw, ratio),
            )
        )
    return tuple(plans)


def _check(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"config key {key!r}: {msg}")


def _validate(t: dict[str, Any]) -> None:
    for key, typ in _REQUIRED.items():
        _check(key in t, key, "missing")
        v = t[key]
        _check(isinstance(v, typ) and not (typ is int and isinstance(v, bool)), key,
               f"expected {typ if isinstance(typ, type) else ' or '.join(x.__name__ for x in typ)}, got {v!r}")
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                "q_lora_rank", "o_lora_rank", "o_groups", "sliding_window", "n_routed_experts",
                "num_experts_per_tok", "moe_intermediate_size", "index_topk", "index_n_heads",
                "index_head_dim", "hc_mult", "hc_sinkhorn_iters", "candidate_topk_blocks",
                "candidate_block_size"):
        _check(t[key] > 0, key, f"must be positive, got {t[key]!r}")
    n, nd = t["num_hidden_layers"], t["num_nextn_predict_layers"]
    _check(isinstance(nd, int) and nd >= 0, "num_nextn_predict_layers", f"must be >= 0, got {nd!r}")
    rope = t["qk_rope_head_dim"]
    _check(0 < rope <= t["head_dim"] and rope % 2 == 0, "qk_rope_head_dim",
           f"must be even and in (0, head_dim={t['head_dim']}], got {rope}")
    _check(rope <= t["index_head_dim"], "qk_rope_head_dim", f"must be <= index_head_dim={t['index_head_dim']}")
    _check(t["num_attention_heads"] % t["o_groups"] == 0, "o_groups",
           f"must divide num_attention_heads={t['num_attention_heads']}, got {t['o_groups']}")
    _check(t["num_experts_per_tok"] <= t["n_routed_experts"], "num_experts_per_tok",
           f"{t['num_experts_per_tok']} exceeds n_routed_experts={t['n_routed_experts']}")
    _check(t["hidden_act"] == "silu", "hidden_act", f"only 'silu' is supported, got {t['hidden_act']!r}")
    _check(t["scoring_func"] == "sqrtsoftplus", "scoring_func",
           f"only 'sqrtsoftplus' is supported, got {t['scoring_func']!r}")
    _check(t["norm_topk_prob"] is True, "norm_topk_prob", "V4.1 routing requires true")
    ratios = t["compress_ratios"]
    _check(len(ratios) >= n, "compress_ratios", f"has {len(ratios)} entries, needs at least num_hidden_layers={n}")
    for i, r in enumerate(ratios):
        _check(r in (0, 1, 2), "compress_ratios", f"entry {i} is {r!r}; only 0, 1, 2 are supported")
    for i in range(n, min(len(ratios), n + nd)):
        _check(ratios[i] == 0, "compress_ratios", f"draft layer {i} must be SWA-only (0), got {ratios[i]}")
    kv, ix = t["kv_source_layer_ids"], t["index_source_layer_ids"]
    _check(len(kv) > 0, "kv_source_layer_ids", "must not be empty")
    for key, ids in (("kv_source_layer_ids", kv), ("index_source_layer_ids", ix),
                     ("engram_layer_ids", t["engram_layer_ids"])):
        _check(all(isinstance(i, int) and 0 <= i < n for i in ids), key,
               f"every id must be a backbone layer in [0, {n}), got {ids}")
        _check(len(set(ids)) == len(ids), key, f"duplicate ids in {ids}")
    for L in kv:
        _check(ratios[L] > 0, "kv_source_layer_ids", f"layer {L} has compress_ratios[{L}]=0")
        _check(L in ix, "index_source_layer_ids", f"KV source layer {L} must also be an index source")
    for L in ix:
        _check(ratios[L] > 0, "index_source_layer_ids", f"layer {L} has compress_ratios[{L}]=0")
    for L in range(n):
        if ratios[L] > 0:
            src = _latest_at_or_below(kv, L)
            _check(src is not None, "kv_source_layer_ids",
                   f"layer {L} has ratio {ratios[L]} but no KV source at or below it")
            _check(ratios[src] == ratios[L], "compress_ratios",
                   f"layer {L} (ratio {ratios[L]}) reads KV source {src} of ratio {ratios[src]}")
            _check(_latest_at_or_below(ix, L) is not None, "index_source_layer_ids",
                   f"layer {L} has ratio {ratios[L]} but no index source at or below it")
    cand = t["candidate_source_layer_id"]
    _check(cand in kv, "candidate_source_layer_id", f"{cand} must be a KV source ({kv})")
    _check(t["candidate_topk_blocks"] * t["candidate_block_size"] >= t["index_topk"], "candidate_topk_blocks",
           f"candidate budget {t['candidate_topk_blocks']}x{t['candidate_block_size']} is below "
           f"index_topk={t['index_topk']}")
    eng = t["engram_layer_ids"]
    if eng:
        nemb = t["engram_num_embeddings"]
        _check(isinstance(nemb, list) and len(nemb) == len(eng), "engram_num_embeddings",
               f"needs one entry per Engram layer ({len(eng)}), got {nemb!r}")
        _check(t["engram_max_ngram_size"] >= 2, "engram_max_ngram_size", "must be >= 2")
        _check(t["engram_compressed_vocab_size"] > 0, "engram_compressed_vocab_size",
               "must be positive when engram_layer_ids is set")
        _check(t["engram_head_dim"] % 32 == 0, "engram_head_dim", "must be a multiple of 32 (E8M0 per 32)")
    if nd:
        tgt = t["dspark_target_layer_ids"]
        _check(isinstance(tgt, list) and len(tgt) > 0 and all(isinstance(i, int) and 0 <= i < n for i in tgt),
               "dspark_target_layer_ids", f"must list backbone layers in [0, {n}), got {tgt!r}")
        _check(t["dspark_block_size"] >= 1, "dspark_block_size", "must be >= 1")
        _check(0 <= t["dspark_noise_token_id"] < t["vocab_size"], "dspark_noise_token_id",
               f"{t['dspark_noise_token_id']} outside the vocabulary ({t['vocab_size']})")
    _check(t["sliding_window"] > 1, "sliding_window", "must be > 1")


def _validate_quant(q: Mapping[str, Any], t: Mapping[str, Any]) -> None:
    if not q:
        return
    qm = q.get("quant_method")
    _check(qm in ("fp8", "deepseek_v4_fp8"), "quantization_config.quant_method",
           f"only 'fp8' is supported, got {qm!r}")
    wbs = q.get("weight_block_size", [32, 32])
    _check(isinstance(wbs, list) and len(wbs) == 2 and wbs[0] == wbs[1] == 32,
           "quantization_config.weight_block_size", f"only [32, 32] is supported, got {wbs!r}")
    _check(q.get("scale_fmt", "ue8m0") == "ue8m0", "quantization_config.scale_fmt",
           f"only 'ue8m0' is supported, got {q.get('scale_fmt')!r}")
    _check(q.get("expert_dtype", "fp4") in ("fp4",), "quantization_config.expert_dtype",
           f"only 'fp4' is supported, got {q.get('expert_dtype')!r}")
    for key in ("hidden_size", "q_lora_rank", "o_lora_rank", "head_dim", "moe_intermediate_size",
                "index_head_dim"):
        _check(t[key] % 32 == 0, key, f"must be a multiple of the 32x32 FP8 tile, got {t[key]}")


def parse_config(obj: Mapping[str, Any]) -> DSV41Config:
    """Build a validated config from a config.json dict (nested or flat)."""
    obj = dict(obj)
    text = dict(obj.get("text_config") or {})
    if not text:  # flat form (e.g. already flattened)
        text = {k: v for k, v in obj.items() if k not in ("quantization_config", "vision_config")}
    text.pop("model_type", None)
    for k, v in _OPTIONAL.items():
        text.setdefault(k, v if not isinstance(v, list) else list(v))
    _validate(text)
    quant = dict(obj.get("quantization_config") or {})
    _validate_quant(quant, text)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = obj.get(key, text.get(key, {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}[key]))
        if isinstance(v, list):
            v = v[0]
        _check(isinstance(v, int) and 0 <= v < text["vocab_size"], key, f"{v!r} outside the vocabulary")
    return DSV41Config(
        raw=text,
        quant=quant,
        bos_token_id=obj.get("bos_token_id", 0),
        eos_token_id=obj.get("eos_token_id", 1) if not isinstance(obj.get("eos_token_id"), list) else obj["eos_token_id"][0],
        pad_token_id=obj.get("pad_token_id", 2),
    )


def load_config(path: str | os.PathLike) -> DSV41Config:
    """Read ``config.json`` from a checkpoint directory (or the file itself)."""
    p = os.fspath(path)
    if os.path.isdir(p):
        p = os.path.join(p, "config.json")
    try:
        with open(p) as f:
            obj = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"no config.json at {p}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p} is not valid JSON: {e}") from None
    return parse_config(obj)


def from_hf_config(hf_config: Any) -> DSV41Config:
    """Build from vLLM's (flattened) ``DeepseekV41Config`` object."""
    d = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(vars(hf_config))
    flat = {k: v for k, v in d.items() if k in _REQUIRED or k in _OPTIONAL}
    rs = d.get("rope_parameters") or d.get("rope_scaling")
    if isinstance(rs, dict) and rs.get("rope_type", "default") != "default":
        flat["rope_scaling"] = rs
    obj = {"text_config": flat, "quantization_config": d.get("quantization_config") or {}}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if d.get(key) is not None:
            obj[key] = d[key]
    return parse_config(obj)


def replace_text(cfg: DSV41Config, **changes: Any) -> DSV41Config:
    """A copy of ``cfg`` with text-config keys changed, re-validated."""
    text = dict(cfg.raw)
    text.update(changes)
    return parse_config({"text_config": text, "quantization_config": dict(cfg.quant),
                         "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
                         "pad_token_id": cfg.pad_token_id})


__all__ = ["ConfigError", "DSV41Config", "LayerPlan", "RopeParams", "load_config", "parse_config",
           "from_hf_config", "replace_text"]
