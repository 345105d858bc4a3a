"""``dsv41::swa_insert``: the reference against the model's unfused norm -> RoPE -> record -> write, and the
Triton kernel against the reference (interpreter on CPU, compiled on CUDA).

``python -m tests.ops.test_swa_insert --interpret`` (with TRITON_INTERPRET=1) is the interpreter run.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from tests.ops.conftest import requires_cuda, run_under_interpreter
from vllm_dsv41 import formats
from vllm_dsv41.reference.model import apply_rope, rms_norm, rope_inv_freq
from vllm_dsv41.config import RopeParams


def make_case(T: int, D: int, R: int, rows: int, start: int, seed: int, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(T, D, generator=g) * torch.rand(T, 1, generator=g) * 8
    kv[0, : D // 2] = 0.0  # a block of zeros (the amax floor) and tiny values
    if T > 1:
        kv[1] *= 1e-6
    w = torch.rand(D, generator=g) + 0.5
    pos = torch.randint(start, start + 4096, (T,), generator=g)
    inv = rope_inv_freq(RopeParams(theta=10000.0, yarn_factor=4.0, original_max_position=64), R)
    slots = torch.randperm(rows, generator=g)[:T]
    slots[::3] = -1  # rows that write nothing
    cache = torch.randint(0, 256, (rows, formats.mxfp8_record_bytes(D)), generator=g, dtype=torch.uint8)
    return [t.to(device) for t in (kv, w, pos, inv, slots, cache)]


def _compare(ref_cache: torch.Tensor, got_cache: torch.Tensor, D: int) -> str:
    """Untouched rows equal; written records decode within one E4M3 step of each other (a summation-order
    ulp can move a value across a rounding point); returns the share of differing bytes."""
    diff = (ref_cache != got_cache).any(1)
    a = formats.decode_mxfp8_record(ref_cache[diff], D)
    b = formats.decode_mxfp8_record(got_cache[diff], D)
    if diff.any():
        rel = ((a - b).abs() / a.abs().clamp(min=1e-30)).max().item()
        assert rel <= 0.126 or (a - b).abs().max().item() < 1e-30, f"records differ by {rel:.3e} relative"
    share = (ref_cache != got_cache).float().mean().item()
    assert share < 1e-3, f"{share:.2e} of the cache bytes differ"
    return f"{share:.1e} of bytes differ"


def test_reference_is_the_models_unfused_write():
    T, D, R, rows = 9, 64, 16, 40
    kv, w, pos, inv, slots, cache = make_case(T, D, R, rows, start=0, seed=0)
    got = cache.clone()
    from vllm_dsv41.ops.swa_insert import swa_insert_ref

    swa_insert_ref(kv, w, 1e-20, pos, inv, slots, got)
    want = cache.clone()
    rec = formats.encode_mxfp8_record(apply_rope(rms_norm(kv, w, 1e-20), pos, inv))
    keep = slots >= 0
    want[slots[keep]] = rec[keep]
    assert torch.equal(got, want)


def test_registered_op_on_cpu_runs_the_reference():
    import vllm_dsv41.ops.swa_insert  # noqa: F401

    kv, w, pos, inv, slots, cache = make_case(5, 64, 16, 20, start=3, seed=1)
    a, b = cache.clone(), cache.clone()
    torch.ops.dsv41.swa_insert(kv, w, 1e-20, pos, inv, slots, a)
    from vllm_dsv41.ops.swa_insert import swa_insert_ref

    swa_insert_ref(kv, w, 1e-20, pos, inv, slots, b)
    assert torch.equal(a, b)


def _kernel_vs_ref(T, D, R, rows, start, seed, device, strided_bf16: bool = False) -> str:
    """``strided_bf16``: kv in bf16 as a column slice of a wider tensor (the fast path's fused [q; kv] GEMM
    output)."""
    from vllm_dsv41.ops.swa_insert import _swa_insert_triton, swa_insert_ref

    kv, w, pos, inv, slots, cache = make_case(T, D, R, rows, start, seed, device)
    if strided_bf16:
        kv = torch.cat((torch.zeros_like(kv[:, :48]), kv), 1).to(torch.bfloat16)[:, 48:]
        assert kv.stride(0) == D + 48
    ref, got = cache.clone(), cache.clone()
    swa_insert_ref(kv.cpu(), w.cpu(), 1e-20, pos.cpu(), inv.cpu(), slots.cpu(), ref_cpu := ref.cpu())
    _swa_insert_triton(kv, w, 1e-20, pos, inv, slots, got)
    return _compare(ref_cpu, got.cpu(), D)


def _interpreter_main() -> int:
    assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 before Python starts"
    failed = 0
    for T, D, R, strided_bf16 in ((7, 64, 16, False), (5, 512, 64, False), (6, 512, 64, True)):
        try:
            got = _kernel_vs_ref(T, D, R, 3 * T, start=0, seed=D, device="cpu", strided_bf16=strided_bf16)
            print(f"  ok D={D} R={R} strided bf16 {strided_bf16}: {got}")
        except AssertionError as e:
            failed += 1
            print(f"FAIL D={D} R={R} strided bf16 {strided_bf16}: {e}")
    return 1 if failed else 0


def test_triton_interpreter():
    run_under_interpreter(["-m", "tests.ops.test_swa_insert", "--interpret"])


@requires_cuda
@pytest.mark.parametrize("strided_bf16", [False, True], ids=["fp32", "strided-bf16"])
@pytest.mark.parametrize("T", [1, 64, 4096])
def test_cuda_real_sizes(T, strided_bf16):
    print(_kernel_vs_ref(T, 512, 64, 2 * T + 7, start=60000, seed=T, device="cuda", strided_bf16=strided_bf16))


if __name__ == "__main__" and "--interpret" in sys.argv:
    sys.exit(_interpreter_main())
