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


# --------------------------------------------------------------------------- fp8_rows_gemm (the w8a8 weights)


def make_rows(M: int, N: int, K: int, seed: int, device: str = "cpu"):
    """bf16 x and a weight as ``w8a8`` keeps it: the 32x32-tile FP8 of :func:`make` re-scaled to one power of two per
    row (``formats.fp8_block_to_rows``)."""
    x, w, s = make(M, N, K, seed)
    w8, ws = formats.fp8_block_to_rows(w.view(torch.float8_e4m3fn), s.view(torch.float8_e8m0fnu))
    return x.to(device), w8.to(device), ws.to(device)


def test_rows_ref_is_the_row_scaled_product():
    x, w8, ws = make_rows(3, 64, 256, 0)
    want = (x.float() @ (w8.float() * ws.reshape(-1, 1)).t()).bfloat16()
    assert torch.equal(fg.fp8_rows_gemm_ref(x, w8, ws), want)
    assert torch.equal(torch.ops.dsv41.fp8_rows_gemm(x, w8, ws), want)  # CPU dispatch: the reference
    x2 = torch.cat((x, -x), 1)
    want2 = torch.cat((x.float() @ (w8[:32].float() * ws[:32]).t(), -x.float() @ (w8[32:].float() * ws[32:]).t()), 1)
    assert torch.equal(fg.fp8_rows_gemm_ref(x2, w8, ws, 2), want2.bfloat16())


def test_rows_bad_shapes_name_the_problem():
    x, w8, ws = make_rows(2, 64, 128, 1)
    with pytest.raises(ValueError, match="w_scale must hold one scale per weight row"):
        fg.fp8_rows_gemm_ref(x, w8, ws[:10])
    with pytest.raises(ValueError, match="x \\[M, 3 x K\\]"):
        fg.fp8_rows_gemm_ref(x, w8, ws, 3)


def test_rows_plan_covers_the_gpu_and_whole_k_steps():
    for M, N, K, G in ((1, 1792, 5120, 1), (64, 32768, 1280, 1), (64, 5120, 8192, 1), (16, 5120, 2304, 1),
                       (64, 8192, 4096, 8), (1, 4608, 5120, 1)):
        p = fg.rows_plan(M, N, K, 132, G)
        assert p["k_per_split"] % p["BLOCK_K"] == 0 and K % p["BLOCK_K"] == 0
        assert (p["SPLIT_K"] - 1) * p["k_per_split"] < K <= p["SPLIT_K"] * p["k_per_split"], (M, N, K, p)
        assert G * -(-(N // G) // p["BLOCK_N"]) * p["SPLIT_K"] >= 132, (M, N, K, p)  # every SM has a program
        assert p["BLOCK_M"] >= max(16, M)


@pytest.mark.parametrize("M,N,K,G", [(1, 1792, 5120, 1), (64, 1792, 5120, 1), (64, 32768, 1280, 1),
                                     (64, 8192, 4096, 8)])
def test_rows_kernel_builds_for_sm90_without_spills(M, N, K, G):
    """:func:`rows_plan`'s parameters compile for Hopper (Triton's own ptxas, no GPU) with the hardware E4M3
    conversion, every value in registers and the weight stream pipelined through shared memory."""
    from tests.ops.conftest import SM90_SHARED_LIMIT, sm90_build

    p = fg.rows_plan(M, N, K, 132, G)
    out = "*bf16" if p["SPLIT_K"] == 1 else "*fp32"
    sig = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "part_ptr": out,
           **{n: "i32" for n in ("M", "N", "K", "k_per_split", "NG", "stride_xm", "stride_wn", "stride_pm")},
           **{n: "constexpr" for n in ("BLOCK_N", "BLOCK_M", "BLOCK_K", "SPLIT_K", "HW_FP8", "DOT_F32")}}
    consts = {k: p[k] for k in ("BLOCK_N", "BLOCK_M", "BLOCK_K", "SPLIT_K")} | {"HW_FP8": True, "DOT_F32": False}
    got = sm90_build(fg._fp8_rows_kernel, sig, consts, p["num_warps"], p["num_stages"],
                     divisible_by_16=("N", "K", "k_per_split", "NG", "stride_xm", "stride_wn", "stride_pm"))
    print(f"fp8_rows_gemm M={M} N={N} K={K} G={G} {p}: {got}")
    assert got["stack"] == 0 and got["regs"] <= 255 and got["shared"] <= SM90_SHARED_LIMIT
    assert got["shared"] >= (p["num_stages"] - 1) * p["BLOCK_N"] * p["BLOCK_K"], "the weight loads are not pipelined"


# (M, N, K, groups, config override)
ROWS_INTERPRET_CASES = [
    (1, 64, 256, 1, None),
    (5, 96, 512, 1, {"SPLIT_K": 2, "k_per_split": 256}),
    (16, 128, 128, 1, {"BLOCK_N": 64, "num_warps": 4}),
    (64, 64, 96, 1, None),  # K not a multiple of 128: 32-wide steps
    (3, 128, 256, 2, None),
    (9, 256, 384, 8, {"SPLIT_K": 3, "k_per_split": 128}),
]

_ROWS_RUNNER = """
import sys, torch
from tests.ops import test_fp8_gemm as t
from vllm_dsv41.ops import fp8_gemm as fg
bad = []
for i, (M, N, K, G, cfg) in enumerate(t.ROWS_INTERPRET_CASES):
    x, w8, ws = t.make_rows(M, N, K, seed=i)
    x = torch.cat([x] + [x.roll(j, 1) for j in range(1, G)], 1)  # [M, G*K]: a different slice per group
    got = fg._fp8_rows_gemm_triton(x, w8, ws, G, config=cfg)
    want = fg.fp8_rows_gemm_ref(x, w8, ws, G).float()
    exact = torch.cat([x[:, g * K:(g + 1) * K].float() @ (w8.float() * ws.reshape(-1, 1))[g * (N // G):(g + 1) * (N // G)].t()
                       for g in range(G)], 1)
    err = ((got.float() - exact).abs() / (exact.abs() + 1e-3 * exact.abs().max())).max().item()
    ok = got.dtype == torch.bfloat16 and got.shape == want.shape and err <= 1.01 * 2 ** -7
    print(f"{'ok' if ok else 'FAIL'} M={M} N={N} K={K} groups={G} cfg={cfg}: max rel err {err:.2e}")
    bad += [] if ok else [i]
sys.exit(1 if bad else 0)
"""


def test_rows_triton_interpreter():
    """Every case within one bf16 ulp of the fp32 product of the row-scaled weight (exact products and power-of-two
    scales, fp32 sums in another order, one conversion to bf16)."""
    run_under_interpreter(["-c", _ROWS_RUNNER])


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 16, 64])
@pytest.mark.parametrize("N,K,G", [(1792, 5120, 1), (32768, 1280, 1), (5120, 8192, 1), (4608, 5120, 1),
                                   (5120, 2304, 1), (8192, 4096, 8)])
def test_cuda_rows_bench_shapes(M, N, K, G):
    x, w8, ws = make_rows(M, N, K, seed=M + N, device="cuda")
    x = torch.randn(M, G * K, device="cuda").bfloat16() if G > 1 else x
    got = torch.ops.dsv41.fp8_rows_gemm(x, w8, ws, G).float()
    want = fg.fp8_rows_gemm_ref(x.cpu(), w8.cpu(), ws.cpu(), G).float().cuda()
    err = ((got - want).norm() / want.norm()).item()
    assert err < 4e-3, f"M={M} N={N} K={K} G={G}: rel err {err:.2e}"
