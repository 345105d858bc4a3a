"""``dsv41::dequant_mxfp4`` (MXFP4 expert weights -> bf16, the prefill MoE path) against ``formats.dequant_mxfp4``
(the Triton kernel in the interpreter on CPU and compiled on CUDA).  ``python -m tests.ops.test_dequant_mxfp4
--interpret`` is the interpreter run."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from tests.ops.conftest import requires_cuda, run_under_interpreter, sm90_build
from vllm_dsv41 import formats


def make_case(shape: tuple[int, ...], device: str = "cpu", seed: int = 0):
    """Packed MXFP4 of random values spread over many scales (so every E8M0 byte path is used), and its bf16 out."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(*shape, generator=g, device=device) * torch.exp2(
        torch.randint(-20, 20, (*shape[:-1], shape[-1] // 32, 1), generator=g, device=device).float()
    ).repeat_interleave(32, -1).view(shape)
    q, s = formats.quant_mxfp4(x)
    out = torch.empty(shape, dtype=torch.bfloat16, device=device)
    return q.view(torch.uint8), formats.as_uint8(s), out


def test_cpu_op_is_the_reference_and_exact():
    from vllm_dsv41.ops import dequant_mxfp4  # noqa: F401

    w, s, out = make_case((3, 8, 96))
    torch.ops.dsv41.dequant_mxfp4(w, s, out)
    want = formats.dequant_mxfp4(w, s)
    assert torch.equal(out.float(), want), "E2M1 x 2^k is exact in bf16"


def test_bad_shapes_name_the_tensor():
    from vllm_dsv41.ops.dequant_mxfp4 import dequant_mxfp4_ref

    w, s, out = make_case((2, 4, 64))
    with pytest.raises(ValueError, match=r"scales \(2, 4, 1\) do not match packed weight \(2, 4, 32\)"):
        dequant_mxfp4_ref(w, s[..., :1].contiguous(), out)
    with pytest.raises(ValueError, match=r"out \(2, 4, 32\), expected \(2, 4, 64\)"):
        dequant_mxfp4_ref(w, s, out[..., :32].contiguous())


def _kernel_vs_ref(shape, device):
    from vllm_dsv41.ops.dequant_mxfp4 import _dequant_mxfp4_triton

    w, s, out = make_case(shape, device, seed=sum(shape))
    _dequant_mxfp4_triton(w, s, out)
    want = formats.dequant_mxfp4(w, s)
    assert torch.equal(out.float(), want), f"dequant_mxfp4 {shape}: {(out.float() - want).abs().max().item()}"
    print(f"dequant_mxfp4 {shape} on {device}: equal")


def _interpreter_main() -> int:
    assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 before Python starts"
    _kernel_vs_ref((2, 5, 64), "cpu")  # rows and columns both short of a block (masks)
    _kernel_vs_ref((3, 17, 288), "cpu")  # 144 packed bytes: a second, partial column block
    return 0


def test_triton_interpreter():
    run_under_interpreter(["-m", "tests.ops.test_dequant_mxfp4", "--interpret"])


def test_kernel_builds_for_sm90_without_spills():
    from vllm_dsv41.ops import dequant_mxfp4 as m

    sig = {"w_ptr": "*u8", "s_ptr": "*u8", "out_ptr": "*bf16", "R": "i32", "C2": "i32",
           "BLOCK_R": "constexpr", "BLOCK_C": "constexpr"}
    got = sm90_build(m._kernels(), sig, {"BLOCK_R": m.BLOCK_R, "BLOCK_C": m.BLOCK_C}, 4)
    print(f"dequant_mxfp4 kernel: {got}")
    assert got["stack"] == 0


@requires_cuda
@pytest.mark.parametrize("shape", [(32, 4608, 5120), (32, 5120, 2304), (3, 17, 288)])
def test_cuda_real_sizes(shape):
    _kernel_vs_ref(shape, "cuda")


if __name__ == "__main__" and "--interpret" in sys.argv:
    sys.exit(_interpreter_main())
