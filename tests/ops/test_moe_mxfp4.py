"""``dsv41::moe_mxfp4`` (experimental MXFP4 MoE) against its reference and the model's own expert loop (the
Triton kernel in the interpreter on CPU and compiled on CUDA).  ``python -m tests.ops.test_moe_mxfp4 --interpret``
is the interpreter run."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch import nn

from tests.ops.conftest import SM90_SHARED_LIMIT, assert_close, requires_cuda, run_under_interpreter, sm90_build
from vllm_dsv41 import formats


def make_case(T: int, H: int, I: int, E: int, k: int, device: str = "cpu", seed: int = 0):
    """Random MXFP4 experts, inputs and routing, made on ``device`` (the bench shapes are too big for the CPU)."""
    g = torch.Generator(device=device).manual_seed(seed)
    w13, s13 = formats.quant_mxfp4(torch.randn(E, 2 * I, H, generator=g, device=device) * 0.05)
    w2, s2 = formats.quant_mxfp4(torch.randn(E, H, I, generator=g, device=device) * 0.05)
    x = torch.randn(T, H, generator=g, device=device) * 4
    idx = torch.rand(T, E, generator=g, device=device).argsort(1)[:, :k]  # k distinct experts per token
    wts = torch.rand(T, k, generator=g, device=device)
    return x, w13.view(torch.uint8), formats.as_uint8(s13), w2.view(torch.uint8), formats.as_uint8(s2), idx, wts


def experts_from_stack(w13, s13, w2, s2) -> nn.ModuleList:
    """The model's quantised :class:`Expert` modules holding a stacked case's bytes (w13 = [w1; w3])."""
    from vllm_dsv41.model_executor.linear import Expert

    E, I2, H2 = w13.shape
    I = I2 // 2
    experts = nn.ModuleList(Expert(2 * H2, I, quant=True) for _ in range(E))
    for e, ex in enumerate(experts):
        ex.w1.weight.data.copy_(w13[e, :I].view(torch.int8))
        ex.w3.weight.data.copy_(w13[e, I:].view(torch.int8))
        ex.w1.scale.data.copy_(s13[e, :I])
        ex.w3.scale.data.copy_(s13[e, I:])
        ex.w2.weight.data.copy_(w2[e].view(torch.int8))
        ex.w2.scale.data.copy_(s2[e])
    return experts


@pytest.mark.parametrize("T,k,E,block", [(1, 6, 32, 16), (5, 2, 4, 16), (64, 6, 32, 16), (3, 3, 8, 4)])
def test_align_by_expert(T, k, E, block):
    from vllm_dsv41.ops.moe_mxfp4 import align_by_expert

    g = torch.Generator().manual_seed(T * k)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    ids, experts = align_by_expert(idx, E, block)
    n = T * k
    assert ids.numel() % block == 0 and ids.numel() == experts.numel() * block
    real = ids[ids < n]
    assert sorted(real.tolist()) == list(range(n)), "every (token, slot) exactly once"
    flat = idx.reshape(-1)
    for b, e in enumerate(experts.tolist()):
        rows = ids[b * block:(b + 1) * block]
        rows = rows[rows < n]
        if e < 0:
            assert rows.numel() == 0
        else:
            assert (flat[rows.long()] == e).all(), f"block {b} mixes experts"
    assert (ids[ids >= n] == n).all()


def test_cpu_op_is_the_reference():
    import vllm_dsv41.ops.moe_mxfp4  # noqa: F401
    from vllm_dsv41.ops.moe_mxfp4 import moe_mxfp4_ref

    case = make_case(5, 64, 64, 4, 2)
    assert torch.equal(torch.ops.dsv41.moe_mxfp4(*case, 1.5), moe_mxfp4_ref(*case, 1.5))


def test_bad_shapes_name_the_tensor():
    from vllm_dsv41.ops.moe_mxfp4 import moe_mxfp4_ref

    x, w13, s13, w2, s2, idx, wts = make_case(3, 64, 64, 4, 2)
    with pytest.raises(ValueError, match=r"s13 \(4, 128, 1\), expected \(4, 128, 2\)"):
        moe_mxfp4_ref(x, w13, s13[..., :1], w2, s2, idx, wts, 1.0)
    with pytest.raises(ValueError, match="wts"):
        moe_mxfp4_ref(x, w13, s13, w2, s2, idx, wts[:, :1], 1.0)


def test_reference_is_the_models_expert_loop():
    """The op's maths is the model's routed-expert reference (``linear.loop_moe`` over the same MXFP4 experts),
    with a clamp limit that bites."""
    from vllm_dsv41.model_executor.linear import loop_moe
    from vllm_dsv41.ops.moe_mxfp4 import moe_mxfp4_ref

    T, H, I, E, k, limit = 6, 64, 64, 4, 2, 0.5
    x, w13, s13, w2, s2, idx, wts = make_case(T, H, I, E, k)
    experts = experts_from_stack(w13, s13, w2, s2)
    want = loop_moe(x, experts, idx, wts, limit)
    got = moe_mxfp4_ref(x, w13, s13, w2, s2, idx, wts, limit)
    assert_close("moe_mxfp4_ref vs loop_moe", want, got, ratio=1e-6)


def _kernel_vs_ref(T, H, I, E, k, device, dtype=torch.float32, limit=2.0, kernel="swapab"):
    """The interpreter multiplies in fp32 (tight bound); compiled, the kernel rounds A (x, then the activation)
    to bf16 for its tensor-core dots, which the reference does for x only."""
    from vllm_dsv41.ops.moe_mxfp4 import _moe_mxfp4_triton, moe_mxfp4_ref

    case = make_case(T, H, I, E, k, device, seed=T + E)
    x = case[0].to(dtype)
    got = _moe_mxfp4_triton(x, *case[1:], limit, kernel)
    xr = x.float() if device == "cpu" else x.to(torch.bfloat16).float()
    ref = moe_mxfp4_ref(xr, *case[1:], limit)
    assert got.dtype == dtype and got.shape == (T, H)
    tight = device == "cpu" and dtype == torch.float32
    assert_close(f"moe_mxfp4 ({kernel}) T={T} H={H} I={I} E={E} k={k} {dtype}", ref.cpu(), got.cpu().float(),
                 ratio=1e-5 if tight else 2e-2)


def _interpreter_main() -> int:
    assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 before Python starts"
    for kernel in ("swapab", "blocked"):
        _kernel_vs_ref(5, 64, 64, 4, 2, "cpu", kernel=kernel)
        _kernel_vs_ref(1, 128, 64, 8, 3, "cpu", kernel=kernel)
        _kernel_vs_ref(19, 64, 128, 3, 2, "cpu", torch.bfloat16, kernel=kernel)
        _kernel_vs_ref(4, 96, 32, 4, 2, "cpu", kernel=kernel)  # K = 96 and 32: 32-wide K steps
        _kernel_vs_ref(70, 64, 64, 4, 2, "cpu", kernel=kernel)  # 140 pairs over 4 experts: 64-row blocks
        _kernel_vs_ref(3, 64, 160, 2, 2, "cpu", kernel=kernel)  # N = 2I = 320 > 128: several row blocks
    return 0


def test_triton_interpreter():
    run_under_interpreter(["-m", "tests.ops.test_moe_mxfp4", "--interpret"])


@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("K", [5120, 2304, 96, 32])
def test_kernel_builds_for_sm90_without_spills(block_m, K):
    """The launch configs ``_grouped_gemm`` uses compile for Hopper (Triton's own ptxas, no GPU needed) and keep
    every value in registers: a spill would be local-memory traffic inside the weight stream."""
    from vllm_dsv41.ops import moe_mxfp4 as m

    sig = {"a_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*u8", "c_ptr": "*bf16", "ids_ptr": "*i32", "experts_ptr": "*i32",
           "wts_ptr": "*fp32", **{n: "i32" for n in ("N", "K", "a_row_div", "n_valid", "stride_am", "stride_we",
                                                     "stride_wn", "stride_se", "stride_sn", "stride_cm")},
           **{n: "constexpr" for n in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "MUL_W", "BF16_DOT")}}
    cfg = m.launch_config(block_m, K)
    num_warps = cfg.pop("num_warps")
    got = sm90_build(m._kernels(), sig, {**cfg, "MUL_W": True, "BF16_DOT": True}, num_warps)
    print(f"moe_mxfp4 kernel, {cfg}, {num_warps} warps: {got}")
    assert got["stack"] == 0 and got["regs"] <= 255 and got["shared"] <= SM90_SHARED_LIMIT


@pytest.mark.parametrize("block_m", [16, 64])
def test_swapab_kernel_builds_for_sm90_without_spills(block_m):
    """Built for Hopper as a launch at the bench shapes specialises it (aligned pointers and strides): no spills,
    and the weight stream pipelined."""
    from vllm_dsv41.ops import moe_mxfp4 as m

    sig = {"a_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*u8", "c_ptr": "*bf16", "ids_ptr": "*i32", "experts_ptr": "*i32",
           "wts_ptr": "*fp32", **{n: "i32" for n in ("N", "K", "a_row_div", "n_valid", "stride_am", "stride_we",
                                                     "stride_wn", "stride_se", "stride_sn", "stride_cm")},
           **{n: "constexpr" for n in ("BLOCK_M", "BLOCK_N", "MUL_W", "BF16_DOT", "HW_FP8")}}
    consts = {"BLOCK_M": block_m, "BLOCK_N": m.SWAPAB_BLOCK_N, "MUL_W": True, "BF16_DOT": True, "HW_FP8": True}
    got = sm90_build(m._swapab_kernel(), sig, consts, 8, m.SWAPAB_STAGES,
                     divisible_by_16=("N", "K", "stride_am", "stride_we", "stride_wn", "stride_se", "stride_sn",
                                      "stride_cm"))
    print(f"moe_mxfp4 swapab kernel, {consts}: {got}")
    assert got["stack"] == 0 and got["regs"] <= 255 and got["shared"] <= SM90_SHARED_LIMIT
    # the weight bytes (16 per row and step) go through the pipeline's shared-memory stages
    assert got["shared"] >= (m.SWAPAB_STAGES - 1) * m.SWAPAB_BLOCK_N * 16, "the weight loads are not pipelined"


@requires_cuda
@pytest.mark.parametrize("kernel", ["swapab", "blocked"])
@pytest.mark.parametrize("T", [1, 16, 64, 512, 4096])
def test_cuda_real_sizes(T, kernel):
    _kernel_vs_ref(T, 5120, 2304, 32, 6, "cuda", torch.bfloat16, limit=10.0, kernel=kernel)


if __name__ == "__main__" and "--interpret" in sys.argv:
    sys.exit(_interpreter_main())
