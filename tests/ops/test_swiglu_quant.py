"""``dsv41::swiglu_quant`` (vllm_dsv41/ops/swiglu_quant.py): the CPU op is the reference (the clamped SwiGLU, then
``formats.quant_fp8_tokens``); the Triton kernel in the interpreter on CPU and compiled on CUDA: h to the bf16 rounding
of the reference, its codes and scales bitwise the per-row quantisation of its own h.  ``python -m
tests.ops.test_swiglu_quant --interpret`` is the interpreter run."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from tests.ops.conftest import assert_close, requires_cuda, run_under_interpreter
from vllm_dsv41 import formats
from vllm_dsv41.ops import swiglu_quant as sq
from vllm_dsv41.reference.model import clamped_swiglu_act

LIMIT = 7.0


def make_y(T: int, inter: int, dtype=torch.bfloat16, device: str = "cpu") -> torch.Tensor:
    """Gate and up projections with a tail past the clamp limit (both signs) and an all-zero row."""
    g = torch.Generator().manual_seed(T * 7 + inter)
    y = torch.randn(T, 2 * inter, generator=g) * 4
    if T > 1:
        y[1] = 0.0
    return y.to(dtype).to(device)


def test_cpu_op_is_the_reference():
    y = make_y(5, 96)
    h, q, s = torch.ops.dsv41.swiglu_quant(y, LIMIT)
    want = clamped_swiglu_act(y[:, :96].float(), y[:, 96:].float(), LIMIT).to(torch.bfloat16)
    assert torch.equal(h, want)
    wq, ws = formats.quant_fp8_tokens(want)
    assert q.dtype == torch.float8_e4m3fn and torch.equal(q.view(torch.uint8), wq.view(torch.uint8))
    assert s.shape == (5, 1) and torch.equal(s, ws)
    assert torch.equal(s[1], torch.tensor([formats.FP8_TOKEN_SCALE_FLOOR]))  # the zero row: the floor, all codes 0


def test_rejects_odd_width():
    with pytest.raises(ValueError, match="swiglu_quant"):
        torch.ops.dsv41.swiglu_quant(torch.zeros(3, 5, dtype=torch.bfloat16), LIMIT)


def test_fake_impl():
    torch.library.opcheck(torch.ops.dsv41.swiglu_quant, (make_y(3, 64), LIMIT),
                          test_utils=("test_schema", "test_faketensor"))


def _kernel_vs_ref(T: int, inter: int, device: str, dtype=torch.bfloat16, block: int | None = None) -> None:
    y = make_y(T, inter, dtype, device)
    h, q, s = sq._swiglu_quant_triton(y, LIMIT, block)
    rh, _, _ = sq.swiglu_quant_ref(y.cpu(), LIMIT)
    assert h.dtype == dtype and q.dtype == torch.float8_e4m3fn and s.shape == (T, 1)
    assert_close(f"swiglu_quant h T={T} I={inter} {dtype}", rh.float(), h.cpu().float(),
                 ratio=1e-2 if dtype == torch.bfloat16 else 1e-5)
    wq, ws = formats.quant_fp8_tokens(h.cpu())
    assert torch.equal(q.cpu().view(torch.uint8), wq.view(torch.uint8)), "codes differ from quant(h)"
    assert torch.equal(s.cpu(), ws), "scales differ from quant(h)"


def _interpreter_main() -> int:
    assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 before Python starts"
    _kernel_vs_ref(3, 96, "cpu")
    _kernel_vs_ref(4, 2304, "cpu")  # the target's width, in registers (4,096 lanes, masked)
    _kernel_vs_ref(4, 2304, "cpu", block=1024)  # the two-pass variant: three steps, the last one masked
    _kernel_vs_ref(2, 64, "cpu", torch.float32)
    return 0


def test_triton_interpreter():
    run_under_interpreter(["-m", "tests.ops.test_swiglu_quant", "--interpret"])


def test_kernel_builds_for_sm90():
    """One row a program at the target's width (in registers) and the two-pass variant: no spills on Hopper (Triton's
    own ptxas, no GPU)."""
    from tests.ops.conftest import SM90_SHARED_LIMIT, sm90_build

    pytest.importorskip("triton")
    kernel = sq._kernels()
    ptr = {"y_ptr": "*bf16", "h_ptr": "*bf16", "q_ptr": "*u8", "s_ptr": "*fp32"}
    sig = {n: ptr.get(n, "constexpr" if n in ("BLOCK", "ONE_PASS") else "fp32" if n in ("limit", "floor") else "i32")
           for n in kernel.arg_names}
    for block, one_pass, warps in ((4096, True, 8), (sq.BLOCK_I, False, 4)):
        got = sm90_build(kernel, sig, {"BLOCK": block, "ONE_PASS": one_pass}, num_warps=warps, num_stages=1)
        print(f"swiglu_quant BLOCK={block} one pass {one_pass}: {got}")
        assert got["shared"] <= SM90_SHARED_LIMIT and got["regs"] <= 255 and got["stack"] == 0, got


@requires_cuda
@pytest.mark.parametrize("T", [1, 7, 64, 1024])
def test_cuda_real_sizes(T):
    _kernel_vs_ref(T, 2304, "cuda")


if __name__ == "__main__" and "--interpret" in sys.argv:
    sys.exit(_interpreter_main())
