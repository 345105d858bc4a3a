"""``dsv41::l2_prefetch`` and ``dsv41::l2_prefetch_rows``: hints that move no result - nothing on CPU, one prefetch
instruction a line on CUDA."""

from __future__ import annotations

import pytest
import torch

from vllm_dsv41.ops import l2_prefetch as lp


def test_cpu_does_nothing_and_leaves_the_tensor():
    t = torch.arange(1000, dtype=torch.float32)
    before = t.clone()
    assert torch.ops.dsv41.l2_prefetch(t, 8, True) is None
    assert torch.equal(t, before)


@pytest.mark.parametrize("bad,match", [(lambda: (torch.zeros(8, 8).t(), 4), "contiguous"),
                                       (lambda: (torch.zeros(8), 0), "programs=0")])
def test_bad_arguments_are_named(bad, match):
    t, programs = bad()
    with pytest.raises(ValueError, match=match):
        torch.ops.dsv41.l2_prefetch(t, programs)


@pytest.mark.parametrize("evict_last", [False, True])
def test_kernel_builds_for_sm90_with_one_prefetch_a_line(evict_last):
    """The kernel compiles for Hopper (Triton's ptxas, no GPU), keeps no stack, and its PTX issues the L2 prefetches
    (with the evict-last hint when asked) rather than loads."""
    from tests.ops.conftest import sm90_build

    got = sm90_build(lp._l2_prefetch_kernel, {"ptr": "*u8", "nlines": "i32", "LINES": "constexpr",
                                              "EVICT_LAST": "constexpr"},
                     {"LINES": 256, "EVICT_LAST": evict_last}, 4, want_ptx=True)
    ptx = got.pop("ptx")
    print(f"l2_prefetch evict_last={evict_last}: {got}")
    assert got["stack"] == 0
    hint = "prefetch.global.L2::evict_last" if evict_last else "prefetch.global.L2 "
    assert hint in ptx
    assert "ld.global" not in ptx


def test_rows_cpu_does_nothing_and_names_bad_rows():
    t = torch.zeros(4, 3, 5, dtype=torch.uint8)
    assert torch.ops.dsv41.l2_prefetch_rows(t, torch.tensor([3, 0, 9, -1], dtype=torch.int32), 4, False) is None
    assert not t.any()
    with pytest.raises(ValueError, match="int32 or int64"):
        torch.ops.dsv41.l2_prefetch_rows(t, torch.tensor([0.0]), 4)
    with pytest.raises(ValueError, match="non-empty first dimension"):
        torch.ops.dsv41.l2_prefetch_rows(torch.zeros(0, 3), torch.tensor([0]), 4)


@pytest.mark.parametrize("evict_last", [False, True])
def test_rows_kernel_builds_for_sm90(evict_last):
    """The experts' form: rows read on the device and clamped, no stack, the prefetches in the PTX and one load (the
    row index) rather than loads of the slabs."""
    from tests.ops.conftest import sm90_build

    got = sm90_build(lp._l2_prefetch_rows_kernel, {"ptr": "*u8", "rows_ptr": "*i32", "n_rows": "i32", "n_slabs": "i32",
                                                   "slab_bytes": "i32", "slab_lines": "i32", "LINES": "constexpr",
                                                   "EVICT_LAST": "constexpr"},
                     {"LINES": 256, "EVICT_LAST": evict_last}, 4, want_ptx=True)
    ptx = got.pop("ptx")
    print(f"l2_prefetch_rows evict_last={evict_last}: {got}")
    assert got["stack"] == 0
    assert ("prefetch.global.L2::evict_last" if evict_last else "prefetch.global.L2 ") in ptx
    assert "ld.global.u8" not in ptx and "ld.global.v4.u8" not in ptx


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_rows_prefetch_runs_in_a_graph_with_out_of_range_rows():
    t = torch.randint(0, 255, (5, 300, 77), dtype=torch.uint8, device="cuda")  # slabs not a whole number of lines
    before = t.clone()
    rows = torch.tensor([4, 0, 7, -3], dtype=torch.int32, device="cuda")  # clamped, never outside t
    torch.ops.dsv41.l2_prefetch_rows(t, rows, 3, False)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        torch.ops.dsv41.l2_prefetch_rows(t, rows, 16, True)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(t, before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_prefetch_runs_in_a_graph_and_changes_nothing():
    t = torch.randn(3, 1000, 129, device="cuda").to(torch.float8_e4m3fn)  # not a whole number of lines
    before = t.clone()
    torch.ops.dsv41.l2_prefetch(t, 16, False)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        torch.ops.dsv41.l2_prefetch(t, 132, True)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(t.view(torch.uint8), before.view(torch.uint8))
