"""``dsv41::dequant_mxfp4`` (MXFP4 expert weights -> bf16, the prefill MoE path) against ``formats.dequant_mxfp4``,
and ``dsv41::dequant_mxfp4_fp8`` (-> FP8 under one power of two per row, the FP8 prefill MoE) against
``formats.mxfp4_to_fp8_rows`` (the Triton kernel in the interpreter on CPU and compiled on CUDA).
``python -m tests.ops.test_dequant_mxfp4 --interpret`` is the interpreter run."""

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


def test_fp8_rows_are_exact_within_the_headroom():
    """fp8 x row scale gives back every value of blocks at most 14 binades below the row's largest one; the rest
    round (relative to the row's largest block scale, below 2**-10 of it)."""
    w, s, _ = make_case((4, 16, 256), seed=3)
    q, row_scale = formats.mxfp4_to_fp8_rows(w, s)
    assert q.dtype == torch.float8_e4m3fn and tuple(row_scale.shape) == (4, 16)
    back = q.float() * row_scale.unsqueeze(-1)
    want = formats.dequant_mxfp4(w, s)
    e = s.to(torch.int32)
    near = (e >= formats.mxfp4_row_exponents(s).unsqueeze(-1) - 14).repeat_interleave(32, -1)
    assert near.any() and (~near).any(), "the case must have blocks on both sides of the headroom"
    assert torch.equal(back[near], want[near])
    top = formats.e8m0_to_float(formats.mxfp4_row_exponents(s).to(torch.uint8)).unsqueeze(-1).expand_as(want)
    assert ((back - want).abs()[~near] <= top[~near] * 2.0 ** -10).all()
    assert q.float().abs().max() <= 384


def test_fp8_cpu_op_is_the_reference():
    from vllm_dsv41.ops import dequant_mxfp4  # noqa: F401

    w, s, _ = make_case((3, 8, 96), seed=1)
    out = torch.empty(3, 8, 96, dtype=torch.float8_e4m3fn)
    torch.ops.dsv41.dequant_mxfp4_fp8(w, s, formats.mxfp4_row_exponents(s), out)
    assert torch.equal(out.view(torch.uint8), formats.mxfp4_to_fp8_rows(w, s)[0].view(torch.uint8))


def test_fp8_bad_arguments_name_the_tensor():
    from vllm_dsv41.ops.dequant_mxfp4 import dequant_mxfp4_fp8_ref

    w, s, out = make_case((2, 4, 64))
    rows = formats.mxfp4_row_exponents(s)
    with pytest.raises(ValueError, match=r"out is torch.bfloat16, expected torch.float8_e4m3fn"):
        dequant_mxfp4_fp8_ref(w, s, rows, out)
    fp8 = torch.empty(2, 4, 64, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"row_exp \(2, 4\) torch.int64, expected contiguous int32 \(2, 4\)"):
        dequant_mxfp4_fp8_ref(w, s, rows.long(), fp8)


def _kernel_vs_ref(shape, device):
    from vllm_dsv41.ops.dequant_mxfp4 import _dequant_mxfp4_fp8_triton, _dequant_mxfp4_triton

    w, s, out = make_case(shape, device, seed=sum(shape))
    _dequant_mxfp4_triton(w, s, out)
    want = formats.dequant_mxfp4(w, s)
    assert torch.equal(out.float(), want), f"dequant_mxfp4 {shape}: {(out.float() - want).abs().max().item()}"
    fp8 = torch.empty(shape, dtype=torch.float8_e4m3fn, device=device)
    _dequant_mxfp4_fp8_triton(w, s, formats.mxfp4_row_exponents(s), fp8)
    want8 = formats.mxfp4_to_fp8_rows(w, s)[0]
    # bytes, except that a zero may carry either sign (on the H200 some values that round to zero from below come out
    # +0 where the reference writes -0: 20,149,405 such bytes at (32, 5120, 2304), no other difference; session 16)
    differ = (fp8.view(torch.uint8) != want8.view(torch.uint8)) & ~((fp8.float() == 0) & (want8.float() == 0))
    if device == "cpu":  # the interpreter (Triton 3.9) truncates into E4M3's subnormals whatever the rounding mode
        rows = formats.mxfp4_row_exponents(s).unsqueeze(-1)  # asked for: compare the values that need no rounding
        differ &= (s.to(torch.int32) >= rows - formats.MXFP4_FP8_HEADROOM - 6).repeat_interleave(32, -1)
    bad = differ.sum().item()
    assert bad == 0, f"dequant_mxfp4_fp8 {shape}: {bad} bytes differ from formats.mxfp4_to_fp8_rows"
    print(f"dequant_mxfp4 and dequant_mxfp4_fp8 {shape} on {device}: equal")


def _interpreter_main() -> int:
    assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 before Python starts"
    _kernel_vs_ref((2, 5, 64), "cpu")  # rows and columns both short of a block (masks)
    _kernel_vs_ref((3, 17, 288), "cpu")  # 144 packed bytes: a second, partial column block
    return 0


def test_triton_interpreter():
    run_under_interpreter(["-m", "tests.ops.test_dequant_mxfp4", "--interpret"])


def test_kernel_builds_for_sm90_without_spills():
    from vllm_dsv41.ops import dequant_mxfp4 as m

    for out, r, row_exp in (("*bf16", "*u8", False), ("*fp8e4nv", "*i32", True)):
        sig = {"w_ptr": "*u8", "s_ptr": "*u8", "r_ptr": r, "out_ptr": out, "R": "i32", "C2": "i32",
               "BLOCK_R": "constexpr", "BLOCK_C": "constexpr", "ROW_EXP": "constexpr", "HEADROOM": "constexpr"}
        got = sm90_build(m._kernels(), sig, {"BLOCK_R": m.BLOCK_R, "BLOCK_C": m.BLOCK_C, "ROW_EXP": row_exp,
                                             "HEADROOM": formats.MXFP4_FP8_HEADROOM}, 4)
        print(f"dequant_mxfp4 kernel ({out} out): {got}")
        assert got["stack"] == 0


@requires_cuda
@pytest.mark.parametrize("shape", [(32, 4608, 5120), (32, 5120, 2304), (3, 17, 288)])
def test_cuda_real_sizes(shape):
    _kernel_vs_ref(shape, "cuda")


if __name__ == "__main__" and "--interpret" in sys.argv:
    sys.exit(_interpreter_main())
