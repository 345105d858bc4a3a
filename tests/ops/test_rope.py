"""``dsv41::rope`` / ``dsv41::rope_`` against ``reference.model.apply_rope`` (the CPU op is the reference; the
Triton kernel in the interpreter on CPU and compiled on CUDA).  ``python -m tests.ops.test_rope --interpret`` is the
interpreter run."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from tests.ops.conftest import assert_close, requires_cuda, run_under_interpreter
from vllm_dsv41.config import RopeParams
from vllm_dsv41.reference.model import apply_rope, rope_inv_freq


def make_case(T: int, H: int, D: int, R: int, start: int, device: str = "cpu"):
    g = torch.Generator().manual_seed(T + D)
    x = torch.randn(T, H, D, generator=g) * 3
    pos = torch.randint(start, start + 8192, (T,), generator=g)
    inv = rope_inv_freq(RopeParams(theta=10000.0, yarn_factor=16.0, original_max_position=65536), R)
    return x.to(device), pos.to(device), inv.to(device)


def test_cpu_op_is_the_reference():
    import vllm_dsv41.ops.rope  # noqa: F401

    x, pos, inv = make_case(5, 3, 64, 16, 0)
    assert torch.equal(torch.ops.dsv41.rope(x, pos, inv), apply_rope(x, pos, inv))
    xb = x.to(torch.bfloat16)  # bf16 in, bf16 out (the rotation in fp32), as the kernel
    got = torch.ops.dsv41.rope(xb, pos, inv)
    assert got.dtype == torch.bfloat16 and torch.equal(got, apply_rope(xb.float(), pos, inv).to(torch.bfloat16))


def test_cpu_inplace_op_equals_the_copy():
    import vllm_dsv41.ops.rope  # noqa: F401

    x, pos, inv = make_case(5, 3, 64, 16, 0)
    for xt in (x, x.to(torch.bfloat16), x[:, 0]):  # [T, H, D], bf16, [T, D]
        want = torch.ops.dsv41.rope(xt, pos, inv)
        got = xt.clone()
        assert torch.ops.dsv41.rope_(got, pos, inv) is None
        assert torch.equal(got, want)


def test_rejects_mismatched_positions():
    import vllm_dsv41.ops.rope  # noqa: F401

    x, pos, inv = make_case(5, 3, 64, 16, 0)
    with pytest.raises(ValueError, match="positions"):
        torch.ops.dsv41.rope_(x, pos[:4], inv)


def _kernel_vs_ref(T, H, D, R, start, device, dtype=torch.float32):
    from vllm_dsv41.ops.rope import _rope_inplace_triton, _rope_triton, rope_ref

    x, pos, inv = make_case(T, H, D, R, start, device)
    x = x.to(dtype)
    got = _rope_triton(x, pos, inv)
    ref = rope_ref(x.cpu(), pos.cpu(), inv.cpu())
    assert got.dtype == ref.dtype == dtype
    assert torch.equal(got.cpu()[..., : D - R], x.cpu()[..., : D - R]), "NoPE dims changed"
    assert_close(f"rope T={T} H={H} D={D} R={R} start={start} {dtype}", ref.float(), got.cpu().float(),
                 ratio=1e-5 if dtype == torch.float32 else 1e-2)
    inplace = x.clone()
    _rope_inplace_triton(inplace, pos, inv)
    assert torch.equal(inplace, got), "in place differs from the copy"
    # a strided view (one of two interleaved copies): only its rows turn, the other copy stays
    wide = torch.stack((x, x), 2)                                                          # [T, H, 2, D]
    _rope_inplace_triton(wide[:, :, 0], pos, inv)
    assert torch.equal(wide[:, :, 0], got) and torch.equal(wide[:, :, 1], x)
    # negative positions turn back (the inverse RoPE of the attention output)
    _rope_inplace_triton(inplace, -pos, inv)
    assert_close(f"rope there and back T={T} H={H} {dtype}", x.cpu().float(), inplace.cpu().float(),
                 ratio=1e-5 if dtype == torch.float32 else 2e-2)


def _interpreter_main() -> int:
    assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 before Python starts"
    _kernel_vs_ref(7, 4, 64, 16, 0, "cpu")
    _kernel_vs_ref(3, 2, 512, 64, 60000, "cpu")
    _kernel_vs_ref(3, 2, 512, 64, 60000, "cpu", torch.bfloat16)
    return 0


def test_triton_interpreter():
    run_under_interpreter(["-m", "tests.ops.test_rope", "--interpret"])


@requires_cuda
@pytest.mark.parametrize("T,H", [(1, 64), (64, 64), (4096, 64), (64, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_real_sizes(T, H, dtype):
    _kernel_vs_ref(T, H, 512 if H == 64 else 128, 64, 1_000_000 - 9000, "cuda", dtype)


if __name__ == "__main__" and "--interpret" in sys.argv:
    sys.exit(_interpreter_main())
