"""Engram hashing math (vllm_dsv41/engram.py, architecture.md §2.6)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_dsv41 import presets
from vllm_dsv41.engram import (
    build_compressed_token_map,
    engram_layout,
    engram_row_ids,
    hash_multipliers,
    is_prime,
    lookback_windows,
    next_unused_prime,
)


# ----------------------------------------------------------------------------
# Prime layout
# ----------------------------------------------------------------------------
def test_is_prime_small_and_large():
    small = [n for n in range(60) if is_prime(n)]
    assert small == [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59]
    assert is_prime(16000057) and not is_prime(16000057 * 3)
    assert is_prime(2**61 - 1) and not is_prime(2**61 + 1)
    assert is_prime(18446744073709551557)  # largest prime below 2**64
    assert not is_prime(3215031751)  # strong pseudoprime to bases 2, 3, 5, 7


def test_next_unused_prime_skips_used():
    assert next_unused_prime(9, set()) == 11
    assert next_unused_prime(9, {11, 13}) == 17
    assert next_unused_prime(11, set()) == 13  # strictly above


def test_small_layout_by_hand():
    lay = engram_layout([3, 5], max_ngram=3, n_heads=2, vocab_size=10)
    # layer 3: order 2 -> 11, 13; order 3 restarts at 9, skips 11, 13 -> 17, 19
    assert lay[0].primes.tolist() == [[11, 13], [17, 19]]
    assert lay[0].offsets.tolist() == [[0, 11], [24, 41]]
    assert lay[0].rows == 60
    # layer 5 continues to skip everything used before: 23, 29 | 31, 37
    assert lay[1].primes.tolist() == [[23, 29], [31, 37]]
    assert lay[1].offsets.tolist() == [[0, 23], [52, 83]]
    assert lay[1].rows == 120
    assert lay[0].primes.dtype == np.int64 and lay[0].offsets.dtype == np.int64


def test_full_layout_rows():
    f = presets.FULL
    lay = engram_layout(f["engram_layer_ids"], f["engram_max_ngram_size"], f["engram_n_heads"],
                        f["engram_vocab_size"])
    assert [x.rows for x in lay] == [384006168, 384016682]
    assert [x.rows for x in lay] == f["engram_num_embeddings"]
    allp = np.concatenate([x.primes.reshape(-1) for x in lay]).tolist()
    assert len(allp) == 48 and len(set(allp)) == 48
    assert all(p > 16000000 - 1 and is_prime(p) for p in allp)
    for x in lay:
        flat_p, flat_o = x.primes.reshape(-1), x.offsets.reshape(-1)
        assert flat_o[0] == 0 and (flat_o[1:] == np.cumsum(flat_p)[:-1]).all()
        assert x.offsets.shape == (3, 8)


def test_bench_layout_rows_about_one_million():
    b = presets.BENCH
    lay = engram_layout(b["engram_layer_ids"], b["engram_max_ngram_size"], b["engram_n_heads"],
                        b["engram_vocab_size"])
    assert all(0.95e6 < x.rows < 1.05e6 for x in lay)


# ----------------------------------------------------------------------------
# Multipliers
# ----------------------------------------------------------------------------
def test_hash_multipliers_deterministic_odd_bounded():
    a = hash_multipliers(14, 4, 99092)
    b = hash_multipliers(14, 4, 99092)
    assert a.dtype == np.int64 and a.shape == (4,)
    assert (a == b).all()
    assert (a % 2 == 1).all()
    bound = ((2**63 - 1) // 99092) // 2
    assert (a >= 1).all() and (a <= 2 * (bound - 1) + 1).all()
    assert not (hash_multipliers(1, 4, 99092) == a).all()
    # the recipe itself
    v = np.random.default_rng(10007 * 14).integers(0, bound, size=4, dtype=np.int64)
    assert (a == 2 * v + 1).all()


# ----------------------------------------------------------------------------
# Row ids
# ----------------------------------------------------------------------------
def _py_rows(window, primes, offsets, mult, pad):
    """Plain-int reference of one position's row ids."""
    r, blocked, out = 0, False, []
    for k, c in enumerate(window):
        blocked = blocked or c < 0
        v = pad if blocked else c
        r ^= v * mult[k]
        if k >= 1:
            for h in range(len(primes[k - 1])):
                out.append(r % primes[k - 1][h] + offsets[k - 1][h])
    return out


