"""``dsv41::paged_rows``: the reference (integer math, the model's former inline code) and the Triton kernel
against it, exactly (interpreter on CPU, compiled on CUDA).  ``python -m tests.ops.test_paged_rows --interpret``."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from tests.ops.conftest import requires_cuda, run_under_interpreter


def make_case(R: int, K: int, M: int, E: int, device: str = "cpu"):
    g = torch.Generator().manual_seed(R * 7 + K)
    bt = torch.randint(1, 1 << 20, (R + 3, M), generator=g, dtype=torch.int32)
    req = torch.randperm(R + 3, generator=g)[:R]
    ent = torch.randint(-1, M * E + 5, (R, K), generator=g, dtype=torch.int32)  # past the table too
    return bt.to(device), req.to(device), ent.to(device)


def _expected(bt, req, ent, E, bstep, rstep):
    out = torch.full(ent.shape, -1, dtype=torch.int64)
    for r in range(ent.shape[0]):
        for k in range(ent.shape[1]):
            j = int(ent[r, k])
            if j >= 0:
                out[r, k] = int(bt[int(req[r]), min(j // E, bt.shape[1] - 1)]) * bstep + (j % E) * rstep
    return out


@pytest.mark.parametrize("bstep,rstep", [(32, 1), (4620, 132)])
def test_reference_by_definition(bstep, rstep):
    from vllm_dsv41.ops.paged_rows import paged_rows_ref

    bt, req, ent = make_case(5, 9, 6, 32)
    assert torch.equal(paged_rows_ref(bt, req, ent, 32, bstep, rstep), _expected(bt, req, ent, 32, bstep, rstep))
    import vllm_dsv41.ops.paged_rows  # noqa: F401

    assert torch.equal(torch.ops.dsv41.paged_rows(bt, req, ent, 32, bstep, rstep),
                       paged_rows_ref(bt, req, ent, 32, bstep, rstep))


def _kernel_cases(device: str) -> None:
    from vllm_dsv41.ops.paged_rows import _paged_rows_triton, paged_rows_ref

    for R, K, M, E, bstep, rstep in ((3, 20, 4, 32, 32, 1), (4, 512, 70, 64, 1 << 40, 297), (1, 128, 3, 16, 16, 1)):
        bt, req, ent = make_case(R, K, M, E, device)
        got = _paged_rows_triton(bt, req, ent, E, bstep, rstep).cpu()
        ref = paged_rows_ref(bt.cpu(), req.cpu(), ent.cpu(), E, bstep, rstep)
        assert torch.equal(got, ref), f"R={R} K={K}: {(got != ref).sum().item()} rows differ"
        print(f"  ok R={R} K={K} M={M} E={E} bstep={bstep}")


def _interpreter_main() -> int:
    assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 before Python starts"
    _kernel_cases("cpu")
    return 0


def test_triton_interpreter():
    run_under_interpreter(["-m", "tests.ops.test_paged_rows", "--interpret"])


@requires_cuda
def test_cuda_exact():
    _kernel_cases("cuda")


if __name__ == "__main__" and "--interpret" in sys.argv:
    sys.exit(_interpreter_main())
