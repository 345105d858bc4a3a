"""Cache-holding layers: one small ``AttentionLayerBase`` per cache kind.

Owns: registering each cache under its prefix in
``compilation_config.static_forward_context`` (that is how the runner finds
it, asks for its spec and binds the tensor the engine allocated), and the
row-level access the model needs: ``write(slots, records)``,
``read(slots)`` and the ``blocks`` view.

Layer names must contain exactly one integer (vLLM's
``extract_layer_index``), e.g. ``model.layers.3.attn.swa_cache``.

Bound tensors (views into the engine's shared pool, never copies):

* ``kv_cache``: ``[num_blocks, 1, rows_per_block, row]`` as allocated;
* ``blocks``:   ``[num_blocks, rows_per_block, row]``; ``row`` is the record
  in bytes (uint8) or ``head_dim`` bf16 values or, for rings, ``2*D`` fp32.

A slot ``s`` (what ``DSV41GroupMetadata.slot_mapping`` holds) is row
``s % rows_per_block`` of block ``s // rows_per_block``; block 0 is vLLM's
null block and is never a real slot.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.kv_cache_interface import KVCacheSpec

from vllm_dsv41.attention import specs
from vllm_dsv41.attention.backend import (
    DSV41CacheBackend,
    DSV41GroupMetadata,
    layer_metadata,
    register_cache_backend,
)


class DSV41CacheLayer(nn.Module, AttentionLayerBase):
    """Base: holds one spec, registers itself, receives its tensor."""

    kind = ""

    def __init__(self, prefix: str, spec: KVCacheSpec):
        super().__init__()
        from vllm_dsv41.attention.runner_hooks import install_runner_hooks

        register_cache_backend()
        install_runner_hooks()
        self.prefix = prefix
        self.spec = spec
        self.kv_cache = torch.tensor([])
        ctx = get_current_vllm_config().compilation_config.static_forward_context
        if prefix in ctx:
            raise ValueError(f"Duplicate layer name: {prefix}")
        ctx[prefix] = self

    # --- AttentionLayerBase -------------------------------------------------
    def get_attn_backend(self) -> type[DSV41CacheBackend]:
        return DSV41CacheBackend

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        del vllm_config
        return self.spec

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache

    def forward(self):  # never called; the model reads/writes rows directly
        raise RuntimeError("cache layers hold storage only")

    # --- access -------------------------------------------------------------
    @property
    def rows_per_block(self) -> int:
        return self.spec.num_states

    @property
    def blocks(self) -> torch.Tensor:
        """``[num_blocks, rows_per_block, row]`` view of the bound cache."""
        if self.kv_cache.dim() != 4:
            raise RuntimeError(f"{self.prefix}: no KV cache bound yet")
        return self.kv_cache.squeeze(1)

    def metadata(self) -> DSV41GroupMetadata | None:
        """This layer's group metadata in the running forward (None in
        profile/dummy runs without attention metadata)."""
        return layer_metadata(self.prefix)

    def write(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Store ``rows[i]`` at ``slots[i]``; slots < 0 are skipped.

        No host sync (the write may run inside a captured CUDA graph): skipped rows are redirected to
        row 0 of the null block 0 (never a real slot) and rewrite the value it already holds."""
        if rows.shape[0] == 0:
            return
        e = self.rows_per_block
        keep = slots >= 0
        slots = torch.where(keep, slots.to(torch.int64), 0)
        old = self.blocks[0, 0]
        keep = keep.view(-1, *([1] * (rows.dim() - 1)))
        self.blocks[slots // e, slots % e] = torch.where(keep, rows.to(self.blocks.dtype), old)

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """Rows at ``slots`` (all must be valid, >= 0)."""
        slots = slots.to(torch.int64)
        e = self.rows_per_block
        return self.blocks[slots // e, slots % e]

    def flat_rows(self) -> tuple[torch.Tensor, int, int]:
        """A 2-D ``[n, row]`` view of the bound cache for the ops, plus the slot map.

        The bound cache is a strided view into the shared pool whose block stride is the packed
        block, not ``rows_per_block * row`` (see vllm-integration.md), so slot ``s`` (row ``s % E``
        of block ``s // E``) is not row ``s`` of a plain 2-D view.  This view steps by
        ``g = gcd(block stride, row stride)`` elements (rows may overlap, each is read or written
        only at its own start): slot ``s`` is its row ``(s // E) * bstep + (s % E) * rstep``
        (:meth:`flat_slots`).  When blocks are dense (``block stride == E * row stride``) the map is
        the identity.  Returns ``(view, bstep, rstep)``.
        """
        kv = self.kv_cache
        if kv.dim() != 4:
            raise RuntimeError(f"{self.prefix}: no KV cache bound yet")
        key = (kv.data_ptr(), tuple(kv.shape), tuple(kv.stride()))
        cached = getattr(self, "_flat", None)
        if cached is not None and cached[0] == key:
            return cached[1]
        nb, _, e, row = kv.shape
        sb, _, sr, sc = kv.stride()
        if sc != 1:
            raise RuntimeError(f"{self.prefix}: cache rows must be contiguous")
        g = math.gcd(sb, sr) if nb > 1 else sr
        bstep, rstep = sb // g, sr // g
        n = (nb - 1) * bstep + (e - 1) * rstep + 1
        flat = kv.as_strided((n, row), (g, 1), kv.storage_offset())
        self._flat = (key, (flat, bstep, rstep))
        return self._flat[1]

    def flat_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """Engine slots (-1 = none) -> rows of :meth:`flat_rows` (-1 kept), int64."""
        _, bstep, rstep = self.flat_rows()
        e = self.rows_per_block
        slots = slots.to(torch.int64)
        if bstep == e * rstep and rstep == 1:
            return slots
        # (s // e) * bstep + (s % e) * rstep in three launches: rstep * s + (bstep - e * rstep) * (s // e).  A
        # block spans at least its e rows (bstep >= e * rstep), so slot -1 lands at (e - 1) * rstep - bstep
        # <= -rstep, and clamping at -1 keeps "none" as -1.
        return torch.add(slots * rstep, slots // e, alpha=bstep - e * rstep).clamp_(min=-1)

    def extra_repr(self) -> str:
        return f"prefix={self.prefix!r}, spec={type(self.spec).__name__}"


class SWACache(DSV41CacheLayer):
    """One layer's sliding-window KV.

    ``bounded_replay`` defaults to ``cache_config.swa_bounded_replay`` (vLLM's
    own switch, default on): the cache stays out of prefix caching and the
    scheduler replays the last ``window`` tokens of a prefix hit.  Off, the
    SWA group is prefix-cached like the compressed ones (and hits must then
    also align to 32-token SWA blocks).
    """

    kind = "swa"

    def __init__(
        self,
        prefix: str,
        head_dim: int,
        window: int,
        *,
        fmt: str = "packed",
        bounded_replay: bool | None = None,
        block_size: int = specs.SWA_BLOCK_SIZE,
    ):
        if bounded_replay is None:
            cache_config = get_current_vllm_config().cache_config
            bounded_replay = bool(getattr(cache_config, "swa_bounded_replay", True))
        super().__init__(
            prefix,
            specs.make_swa_spec(
                head_dim,
                window,
                fmt=fmt,
                bounded_replay=bounded_replay,
                block_size=block_size,
            ),
        )
        self.window = window


class CompressedCache(DSV41CacheLayer):
    """A KV source's compressed global KV, or (``index=True``) its index K."""

    kind = "compressed"

    def __init__(
        self,
        prefix: str,
        head_dim: int,
        ratio: int,
        block_size: int,
        *,
        fmt: str = "packed",
        index: bool = False,
    ):
        make = specs.make_index_spec if index else specs.make_compressed_spec
        super().__init__(prefix, make(head_dim, ratio, block_size, fmt=fmt))
        self.ratio = ratio


class CompressorRing(DSV41CacheLayer):
    """A ratio-2 source's compressor ring: row p % capacity of the
    request's single ring block holds position p's [kv | score]."""

    kind = "ring"

    def __init__(
        self, prefix: str, head_dim: int, capacity: int = specs.RING_CAPACITY
    ):
        super().__init__(prefix, specs.make_ring_spec(head_dim, capacity))
        self.capacity = capacity
