"""Named model sizes: the official V4.1-Flash text config and our test/bench cuts.

Owns the three presets of ``tools/make_checkpoint``: ``full`` (the official
dimensions, architecture.md §1.4), ``bench`` (full width, 40 layers, 32 routed
experts, Engram tables cut to ~1M rows) and ``tiny`` (every mechanism, small
enough that a forward runs in milliseconds on CPU).  Values that depend on the
tokenizer (``vocab_size``, ``engram_compressed_vocab_size``) or on the Engram
prime layout (``engram_num_embeddings``) are filled in by the checkpoint writer.
"""

from __future__ import annotations

import copy
from typing import Any

QUANTIZATION_CONFIG: dict[str, Any] = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "weight_block_size": [32, 32],
    "scale_fmt": "ue8m0",
    "expert_dtype": "fp4",
}

FULL: dict[str, Any] = {
    "vocab_size": 129280,
    "hidden_size": 5120,
    "num_hidden_layers": 40,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1280,
    "o_lora_rank": 1024,
    "o_groups": 8,
    "hidden_act": "silu",
    "swiglu_limit": 10.0,
    "rms_norm_eps": 1e-20,
    "attention_bias": False,
    "max_position_embeddings": 1048576,
    "rope_theta": 10000,
    "compress_rope_theta": 160000,
    "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                     "original_max_position_embeddings": 65536},
    "n_routed_experts": 384,
    "n_shared_experts": 1,
    "num_experts_per_tok": 6,
    "moe_intermediate_size": 2304,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "sliding_window": 128,
    "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
    "kv_source_layer_ids": [2, 8, 14, 20],
    "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
    "index_n_heads": 32,
    "index_head_dim": 128,
    "index_topk": 512,
    "candidate_source_layer_id": 20,
    "candidate_topk_blocks": 2048,
    "candidate_block_size": 8,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "engram_layer_ids": [1, 14],
    "engram_num_embeddings": [384006168, 384016682],
    "engram_max_ngram_size": 4,
    "engram_vocab_size": 16000000,
    "engram_n_heads": 8,
    "engram_head_dim": 256,
    "engram_pad_token_id": 2,
    "engram_compressed_vocab_size": 99092,
    "num_nextn_predict_layers": 3,
    "dspark_block_size": 5,
    "dspark_noise_token_id": 128799,
    "dspark_target_layer_ids": [37, 38, 39],
    "dspark_markov_rank": 256,
    "dspark_n_routed_experts": 128,
    "dspark_num_experts_per_tok": 3,
    "tie_word_embeddings": False,
}

# Full width, 40 layers, 32 routed experts; Engram primes start near 41,667 so
# the 24 buckets of a layer add up to ~1M rows.
BENCH: dict[str, Any] = {
    **FULL,
    "n_routed_experts": 32,
    "dspark_n_routed_experts": 32,
    "engram_vocab_size": 41667,
    "engram_num_embeddings": None,
}

# Every mechanism at toy size: three KV sources (two ratio-2, one ratio-1 that is
# also the candidate source), two re-index consumers, Engram before a source (1)
# and on a later source (4), window 16 and top-12 so ~100-token prompts pass both.
TINY: dict[str, Any] = {
    **FULL,
    "vocab_size": None,
    "hidden_size": 64,
    "num_hidden_layers": 12,
    "num_attention_heads": 4,
    "head_dim": 64,
    "qk_rope_head_dim": 16,
    "q_lora_rank": 32,
    "o_lora_rank": 32,
    "o_groups": 2,
    "max_position_embeddings": 4096,
    "rope_scaling": {"rope_type": "yarn", "factor": 4, "beta_fast": 32, "beta_slow": 1,
                     "original_max_position_embeddings": 64},
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "sliding_window": 16,
    "compress_ratios": [0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 0, 0, 0],
    "kv_source_layer_ids": [2, 4, 6],
    "index_source_layer_ids": [2, 4, 6, 8, 10],
    "index_n_heads": 4,
    "index_head_dim": 32,
    "index_topk": 12,
    "candidate_source_layer_id": 6,
    "candidate_topk_blocks": 6,
    "candidate_block_size": 4,
    "engram_layer_ids": [1, 4],
    "engram_num_embeddings": None,
    "engram_max_ngram_size": 3,
    "engram_vocab_size": 1000,
    "engram_n_heads": 2,
    "engram_head_dim": 32,
    "engram_compressed_vocab_size": None,
    "dspark_block_size": 4,
    "dspark_noise_token_id": None,
    "dspark_target_layer_ids": [9, 10, 11],
    "dspark_markov_rank": 16,
    "dspark_n_routed_experts": 4,
    "dspark_num_experts_per_tok": 2,
}

PRESETS = {"tiny": TINY, "bench": BENCH, "full": FULL}


def preset(name: str) -> dict[str, Any]:
    """A fresh copy of a preset's text config."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return copy.deepcopy(PRESETS[name])
