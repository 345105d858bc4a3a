"""torch.ops.dsv41.fp8_gemm: the reference against the dequantised product (CPU), the Triton kernel in the
interpreter (subprocess, CPU tensors; fp32 dots on the same bf16 operands) and on CUDA at the bench shapes."""

from __future__ import annotations

import pytest
import torch

from tests.ops.conftest import requires_cuda, run_under_interpreter
from vllm_dsv41 import formats
from vllm_dsv41.ops import fp8_gemm as fg


def make(M: int, N: int, K: int, seed: int, device: str = "cpu"):
    """bf16 x, and an FP8 weight with spread-out 32x32 scales (quantised from a random matrix, so every
    E4M3 code class, subnormals included, occurs)."""
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(N, K, generator=g) * torch.exp(2.0 * torch.randn(N // 32, 1, K // 32, 1, generator=g)
                                                      ).expand(-1, 32, -1, 32).reshape(N, K)
    w, s = formats.quant_fp8_block(dense, 32)
    x = torch.randn(M, K, generator=g).bfloat16()
    return x.to(device), formats.as_uint8(w).to(device), formats.as_uint8(s).to(device)


def test_ref_is_the_dequantised_product():
    x, w, s = make(3, 64, 96, 0)
    want = (x.float() @ formats.dequant_fp8_block(w, s, 32).t()).bfloat16()
    assert torch.equal(fg.fp8_gemm_ref(x, w, s), want)
    assert torch.equal(torch.ops.dsv41.fp8_gemm(x, w, s), want)  # CPU dispatch: the reference


def test_ref_groups_are_independent_linears():
    x, w, s = make(4, 128, 64, 2)
    x2 = torch.cat((x, -2 * x), 1)
    wd = formats.dequant_fp8_block(w, s, 32)
    want = torch.cat((x.float() @ wd[:64].t(), (-2 * x).float() @ wd[64:].t()), 1).bfloat16()
    assert torch.equal(fg.fp8_gemm_ref(x2, w, s, 2), want)
    assert torch.equal(torch.ops.dsv41.fp8_gemm(x2, w, s, 2), want)


def test_bad_shapes_name_the_problem():
    x, w, s = make(2, 64, 64, 1)
    with pytest.raises(ValueError, match="multiples of 32"):
        fg.fp8_gemm_ref(x[:, :40], w[:, :40], s)
    with pytest.raises(ValueError, match="scale must be"):
        fg.fp8_gemm_ref(x, w, s[:1])
    with pytest.raises(ValueError, match="x \\[M, 2 x K\\]"):
        fg.fp8_gemm_ref(x, w, s, 2)


def test_plan_covers_the_gpu_and_whole_k_steps():
    for N, K in ((1792, 5120), (32768, 1280), (5120, 8192), (8192, 4096), (5120, 2304)):
        p = fg.plan(64, N, K, 132)
        assert p["k_per_split"] % 32 == 0 and (p["SPLIT_K"] - 1) * p["k_per_split"] < K <= p["SPLIT_K"] * p["k_per_split"]
        assert -(-N // p["BLOCK_N"]) * p["SPLIT_K"] >= 66, (N, K, p)  # at least half the SMs busy
    assert fg.plan(1, 1792, 5120, 132)["BLOCK_M"] == 16 and fg.plan(64, 1792, 5120, 132)["BLOCK_M"] == 64


@pytest.mark.parametrize("M,N,K", [(1, 1792, 5120), (64, 1792, 5120), (64, 32768, 1280), (16, 5120, 8192)])
def test_kernel_builds_for_sm90_without_spills(M, N, K):
    """The launch parameters :func:`plan` picks compile for Hopper (Triton's own ptxas, no GPU; the bench shapes'
    alignments) with every value in registers and the weight stream pipelined through shared memory."""
    from tests.ops.conftest import SM90_SHARED_LIMIT, sm90_build

    p = fg.plan(M, N, K, 132)
    out = "*bf16" if p["SPLIT_K"] == 1 else "*fp32"
    sig = {"x_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*u8", "part_ptr": out,
           **{n: "i32" for n in ("M", "N", "K", "k_per_split", "NG", "stride_xm", "stride_wn", "stride_sn",
                                 "stride_pm")},
           **{n: "constexpr" for n in ("BLOCK_N", "BLOCK_M", "SPLIT_K", "HW_FP8", "DOT_F32")}}
    consts = {"BLOCK_N": p["BLOCK_N"], "BLOCK_M": p["BLOCK_M"], "SPLIT_K": p["SPLIT_K"], "HW_FP8": True,
              "DOT_F32": False}
    got = sm90_build(fg._fp8_gemm_kernel, sig, consts, p["num_warps"], p["num_stages"],
                     divisible_by_16=("N", "K", "k_per_split", "NG", "stride_xm", "stride_wn", "stride_pm"))
    print(f"fp8_gemm M={M} N={N} K={K} {p}: {got}")
    assert got["stack"] == 0 and got["regs"] <= 255 and got["shared"] <= SM90_SHARED_LIMIT
    assert got["shared"] >= (p["num_stages"] - 1) * p["BLOCK_N"] * 32, "the weight loads are not pipelined"


# (M, N, K, groups, config override)
INTERPRET_CASES = [
    (1, 64, 96, 1, None),
    (5, 96, 256, 1, {"SPLIT_K": 3, "k_per_split": 96}),
    (16, 128, 128, 1, {"BLOCK_N": 64, "num_warps": 4}),
    (64, 64, 320, 1, None),
    (33, 192, 64, 1, {"SPLIT_K": 2, "k_per_split": 32}),
    # the grouped wo_a: 2 and 8 groups, one with split K
    (3, 128, 64, 2, None),
    (9, 256, 96, 8, {"SPLIT_K": 3, "k_per_split": 32}),
]

_RUNNER = """
import sys, torch
from tests.ops import test_fp8_gemm as t
from vllm_dsv41.ops import fp8_gemm as fg
bad = []
for i, (M, N, K, G, cfg) in enumerate(t.INTERPRET_CASES):
    x, w, s = t.make(M, N, K, seed=i)
    x = torch.cat([x] + [x.roll(j, 1) for j in range(1, G)], 1)  # [M, G*K]: a different slice per group
    got = fg._fp8_gemm_triton(x, w, s, G, config=cfg)
    wd = t.formats.dequant_fp8_block(w, s, 32)
    want = torch.cat([x[:, g * K:(g + 1) * K].float() @ wd[g * (N // G):(g + 1) * (N // G)].t() for g in range(G)], 1)
    err = ((got.float() - want).abs() / (want.abs() + 1e-3 * want.abs().max())).max().item()
    ok = got.dtype == torch.bfloat16 and got.shape == want.shape and err <= 1.01 * 2 ** -7
    print(f"{'ok' if ok else 'FAIL'} M={M} N={N} K={K} groups={G} cfg={cfg}: max rel err {err:.2e}")
    bad += [] if ok else [i]
sys.exit(1 if bad else 0)
"""


def test_triton_interpreter():
    """Every case within one bf16 ulp (2^-7 relative) of the fp32 product: the kernel's products and scales are
    exact, its sums fp32 in another order, then one conversion to bf16 (the interpreter truncates there, the GPU
    rounds to nearest)."""
    run_under_interpreter(["-c", _RUNNER])


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 16, 64])
@pytest.mark.parametrize("N,K", [(1792, 5120), (32768, 1280), (5120, 8192), (8192, 4096), (4608, 5120)])
def test_cuda_bench_shapes(M, N, K):
    x, w, s = make(M, N, K, seed=M + N, device="cuda")
    got = torch.ops.dsv41.fp8_gemm(x, w, s).float()
    want = x.float() @ formats.dequant_fp8_block(w, s, 32).t()
    err = ((got - want).norm() / want.norm()).item()
    assert err < 4e-3, f"M={M} N={N} K={K}: rel err {err:.2e}"


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 16, 64])
def test_cuda_grouped_wo_a(M):
    """The bench's grouped wo_a: 8 groups of 1024 rows over 4096 inputs each."""
    x, w, s = make(M, 8192, 4096, seed=M, device="cuda")
    xg = torch.randn(M, 8 * 4096, device="cuda").bfloat16()
    got = torch.ops.dsv41.fp8_gemm(xg, w, s, 8).float()
    want = fg.fp8_gemm_ref(xg.cpu(), w.cpu(), s.cpu(), 8).float().cuda()
    err = ((got - want).norm() / want.norm()).item()
    assert err < 4e-3, f"M={M}: rel err {err:.2e}"