def test_row_ids_hand_computed():
    lay = engram_layout([3], max_ngram=3, n_heads=2, vocab_size=10)[0]
    mult = np.array([3, 5, 7], dtype=np.int64)
    pad = 5
    token_cids = torch.tensor([4, 1, 2, 6])
    win = lookback_windows(token_cids, torch.arange(4), 3)
    assert win.tolist() == [[4, -1, -1], [1, 4, -1], [2, 1, 4], [6, 2, 1]]
    rows = engram_row_ids(win, lay, mult, pad)
    assert rows.dtype == torch.long and rows.shape == (4, 4)
    # position 2: c = (2, 1, 4): r = 2*3 = 6; r ^= 1*5 -> 3; 3%11+0 = 3, 3%13+11 = 14;
    #             r ^= 4*7 -> 31; 31%17+24 = 38, 31%19+41 = 53
    assert rows[2].tolist() == [3, 14, 38, 53]
    # position 0: c = (4, pad, pad): r = 12; r ^= 25 -> 21; 21%11 = 10, 21%13+11 = 19;
    #             r ^= 35 -> 54; 54%17+24 = 27, 54%19+41 = 57
    assert rows[0].tolist() == [10, 19, 27, 57]
    for t in range(4):
        assert rows[t].tolist() == _py_rows(win[t].tolist(), lay.primes.tolist(), lay.offsets.tolist(),
                                            mult.tolist(), pad)


def test_pad_blocks_every_longer_lookback():
    lay = engram_layout([1], max_ngram=4, n_heads=3, vocab_size=50)[0]
    mult = hash_multipliers(1, 4, 1000)
    pad = 17
    got = engram_row_ids(torch.tensor([[7, -1, 3, 9]]), lay, mult, pad)
    want = engram_row_ids(torch.tensor([[7, pad, pad, pad]]), lay, mult, pad)
    assert torch.equal(got, want)
    # a token equal to pad_id is not a block: later lookbacks keep their ids
    a = engram_row_ids(torch.tensor([[7, pad, 3, 9]]), lay, mult, pad)
    assert not torch.equal(a, want)
    assert a[0, :3].tolist() == want[0, :3].tolist()  # the 2-gram columns agree


def test_sequence_start_uses_pad():
    lay = engram_layout([1], max_ngram=4, n_heads=2, vocab_size=30)[0]
    mult = hash_multipliers(1, 4, 200)
    pad = 2
    cids = torch.tensor([11, 12, 13, 14, 15])
    rows = engram_row_ids(lookback_windows(cids, torch.arange(5), 4), lay, mult, pad)
    explicit = torch.tensor([[11, pad, pad, pad], [12, 11, pad, pad], [13, 12, 11, pad],
                             [14, 13, 12, 11], [15, 14, 13, 12]])
    assert torch.equal(rows, engram_row_ids(explicit, lay, mult, pad))


def test_chunked_windows_match_whole_sequence():
    lay = engram_layout([2], max_ngram=4, n_heads=2, vocab_size=100)[0]
    mult = hash_multipliers(2, 4, 500)
    cids = torch.randint(0, 500, (23,), generator=torch.Generator().manual_seed(0))
    whole = engram_row_ids(lookback_windows(cids, torch.arange(23), 4), lay, mult, 0)
    part = engram_row_ids(lookback_windows(cids, torch.arange(10, 23), 4), lay, mult, 0)
    assert torch.equal(whole[10:], part)


def test_row_ids_in_range_and_deterministic_at_full_scale():
    f = presets.FULL
    lays = engram_layout(f["engram_layer_ids"], 4, 8, f["engram_vocab_size"])
    cv = f["engram_compressed_vocab_size"]
    g = torch.Generator().manual_seed(1)
    cids = torch.randint(0, cv, (300,), generator=g)
    cids[:3] = cv - 1  # largest ids: products must not overflow int64
    win = lookback_windows(cids, torch.arange(300), 4)
    for lay, L in zip(lays, f["engram_layer_ids"]):
        mult = hash_multipliers(L, 4, cv)
        rows = engram_row_ids(win, lay, mult, pad_id=2)
        assert rows.shape == (300, 24)
        lo = torch.as_tensor(lay.offsets.reshape(-1))
        hi = lo + torch.as_tensor(lay.primes.reshape(-1))
        assert ((rows >= lo) & (rows < hi)).all()
        assert torch.equal(rows, engram_row_ids(win.clone(), lay, mult, pad_id=2))
        for t in (0, 1, 2, 3, 150, 299):
            assert rows[t].tolist() == _py_rows(win[t].tolist(), lay.primes.tolist(), lay.offsets.tolist(),
                                                mult.tolist(), 2)


# ----------------------------------------------------------------------------
# Compressed token map
# ----------------------------------------------------------------------------
def _byte_level_bytes(bs: bytes) -> str:
    """GPT-2 byte-to-unicode spelling of raw bytes (how byte-level BPE stores tokens)."""
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return "".join(table[b] for b in bs)


def _byte_level(s: str) -> str:
    return _byte_level_bytes(s.encode("utf-8"))


def _raw_byte(b: int) -> str:
    return _byte_level_bytes(bytes([b]))


