"""The token history behind Engram lookbacks under async scheduling: the runner side's row assignment
(``backend.TokenHistoryRows``) and the model side's device table (``step.TokenHistory``)."""

from __future__ import annotations

import torch

from vllm_dsv41.attention.backend import TokenHistoryRows, history_capacity
from vllm_dsv41.model_executor.step import TokenHistory


def test_rows_kept_until_finished_then_reused():
    h = TokenHistoryRows(3)
    a = h.rows_for(["a", "b", None])
    assert a[2] == -1 and len({int(a[0]), int(a[1])}) == 2
    assert list(h.rows_for(["b", "a"])) == [a[1], a[0]]  # the same rows on later steps, in any order
    h.release(["a", "gone"])
    c = h.rows_for(["c", "b"])
    assert c[1] == a[1] and c[0] in (a[0], 3 - a[0] - a[1])  # a's row or the free one
    assert h.evicted == 0


def test_full_table_evicts_the_least_recently_scheduled_request_not_in_the_step():
    h = TokenHistoryRows(2)
    ra = h.rows_for(["a"])[0]
    h.rows_for(["b"])
    h.rows_for(["a"])  # a is now more recent than b
    rows = h.rows_for(["a", "c"])
    assert h.evicted == 1 and rows[0] == ra and "b" not in h.rows and h.rows["c"] != ra
    assert history_capacity(8) == 1024 and history_capacity(512) == 2048


def test_history_reads_what_steps_wrote_and_keeps_the_last_span_positions():
    span = TokenHistory.SPAN
    t = TokenHistory(4, torch.device("cpu"))
    # request row 2 brings positions 0..span+9 in one step (a long prefill chunk): only the last span are kept
    n = span + 10
    pos = torch.arange(n)
    rows = torch.full((n,), 2)
    t.write(rows, pos, torch.full((n,), n - 1), pos + 100)
    q = torch.tensor([[n - 1, n - 2, n - 3], [n - span, n - span - 1, 0]])
    got = t.read(torch.tensor([2, 2]), q)
    assert got[0].tolist() == [n - 1 + 100, n - 2 + 100, n - 3 + 100]
    assert got[1, 0].item() == n - span + 100
    # older positions were overwritten by the kept ones that share their column
    assert got[1, 1].item() == n - 1 + 100 and got[1, 2].item() == span + 100
    # rows without a request read -1 and write only the sink
    before = t.ids[:4].clone()
    t.write(torch.tensor([-1, -1]), torch.tensor([0, 1]), torch.tensor([1, 1]), torch.tensor([7, 8]))
    assert torch.equal(t.ids[:4], before)
    assert t.read(torch.tensor([-1]), torch.tensor([[0, 1]])).tolist() == [[-1, -1]]
