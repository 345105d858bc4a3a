"""Engine plumbing for the DeepSeek-V4.1 caches (vLLM 0.32, model runner V1).

Owns nothing itself; re-exports the public pieces:

* ``specs``         record sizes and KV-cache spec builders;
* ``caches``        cache layers (``SWACache``, ``CompressedCache``,
                    ``CompressorRing``) that register by prefix and get bound
                    to engine-allocated storage;
* ``backend``       ``DSV41CacheBackend``, its builder, ``DSV41StepMetadata``
                    / ``DSV41GroupMetadata`` and ``current_step()``;
* ``runner_hooks``  ``install_runner_hooks()`` (replay_start, lookback ids).

See docs/vllm-integration.md for the recipe and the vLLM facts behind it.
"""

from vllm_dsv41.attention.backend import (
    BACKEND_NAME,
    LOOKBACK_DEPTH,
    DSV41CacheBackend,
    DSV41CacheMetadataBuilder,
    DSV41GroupMetadata,
    DSV41StepMetadata,
    current_step,
    layer_metadata,
    register_cache_backend,
)
from vllm_dsv41.attention.caches import (
    CompressedCache,
    CompressorRing,
    DSV41CacheLayer,
    SWACache,
)
from vllm_dsv41.attention.runner_hooks import install_runner_hooks, replay_starts

__all__ = [
    "BACKEND_NAME",
    "LOOKBACK_DEPTH",
    "CompressedCache",
    "CompressorRing",
    "DSV41CacheBackend",
    "DSV41CacheLayer",
    "DSV41CacheMetadataBuilder",
    "DSV41GroupMetadata",
    "DSV41StepMetadata",
    "SWACache",
    "current_step",
    "install_runner_hooks",
    "layer_metadata",
    "register_cache_backend",
    "replay_starts",
]