def _hand_tokenizer(pieces: list[str], specials: list[str] = ()):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {p: i for i, p in enumerate(pieces)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_token_map_rules():
    pieces = [
        _byte_level("the"),  # 0 -> "the"                      cid 0
        _byte_level(" The"),  # 1 -> "the" (case, strip)        cid 0
        _byte_level("x"),  # 2                                 cid 1
        _byte_level("THÉ"),  # 3 -> "the" (accent)               cid 0
        _byte_level(" "),  # 4 whitespace survives as " "     cid 2
        _byte_level("  "),  # 5 whitespace run -> " "          cid 2
        _byte_level("\n"),  # 6                                 cid 2
        _byte_level(" \t\n "),  # 7                             cid 2
        _raw_byte(0xC3),  # 8 lone lead byte -> U+FFFD, raw key  cid 3
        _raw_byte(0xA9),  # 9 lone continuation byte           cid 4
        _byte_level("café"),  # 10 -> "cafe"                    cid 5
        _byte_level(" CAFE"),  # 11 -> "cafe"                   cid 5
        _byte_level("ｃａｆｅ"),  # 12 fullwidth, NFKC -> "cafe"   cid 5
        _byte_level("a  b"),  # 13 inner run collapsed -> "a b"  cid 6
        _byte_level("A\tB "),  # 14 -> "a b"                    cid 6
        _byte_level("\u0301"),  # 15 lone combining mark: normalises to "", keyed by its text  cid 7
        _byte_level("x "),  # 16 -> "x"                         cid 1
    ]
    tok = _hand_tokenizer(pieces, specials=["<｜User｜>", "<｜Assistant｜>"])
    assert len(tok) == len(pieces) + 2
    m, n = build_compressed_token_map(tok)
    assert m.dtype == np.int64 and m.shape == (len(pieces) + 2,)
    want = [0, 0, 1, 0, 2, 2, 2, 2, 3, 4, 5, 5, 5, 6, 6, 7, 1, 8, 9]
    assert m.tolist() == want
    assert n == 10
    # deterministic
    m2, n2 = build_compressed_token_map(tok)
    assert (m == m2).all() and n == n2
    # the raw tokenizers.Tokenizer is accepted too
    m3, n3 = build_compressed_token_map(tok.backend_tokenizer)
    assert (m == m3).all() and n3 == n


def test_fragment_keyed_by_raw_string_not_text():
    # two different incomplete byte tokens decode to the same U+FFFD text but keep distinct ids;
    # the same fragment bytes can never merge with a real character
    pieces = [_raw_byte(0xE4), _raw_byte(0xBD), _byte_level("你"), _raw_byte(0xE4) + _raw_byte(0xBD)]
    tok = _hand_tokenizer(pieces)
    texts = [tok.backend_tokenizer.decode([i], skip_special_tokens=False) for i in range(4)]
    assert "\ufffd" in texts[0] and "\ufffd" in texts[1] and "\ufffd" in texts[3] and texts[2] == "你"
    m, n = build_compressed_token_map(tok)
    assert m.tolist() == [0, 1, 2, 3] and n == 4


def test_token_map_of_project_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    from vllm_dsv41.tokenizer import build_tokenizer

    info = build_tokenizer(None, tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    m, n = build_compressed_token_map(tok)
    assert m.shape == (len(tok),) == (info.vocab_size,)
    assert 0 < n < len(tok)  # some tokens merge (case/accents/whitespace)
    assert sorted(set(m.tolist())) == list(range(n))
    first = {}
    for i, c in enumerate(m.tolist()):  # ids appear in order of first occurrence
        first.setdefault(c, i)
    assert list(first) == list(range(n))
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("the", "ĠThe", "ĠTHE", "Ġthe")}
    present = [i for t, i in ids.items() if i is not None and i != tok.unk_token_id and t in tok.get_vocab()]
    assert len({int(m[i]) for i in present}) == 1 and len(present) >= 2


def test_matches_vllm_reference_helpers(tmp_path):
    """vLLM refuses to start when its own map size differs from the config: cross-check against it."""
    try:
        from vllm.models.deepseek_v41.common import engram as vllm_engram
    except Exception as e:  # pragma: no cover - depends on the installed vLLM build
        pytest.skip(f"vLLM's V4.1 engram module is not importable here: {e}")
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from vllm_dsv41.tokenizer import build_tokenizer

    build_tokenizer(None, tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    theirs, n_theirs = vllm_engram.build_compressed_token_map(tok)
    ours, n_ours = build_compressed_token_map(tok)
    assert n_ours == n_theirs and ours.tolist() == list(theirs)

    f = presets.FULL
    cfg = SimpleNamespace(**{k: f[k] for k in f if k.startswith("engram_")})
    ref = vllm_engram.EngramLayout(cfg)
    lays = engram_layout(f["engram_layer_ids"], 4, 8, f["engram_vocab_size"])
    for i, lay in enumerate(lays):
        assert lay.primes.tolist() == [list(p) for p in ref.primes[i]]
        assert lay.offsets.reshape(-1).tolist() == ref.offsets[i].tolist()
    mults = vllm_engram.compute_hash_multipliers(tuple(f["engram_layer_ids"]), 4, 99092)
    for i, L in enumerate(f["engram_layer_ids"]):
        assert hash_multipliers(L, 4, 99092).tolist() == mults[i].tolist()
