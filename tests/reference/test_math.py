"""Unit tests of the reference model's building blocks (no checkpoint needed)."""

import math

import torch

from vllm_dsv41.reference.model import (apply_rope, candidate_mask, hc_coefficients, rope_inv_freq, route,
                                        sinkhorn, sparse_attention, topk_select)
from vllm_dsv41.config import RopeParams


def test_sinkhorn_doubly_stochastic():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 4, 4, generator=g)
    A = sinkhorn(logits, 1e-6, 20)
    assert (A >= 0).all()
    row_err = (A.sum(-1) - 1).abs().max().item()
    col_err = (A.sum(-2) - 1).abs().max().item()
    print(f"sinkhorn row err {row_err:.2e} col err {col_err:.2e}")
    assert col_err < 1e-5 and row_err < 1e-3  # 20 iterations: approximately doubly stochastic


def test_hc_coefficients_ranges():
    g = torch.Generator().manual_seed(1)
    T, C, H = 5, 4, 32
    S = torch.randn(T, C, H, generator=g)
    fn = torch.randn(24, C * H, generator=g) * 0.1
    pre, post, comb = hc_coefficients(S, fn, torch.zeros(24), torch.ones(3), 1e-20, 1e-6, 20)
    assert pre.shape == (T, C) and post.shape == (T, C) and comb.shape == (T, C, C)
    assert ((pre > 1e-6) & (pre < 1 + 1e-6 + 1e-9)).all()
    assert ((post > 0) & (post < 2)).all()
    assert torch.allclose(comb.sum(-2), torch.ones(T, C), atol=1e-5)


def test_routed_scaling_applied_once():
    # two experts with equal scores: each weight must be exactly scaling / 2 (1.5^2 would give 1.125)
    x = torch.tensor([[1.0, 0.0]])
    gate = torch.tensor([[2.0, 0.0], [2.0, 0.0], [-5.0, 0.0]])
    idx, w = route(x, gate, torch.zeros(3), 2, 1.5)
    assert sorted(idx[0].tolist()) == [0, 1]
    assert torch.allclose(w, torch.tensor([[0.75, 0.75]]))
    assert abs(w.sum().item() - 1.5) < 1e-6


def test_router_bias_selects_but_does_not_weight():
    x = torch.tensor([[1.0]])
    gate = torch.tensor([[3.0], [1.0], [0.0]])
    idx, w = route(x, gate, torch.tensor([0.0, 0.0, 10.0]), 2, 1.0)
    assert 2 in idx[0].tolist()  # the bias pulled expert 2 in
    s = torch.sqrt(torch.nn.functional.softplus(gate[:, 0]))
    chosen = idx[0]
    assert torch.allclose(w[0], s[chosen] / s[chosen].sum())


def test_rope_inverse_and_norm():
    inv = rope_inv_freq(RopeParams(theta=160000.0, yarn_factor=4, original_max_position=64), 16)
    x = torch.randn(7, 3, 64)
    pos = torch.arange(100, 107)
    y = apply_rope(x, pos, inv)
    assert torch.allclose(y[..., :48], x[..., :48])
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), atol=1e-4)
    assert torch.allclose(apply_rope(y, pos, inv, inverse=True), x, atol=1e-5)
    # GPT-J pairs: (2i, 2i+1) rotate together
    e = torch.zeros(1, 64)
    e[0, 48] = 1.0
    r = apply_rope(e, torch.tensor([3]), inv)
    assert r[0, 50:].abs().max() == 0 and abs(r[0, 48].item() - math.cos(3 * inv[0].item())) < 1e-6


def test_yarn_scales_only_low_frequencies():
    plain = rope_inv_freq(RopeParams(theta=160000.0), 64)
    yarn = rope_inv_freq(RopeParams(theta=160000.0, yarn_factor=16, original_max_position=65536), 64)
    assert torch.allclose(yarn[0], plain[0])
    assert torch.allclose(yarn[-1], plain[-1] / 16)


def test_sparse_attention_sink():
    q = torch.zeros(1, 2, 4)
    keys = torch.randn(3, 4)
    mask = torch.tensor([[True, True, False]])
    sink = torch.tensor([float("-inf"), 0.0])
    o = sparse_attention(q, keys, mask, sink, 0.5)
    assert torch.allclose(o[0, 0], keys[:2].mean(0), atol=1e-6)  # no sink: plain average
    assert torch.allclose(o[0, 1], keys[:2].sum(0) / 3, atol=1e-6)  # sink adds exp(0) to the denominator


def test_topk_and_candidates():
    scores = torch.tensor([[0.1, 5.0, 0.2, 0.3, 4.0, 0.0, 0.0, 0.0]])
    n_vis = torch.tensor([6])
    sel = topk_select(scores.masked_fill(torch.arange(8) >= 6, float("-inf")), n_vis, 2)
    assert sel[0].nonzero().flatten().tolist() == [1, 4]
    assert topk_select(scores, torch.tensor([2]), 2)[0].nonzero().flatten().tolist() == [0, 1]
    cand = candidate_mask(scores.masked_fill(torch.arange(8) >= 6, float("-inf")), n_vis, 2, 1)
    # newest visible entry (5) lives in block 2: pinned, even though block 0 holds the max
    assert cand[0].nonzero().flatten().tolist() == [4, 5]
