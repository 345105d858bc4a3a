"""Engram n-gram hashing: the pure math shared by the reference model and vLLM.

Owns (architecture.md §2.6):

* :func:`build_compressed_token_map` — vocabulary id -> compressed id, where
  tokens whose decoded text normalises alike share one id;
* :func:`hash_multipliers` — the per-layer odd int64 multipliers;
* :func:`engram_layout` — the prime bucket sizes and back-to-back offsets of
  every (layer, n-gram order, head) range of a layer's table;
* :func:`lookback_windows` / :func:`engram_row_ids` — the table rows a token
  reads, vectorised over tokens.

No vLLM import; numpy, torch and the ``tokenizers`` normalisers only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

# Private-use code point that stands in for "the whole token was whitespace"
# while the normaliser strips; it is turned back into one space afterwards.
_SPACE_SENTINEL = "\ue000"
_REPLACEMENT_CHAR = "\ufffd"

# Bases that make Miller-Rabin exact for every n < 3.3e24 (so all of int64).
_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)


# ----------------------------------------------------------------------------
# Token normalisation
# ----------------------------------------------------------------------------
def _engram_normalizer() -> Any:
    """NFKC -> NFD -> drop combining marks -> lowercase -> squeeze whitespace -> strip.

    A token that is nothing but whitespace collapses to a single space and is
    protected from the strip by a sentinel, so it keeps its own id instead of
    falling together with the empty string.
    """
    from tokenizers import Regex, normalizers

    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), _SPACE_SENTINEL),
            normalizers.Strip(),
            normalizers.Replace(_SPACE_SENTINEL, " "),
        ]
    )


def _backend_and_size(tokenizer: Any) -> tuple[Any, int]:
    """The raw ``tokenizers.Tokenizer`` and the number of ids to cover."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # a transformers fast tokenizer
        return backend, len(tokenizer)
    if hasattr(tokenizer, "get_vocab_size") and hasattr(tokenizer, "decode_batch"):
        return tokenizer, tokenizer.get_vocab_size(with_added_tokens=True)
    raise TypeError(f"need a fast (tokenizers-backed) tokenizer, got {type(tokenizer).__name__}")


def normalize_token_text(text: str, normalizer: Any | None = None) -> str:
    """The Engram key of one decoded, non-fragment token text."""
    norm = normalizer if normalizer is not None else _engram_normalizer()
    out = norm.normalize_str(text)
    return out if out else text


def build_compressed_token_map(tokenizer: Any) -> tuple[np.ndarray, int]:
    """Map every vocabulary id to its compressed id.

    Each id (``len(tokenizer)`` of them, added tokens included) is decoded on
    its own with the raw backend (special tokens kept, no clean-up).  A decode
    containing U+FFFD is an incomplete UTF-8 byte fragment and is keyed by its
    raw token string; every other decode is keyed by its normalised text (or
    by the decode itself when normalisation leaves nothing).  Compressed ids
    are handed out in order of first appearance, scanning vocab ids upward.

    Returns ``(map int64 [len(tokenizer)], number of distinct compressed ids)``.
    """
    backend, n = _backend_and_size(tokenizer)
    texts = backend.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
    norm = _engram_normalizer()

    # Normalise each distinct decode once; many vocab entries share text
    # (reserved tokens aside) and the normaliser is the costly step.
    keys_by_text: dict[str, str] = {}
    key_to_cid: dict[str, int] = {}
    out = np.empty(n, dtype=np.int64)
    for tid, text in enumerate(texts):
        if _REPLACEMENT_CHAR in text:
            # Same key space as normalised text (a raw fragment string may
            # coincide with some token's normalised text; they then share).
            key = backend.id_to_token(tid) or ""
        else:
            key = keys_by_text.get(text)
            if key is None:
                key = normalize_token_text(text, norm)
                keys_by_text[text] = key
        cid = key_to_cid.get(key)
        if cid is None:
            cid = len(key_to_cid)
            key_to_cid[key] = cid
        out[tid] = cid
    return out, len(key_to_cid)


