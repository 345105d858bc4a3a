"""KV-cache spec builders for the four cache kinds of DeepSeek-V4.1.

Owns: record sizes (bytes per cached entry) and the vLLM 0.32 ``KVCacheSpec``
objects that describe each cache to the engine.  Everything here is a pure
function of a few integers; nothing touches the engine or allocates memory.

The four kinds and the vLLM spec type each one maps to:

* ``swa``        ``SlidingWindowMLASpec``: one token per row, 32-token blocks,
                 bounded replay (not prefix-cacheable, ``prefix_replay_tokens``
                 = window).
* ``compressed`` ``MLAAttentionSpec`` with ``tokens_per_state = ratio``: one row
                 per ``ratio`` tokens, prefix-cacheable.  Used for both the
                 compressed global KV and the index-K cache.
* ``ring``       ``CircularBufferSpec``: exactly one block per request of
                 ``capacity`` fp32 rows, never prefix-cached.

Records are stored as raw bytes (``torch.uint8``), one record per row.  The
``bf16`` debug format stores ``head_dim`` bfloat16 values per row instead.
"""

from __future__ import annotations

import torch
from vllm.v1.kv_cache_interface import (
    CircularBufferSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
)

#: Tokens per block of every sliding-window cache (what V4.1 kernels expect).
SWA_BLOCK_SIZE = 32
#: Rows of the per-request compressor ring (>= ratio + speculative lookahead).
RING_CAPACITY = 8
#: Tokens per block of the compressed-KV / index-K groups (a multiple of every ratio and of 32).
COMPRESSED_BLOCK_SIZE = 64

RECORD_FORMATS = ("packed", "bf16")


def swa_record_bytes(head_dim: int, fmt: str = "packed") -> int:
    """MXFP8 sliding-window record: D E4M3 bytes + one UE8M0 scale per 32."""
    _check_format(fmt)
    if fmt == "bf16":
        return 2 * head_dim
    assert head_dim % 32 == 0, head_dim
    return head_dim + head_dim // 32


def compressed_record_bytes(head_dim: int, fmt: str = "packed") -> int:
    """NVFP4 compressed-KV record: D/2 bytes of E2M1 pairs + one E4M3 per 16."""
    _check_format(fmt)
    if fmt == "bf16":
        return 2 * head_dim
    assert head_dim % 16 == 0, head_dim
    return head_dim // 2 + head_dim // 16


def index_record_bytes(index_head_dim: int, fmt: str = "packed") -> int:
    """MXFP4 index-K record: D_I/2 bytes of E2M1 pairs + one UE8M0 per 32."""
    _check_format(fmt)
    if fmt == "bf16":
        return 2 * index_head_dim
    assert index_head_dim % 32 == 0, index_head_dim
    return index_head_dim // 2 + index_head_dim // 32


def ring_row_floats(head_dim: int) -> int:
    """A compressor ring row holds [kv | score], both ``head_dim`` fp32."""
    return 2 * head_dim


def make_swa_spec(
    head_dim: int,
    window: int,
    *,
    fmt: str = "packed",
    record_bytes: int | None = None,
    block_size: int = SWA_BLOCK_SIZE,
    bounded_replay: bool = True,
    alignment: int | None = None,
) -> SlidingWindowMLASpec:
    """Spec of one layer's sliding-window ring.

    With ``bounded_replay`` the group is kept out of prefix caching and the
    scheduler rewinds ``window`` tokens after a prefix hit
    (``SlidingWindowMLASpec.prefix_replay_tokens``).
    """
    dtype, content = _record_layout(
        fmt, head_dim, record_bytes or swa_record_bytes(head_dim, fmt)
    )
    return SlidingWindowMLASpec(
        block_size=block_size,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=head_dim,
        dtype=dtype,
        state_content_bytes=content,
        sliding_window=window,
        bounded_replay=bounded_replay,
        alignment=alignment,
    )


