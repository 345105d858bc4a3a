"""Pooling runners over the V4.1 model (``--runner pooling --convert embed``): a pooler that reads more than each
prompt's last row gets every row through the decoder layers, not the pruned rows' zeros."""

from __future__ import annotations

import pytest
import torch

from tests.e2e.conftest import engine


def _embed(ckpt: str, exact: bool, pooling: str | None, prompts: list[list[int]]) -> torch.Tensor:
    from vllm.inputs import TokensPrompt

    kw = dict(runner="pooling", convert="embed", enable_prefix_caching=False)
    if pooling:
        kw["pooler_config"] = {"pooling_type": pooling}
    with engine(ckpt, exact=exact, **kw) as llm:
        out = llm.embed([TokensPrompt(prompt_token_ids=p) for p in prompts], use_tqdm=False)
    return torch.tensor([o.outputs.embedding for o in out])


@pytest.mark.parametrize("pooling", ["MEAN", "CLS"])
def test_pooling_past_the_last_row_reads_every_row(tiny_ckpt, prompts, pooling):
    """Default mode (decoder pruning on) pools the same embeddings as exact mode (no pruning) for prompts past the
    window: every row of a MEAN / CLS-pooled request runs the decoder layers.  (Before session 19 the pruned rows
    were zeros: the embeddings differed from exact mode's by up to 0.42 (MEAN) and 0.30 (CLS) a component.)"""
    batch = [prompts[-1], prompts[4], prompts[0]]  # 200, 90 and 5 tokens; the window is 16
    default = _embed(tiny_ckpt, False, pooling, batch)
    exact = _embed(tiny_ckpt, True, pooling, batch)
    diff = (default - exact).abs().max().item()
    print(f"{pooling} pooling, default vs exact mode: largest difference {diff:.2e}")
    assert torch.isfinite(default).all() and diff < 1e-4


def test_which_pooling_requests_keep_every_row():
    """``runner_hooks._pools_every_row``: only ``embed`` / ``classify`` under ``LAST`` sequence pooling read just the
    last row; token-level and combined tasks, and ``MEAN`` / ``CLS`` pooling, read more; a generation request none."""
    from types import SimpleNamespace

    from vllm_dsv41.attention.runner_hooks import _pools_every_row

    def runner(seq_pooling, **tasks):
        params = {r: SimpleNamespace(task=t) for r, t in tasks.items()}
        return SimpleNamespace(input_batch=SimpleNamespace(pooling_params=params),
                               model_config=SimpleNamespace(pooler_config=SimpleNamespace(seq_pooling_type=seq_pooling)))

    r = runner("LAST", a="embed", b="classify", c="token_embed", d="token_classify", e="embed&token_classify")
    assert [_pools_every_row(r, k) for k in "abcdef"] == [False, False, True, True, True, False]
    for seq in ("MEAN", "CLS"):
        assert _pools_every_row(runner(seq, a="embed"), "a")
    assert not _pools_every_row(runner(None, a="classify"), "a")  # unset: vLLM's default for these, LAST