# ----------------------------------------------------------------------------
# Hash multipliers
# ----------------------------------------------------------------------------
def hash_multipliers(layer_id: int, max_ngram: int, compressed_vocab: int) -> np.ndarray:
    """Odd int64 multipliers ``[max_ngram]`` of one Engram layer.

    Drawn from ``numpy.random.default_rng(10007 * layer_id)`` below
    ``((2**63 - 1) // compressed_vocab) // 2`` and mapped v -> 2v + 1, so that
    ``compressed_id * multiplier`` never overflows int64.
    """
    if compressed_vocab <= 0:
        raise ValueError(f"compressed_vocab must be positive, got {compressed_vocab}")
    bound = max(1, ((2**63 - 1) // int(compressed_vocab)) // 2)
    rng = np.random.default_rng(10007 * int(layer_id))
    v = rng.integers(0, bound, size=int(max_ngram), dtype=np.int64)
    return (v * 2 + 1).astype(np.int64)


# ----------------------------------------------------------------------------
# Prime bucket layout
# ----------------------------------------------------------------------------
def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin, exact for every 64-bit n."""
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x == 1 or x == n - 1:
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def next_unused_prime(after: int, used: set[int]) -> int:
    """Smallest prime strictly greater than ``after`` that is not in ``used``."""
    c = after + 1
    while c in used or not is_prime(c):
        c += 1
    return c


@dataclass(frozen=True, eq=False)
class EngramLayerLayout:
    """Bucket ranges of one Engram layer's table.

    ``primes[k-1, h]`` is the bucket count of n-gram order n = k+1, head h;
    ``offsets`` has the same shape and gives where each range starts; the
    ranges are back-to-back in (order, head) order and ``rows`` is the total.
    """

    primes: np.ndarray  # int64 [max_ngram-1, n_heads]
    offsets: np.ndarray  # int64 [max_ngram-1, n_heads]
    rows: int
    layer_id: int = -1

    @property
    def n_columns(self) -> int:
        return int(self.primes.size)


def engram_layout(
    engram_layer_ids: Sequence[int], max_ngram: int, n_heads: int, vocab_size: int
) -> list[EngramLayerLayout]:
    """Prime layout of every Engram layer, in the order the layers are listed.

    For each layer, each order n = 2..max_ngram, each head: the next prime
    strictly above a running value that restarts at ``vocab_size - 1`` for
    every (layer, order), skipping any prime already used (in any layer).
    """
    if max_ngram < 2:
        raise ValueError(f"max_ngram must be >= 2, got {max_ngram}")
    used: set[int] = set()
    out = []
    for layer_id in engram_layer_ids:
        primes = np.zeros((max_ngram - 1, n_heads), dtype=np.int64)
        for k in range(max_ngram - 1):
            cur = int(vocab_size) - 1
            for h in range(n_heads):
                cur = next_unused_prime(cur, used)
                used.add(cur)
                primes[k, h] = cur
        flat = primes.reshape(-1)
        offsets = np.concatenate([[0], np.cumsum(flat)[:-1]]).astype(np.int64).reshape(primes.shape)
        out.append(EngramLayerLayout(primes=primes, offsets=offsets, rows=int(flat.sum()),
                                     layer_id=int(layer_id)))
    return out


# ----------------------------------------------------------------------------
# Per-token row ids
# ----------------------------------------------------------------------------
def lookback_windows(token_cids: torch.Tensor, positions: torch.Tensor, max_ngram: int) -> torch.Tensor:
    """``[T, max_ngram]`` windows: column k holds ``token_cids[positions - k]``,
    or -1 where that index falls before 0."""
    cids = torch.as_tensor(token_cids, dtype=torch.long)
    pos = torch.as_tensor(positions, dtype=torch.long).reshape(-1)
    idx = pos[:, None] - torch.arange(max_ngram, dtype=torch.long, device=pos.device)[None, :]
    valid = idx >= 0
    if cids.numel() == 0:
        return torch.full(idx.shape, -1, dtype=torch.long, device=pos.device)
    got = cids[idx.clamp(min=0)]
    return torch.where(valid, got, torch.full_like(got, -1))


def row_id_constants(
    layout: EngramLayerLayout, multipliers: np.ndarray | torch.Tensor | Sequence[int], device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(primes, offsets, multipliers) of one layer as int64 tensors on ``device``: made once per layer and device
    by the model, because a host-to-device copy per step cannot run inside a captured CUDA graph."""
    primes = torch.as_tensor(np.asarray(layout.primes), dtype=torch.long).to(device)
    offsets = torch.as_tensor(np.asarray(layout.offsets), dtype=torch.long).to(device)
    mult = torch.as_tensor(np.asarray(multipliers, dtype=np.int64), dtype=torch.long).to(device)
    return primes, offsets, mult


def engram_row_ids(
    cids: torch.Tensor,
    layout: EngramLayerLayout,
    multipliers: np.ndarray | torch.Tensor | Sequence[int],
    pad_id: int,
) -> torch.Tensor:
    """Table rows read by each token: ``[T, (max_ngram-1) * n_heads]`` int64.

    ``cids[t, k]`` is the compressed id k positions back (k = 0 is the token
    itself); a negative entry marks "no token there" and turns that and every
    longer lookback into ``pad_id``.  With r the running XOR of
    ``c_k * mult[k]``, order k+1 (k >= 1) emits ``r mod P[k-1, h] + off[k-1, h]``
    for each head; columns are order-major, then head.
    """
    c = torch.as_tensor(cids, dtype=torch.long)
    return row_ids_from(c, row_id_constants(layout, multipliers, c.device), pad_id)


def row_ids_from(c: torch.Tensor, consts: tuple[torch.Tensor, torch.Tensor, torch.Tensor], pad_id: int) -> torch.Tensor:
    """:func:`engram_row_ids` with the layer's :func:`row_id_constants` already on ``c``'s device."""
    if c.dim() != 2:
        raise ValueError(f"cids must be [T, max_ngram], got shape {tuple(c.shape)}")
    primes, offsets, mult = consts
    m = c.shape[1]
    if primes.shape[0] != m - 1:
        raise ValueError(f"layout has {primes.shape[0]} orders but cids has {m} lookbacks")
    if mult.numel() < m:
        raise ValueError(f"need {m} multipliers, got {mult.numel()}")
    blocked = torch.cummax((c < 0).to(torch.int8), dim=1).values.bool()
    v = torch.where(blocked, torch.full_like(c, int(pad_id)), c)
    terms = v * mult[:m][None, :]
    n_heads = primes.shape[1]
    out = torch.empty((c.shape[0], (m - 1) * n_heads), dtype=torch.long, device=c.device)
    r = terms[:, 0].clone()
    for k in range(1, m):
        r = torch.bitwise_xor(r, terms[:, k])
        out[:, (k - 1) * n_heads:k * n_heads] = torch.remainder(r[:, None], primes[k - 1][None, :]) \
            + offsets[k - 1][None, :]
    return out


# ----------------------------------------------------------------------------
# Convenience: everything a model needs for one config
# ----------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class EngramHashing:
    """Layouts and multipliers of every Engram layer of a config."""

    layer_ids: tuple[int, ...]
    layouts: tuple[EngramLayerLayout, ...]
    multipliers: tuple[np.ndarray, ...]
    max_ngram: int
    pad_token_id: int
    compressed_vocab: int

    def layout(self, layer_id: int) -> EngramLayerLayout:
        return self.layouts[self.layer_ids.index(layer_id)]

    def mult(self, layer_id: int) -> np.ndarray:
        return self.multipliers[self.layer_ids.index(layer_id)]


def engram_hashing_from_config(cfg: Any) -> EngramHashing | None:
    """Build the layouts/multipliers of a ``DSV41Config`` (None without Engram).

    Raises ``ValueError`` if a layer's prime total differs from the
    ``engram_num_embeddings`` the config declares.
    """
    ids = tuple(int(i) for i in (cfg.engram_layer_ids or ()))
    if not ids:
        return None
    layouts = engram_layout(ids, cfg.engram_max_ngram_size, cfg.engram_n_heads, cfg.engram_vocab_size)
    declared = list(cfg.engram_num_embeddings)
    got = [lay.rows for lay in layouts]
    if declared != got:
        raise ValueError(f"engram_num_embeddings {declared} does not match the prime layout {got}")
    mults = tuple(hash_multipliers(i, cfg.engram_max_ngram_size, cfg.engram_compressed_vocab_size) for i in ids)
    return EngramHashing(layer_ids=ids, layouts=tuple(layouts), multipliers=mults,
                         max_ngram=cfg.engram_max_ngram_size, pad_token_id=cfg.engram_pad_token_id,
                         compressed_vocab=cfg.engram_compressed_vocab_size)


__all__ = [
    "EngramHashing",
    "EngramLayerLayout",
    "build_compressed_token_map",
    "engram_hashing_from_config",
    "engram_layout",
    "engram_row_ids",
    "hash_multipliers",
    "is_prime",
    "lookback_windows",
    "next_unused_prime",
    "normalize_token_text",
]