def make_compressed_spec(
    head_dim: int,
    ratio: int,
    block_size: int,
    *,
    fmt: str = "packed",
    record_bytes: int | None = None,
    alignment: int | None = None,
) -> MLAAttentionSpec:
    """Spec of a compressed cache holding one row per ``ratio`` tokens.

    ``block_size`` counts original tokens; a block has ``block_size // ratio``
    rows.  Pass ``record_bytes`` for the index-K cache
    (``index_record_bytes``); the default is the compressed-KV record.
    """
    if block_size % ratio:
        raise ValueError(f"block_size {block_size} is not a multiple of {ratio}")
    dtype, content = _record_layout(
        fmt, head_dim, record_bytes or compressed_record_bytes(head_dim, fmt)
    )
    return MLAAttentionSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=head_dim,
        dtype=dtype,
        state_content_bytes=content,
        tokens_per_state=ratio,
        alignment=alignment,
    )


def make_index_spec(
    index_head_dim: int,
    ratio: int,
    block_size: int,
    *,
    fmt: str = "packed",
    alignment: int | None = None,
) -> MLAAttentionSpec:
    """Spec of an index-K cache (same kind as the compressed KV)."""
    return make_compressed_spec(
        index_head_dim,
        ratio,
        block_size,
        fmt=fmt,
        record_bytes=index_record_bytes(index_head_dim, fmt),
        alignment=alignment,
    )


def make_ring_spec(head_dim: int, capacity: int = RING_CAPACITY) -> CircularBufferSpec:
    """Spec of a ratio-2 source's compressor ring: one block per request,
    ``capacity`` rows of ``2 * head_dim`` fp32."""
    return CircularBufferSpec(
        block_size=capacity,
        num_kv_heads=1,
        head_size=ring_row_floats(head_dim),
        head_size_v=0,
        dtype=torch.float32,
    )


def _check_format(fmt: str) -> None:
    if fmt not in RECORD_FORMATS:
        raise ValueError(f"record format must be one of {RECORD_FORMATS}, got {fmt}")


def _record_layout(
    fmt: str, head_dim: int, record_bytes: int
) -> tuple[torch.dtype, int | None]:
    """(dtype, state_content_bytes) of a spec; bf16 rows use the natural size."""
    _check_format(fmt)
    if fmt == "bf16":
        if record_bytes % 2:
            raise ValueError(f"bf16 records need an even byte count: {record_bytes}")
        return torch.bfloat16, record_bytes
    return torch.uint8, record_bytes


def model_cache_specs(cfg, *, bounded_replay: bool = True, fmt: str = "packed",
                      include_draft: bool = False, prefix: str = "model.") -> dict:
    """Every cache the V4.1 model declares, by layer name -> spec (what the engine allocates).

    ``cfg`` is a ``DSV41Config``; the names are the ones the model registers.
    """
    out = {}
    n = cfg.n_layers + (cfg.n_draft_layers if include_draft else 0)
    for plan in cfg.plans[:n]:
        a = f"{prefix}layers.{plan.layer_id}.attn"
        out[f"{a}.swa_cache"] = make_swa_spec(cfg.head_dim, cfg.sliding_window, fmt=fmt,
                                              bounded_replay=bounded_replay)
        if plan.owns_compressor:
            r = plan.compress_ratio
            out[f"{a}.comp_cache"] = make_compressed_spec(cfg.head_dim, r, COMPRESSED_BLOCK_SIZE, fmt=fmt)
            out[f"{a}.indexer.k_cache"] = make_index_spec(cfg.index_head_dim, r, COMPRESSED_BLOCK_SIZE, fmt=fmt)
            if r == 2:
                out[f"{a}.compressor.state_cache"] = make_ring_spec(cfg.head_dim)
    return out


def kv_bytes(specs: dict) -> dict:
    """Allocated bytes: global (prefix-cacheable) per token, and the bounded per-request SWA/ring state."""
    glob = swa = ring = 0.0
    for spec in specs.values():
        if isinstance(spec, CircularBufferSpec):
            ring += spec.page_size_bytes  # one block per request
        elif isinstance(spec, SlidingWindowMLASpec):
            # a decode step needs the window's last W-1 positions + the new one: at most this many blocks
            blocks = -(-(spec.sliding_window - 1) // spec.block_size) + 1
            swa += blocks * spec.page_size_bytes
        else:
            glob += spec.page_size_bytes / spec.block_size
    return {"global_bytes_per_token": glob, "swa_bytes_per_request": swa, "ring_bytes_per_request": ring}
