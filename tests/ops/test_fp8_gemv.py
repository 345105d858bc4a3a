"""``dsv41::fp8_gemv``: the one-launch W8A8 GEMM of few rows against its reference and ``w8a8``'s arithmetic."""

import pytest
import torch

from tests.ops.conftest import requires_cuda, run_under_interpreter
from tests.ops.test_fp8_gemm import make_rows
from vllm_dsv41 import formats
from vllm_dsv41.model_executor.linear import w8a8_quantised_ref, w8a8_ref
from vllm_dsv41.ops import fp8_gemv as fv


def test_ref_is_w8a8_for_one_group():
    """One group: the same arithmetic as the ``w8a8`` default (vLLM's per-token quantisation, CUTLASS's GEMM)."""
    x, w8, ws = make_rows(3, 64, 256, 0)
    want = w8a8_ref(x, w8, ws).bfloat16()
    assert torch.equal(fv.fp8_gemv_ref(x, w8, ws), want)
    assert torch.equal(torch.ops.dsv41.fp8_gemv(x, w8, ws), want)  # CPU dispatch: the reference


def test_ref_groups_quantise_their_own_slice():
    """Group g's rows read slice g of x under that slice's own scale (a large value in one slice leaves the others'
    scales alone)."""
    x, w8, ws = make_rows(2, 64, 128, 1)
    x2 = torch.cat([x, 100 * x.roll(1, 1)], 1)
    got = fv.fp8_gemv_ref(x2, w8, ws, 2)
    assert torch.equal(got[:, :32], w8a8_ref(x, w8[:32], ws[:32]).bfloat16())
    assert torch.equal(got[:, 32:], w8a8_ref(100 * x.roll(1, 1), w8[32:], ws[32:]).bfloat16())


def test_q_ref_is_w8a8_on_quantised_rows():
    """The pre-quantised variant: the codes and scales of ``formats.quant_fp8_tokens`` give the bf16-input op's
    result, which is ``w8a8_quantised_ref`` on them."""
    x, w8, ws = make_rows(4, 96, 256, 3)
    q, s = formats.quant_fp8_tokens(x)
    want = w8a8_quantised_ref(q, s, w8, ws).bfloat16()
    assert torch.equal(fv.fp8_gemv_q_ref(q, s, w8, ws), want)
    assert torch.equal(torch.ops.dsv41.fp8_gemv_q(q, s, w8, ws), want)
    assert torch.equal(want, fv.fp8_gemv_ref(x, w8, ws))
    with pytest.raises(ValueError, match="fp8_gemv_q: scale must hold one scale per row of q \\(4\\)"):
        fv.fp8_gemv_q_ref(q, s[:3], w8, ws)
    with pytest.raises(ValueError, match="fp8_gemv_q: x \\[M, 1 x K\\]"):
        fv.fp8_gemv_q_ref(q[:, :128], s, w8, ws)


def test_bad_shapes_name_the_problem():
    x, w8, ws = make_rows(1, 64, 128, 2)
    with pytest.raises(ValueError, match="x \\[M, 2 x K\\]"):
        fv.fp8_gemv_ref(x, w8, ws, 2)
    with pytest.raises(ValueError, match="one scale per weight row"):
        fv.fp8_gemv_ref(x, w8, ws[:10])
    with pytest.raises(ValueError, match="do not split into 3 groups"):
        fv.fp8_gemv_ref(torch.cat([x] * 3, 1), w8, ws, 3)


@pytest.mark.parametrize("N,K,G", [(1792, 5120, 1), (32768, 1280, 1), (5120, 8192, 1), (4608, 5120, 1),
                                   (5120, 2304, 1), (8192, 4096, 8)])
def test_plan_covers_the_gpu_and_whole_k_steps(N, K, G):
    p = fv.plan(1, N, K, 132, G)
    tiles = G * -(-(N // G) // p["BLOCK_N"])
    assert K % p["BLOCK_K"] == 0 and p["k_per_split"] % p["BLOCK_K"] == 0
    assert p["k_per_split"] * p["SPLIT_K"] == K
    assert tiles * p["SPLIT_K"] >= 132 or p["SPLIT_K"] == 16 or p["k_per_split"] < 1024


@pytest.mark.parametrize("prequant", [False, True])
@pytest.mark.parametrize("N,K,split", [(1792, 5120, 8), (32768, 1280, 1), (5120, 8192, 4)])
def test_kernel_builds_for_sm90_without_spills(N, K, split, prequant):
    """The plan compiles for Hopper (Triton's own ptxas, no GPU) with the FP8 tensor-core MMA, everything in
    registers and the weight stream pipelined through shared memory."""
    from tests.ops.conftest import SM90_SHARED_LIMIT, sm90_build

    p = {**fv.plan(1, N, K, 132), "SPLIT_K": split, "k_per_split": K // split}
    sig = {"x_ptr": "*fp8e4nv" if prequant else "*bf16", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "out_ptr": "*bf16", "part_ptr": "*fp32",
           "lock_ptr": "*i32", **{n: "i32" for n in ("M", "N", "K", "NG", "k_per_split", "stride_xm")},
           "floor": "fp32",
           **{n: "constexpr" for n in ("BLOCK_N", "BLOCK_M", "BLOCK_K", "AMAX_K", "SPLIT_K", "THREADS", "INTERPRET",
                                         "PREQUANT")}}
    consts = {k: p[k] for k in ("BLOCK_N", "BLOCK_M", "BLOCK_K", "SPLIT_K")} | {
        "AMAX_K": 8192, "THREADS": 32 * p["num_warps"], "INTERPRET": False, "PREQUANT": prequant}
    fv._bind()
    got = sm90_build(fv._fp8_gemv_kernel, sig, consts, p["num_warps"], p["num_stages"],
                     divisible_by_16=("N", "K", "NG", "k_per_split", "stride_xm"))
    print(f"fp8_gemv N={N} K={K} prequant={prequant} {p}: {got}")
    assert got["stack"] == 0 and got["regs"] <= 255 and got["shared"] <= SM90_SHARED_LIMIT
    assert got["shared"] >= (p["num_stages"] - 1) * p["BLOCK_N"] * p["BLOCK_K"], "the weight loads are not pipelined"


# (M, N, K, groups, config override)
INTERPRET_CASES = [
    (1, 64, 256, 1, None),
    (3, 96, 512, 1, {"SPLIT_K": 2, "k_per_split": 256}),
    (16, 128, 128, 1, None),
    (2, 64, 96, 1, None),  # K not a multiple of 128: 32-wide steps
    (1, 128, 256, 2, None),
    (5, 256, 384, 4, {"SPLIT_K": 3, "k_per_split": 128}),
]

_RUNNER = """
import sys, torch
from tests.ops import test_fp8_gemv as t
from tests.ops.test_fp8_gemm import make_rows
from vllm_dsv41 import formats
from vllm_dsv41.ops import fp8_gemv as fv
bad = []
for i, (M, N, K, G, cfg) in enumerate(t.INTERPRET_CASES):
    x, w8, ws = make_rows(M, N, K, seed=i)
    x = torch.cat([x] + [(j + 1) * x.roll(j, 1) for j in range(1, G)], 1)  # [M, G*K]: slices of other scales
    want = fv.fp8_gemv_ref(x.float(), w8, ws, G)  # fp32: the same codes (bf16 values), no rounding
    for rep in range(2):  # the second launch finds the counters reset by the first
        got = fv._fp8_gemv_triton(x, w8, ws, G, config=cfg)
        err = ((got.float() - want).abs() / (want.abs() + 1e-3 * want.abs().max())).max().item()
        ok = got.dtype == torch.bfloat16 and got.shape == want.shape and err <= 1.01 * 2 ** -7
        print(f"{'ok' if ok else 'FAIL'} M={M} N={N} K={K} groups={G} cfg={cfg} launch {rep}: max rel err {err:.2e}")
        bad += [] if ok else [i]
    if G == 1:  # the pre-quantised variant on the reference's own codes: the same products, exactly
        q, s = formats.quant_fp8_tokens(x.float())
        want_q = fv.fp8_gemv_q_ref(q, s, w8, ws).float()
        got = fv._fp8_gemv_q_triton(q, s, w8, ws, config=cfg)
        err = ((got.float() - want_q).abs() / (want_q.abs() + 1e-3 * want_q.abs().max())).max().item()
        ok = got.dtype == torch.bfloat16 and err <= 1.01 * 2 ** -7
        print(f"{'ok' if ok else 'FAIL'} prequant M={M} N={N} K={K} cfg={cfg}: max rel err {err:.2e}")
        bad += [] if ok else [i]
    if fv._LOCKS and any(int(b.abs().sum()) for b in fv._LOCKS.values()):
        print("FAIL: arrival counters not reset"); bad.append(i)
sys.exit(1 if bad else 0)
"""


def test_triton_interpreter():
    """Every case within one bf16 ulp of the fp32 reference (the interpreter's bf16 cast truncates): the same E4M3 codes of x and w, exact
    products, fp32 sums in another order; split launches sum their partials and leave the counters at zero."""
    run_under_interpreter(["-c", _RUNNER])


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 2, 16])
@pytest.mark.parametrize("N,K,G", [(1792, 5120, 1), (32768, 1280, 1), (5120, 8192, 1), (4608, 5120, 1),
                                   (5120, 2304, 1), (8192, 4096, 8)])
def test_cuda_bench_shapes(M, N, K, G):
    x, w8, ws = make_rows(M, N, K, seed=M + N, device="cuda")
    x = torch.randn(M, G * K, device="cuda").bfloat16() if G > 1 else x
    want = fv.fp8_gemv_ref(x.cpu().float(), w8.cpu(), ws.cpu(), G).cuda()  # fp32: one bf16 rounding apart
    # one bf16 rounding apart, and now and then an E4M3 code of x one step off (the kernel's approximate division)
    for _ in range(3):  # repeated launches: counters reset, no race between a tile's programs
        got = torch.ops.dsv41.fp8_gemv(x, w8, ws, G).float()
        err = ((got - want).norm() / want.norm()).item()
        assert err < 6e-3, f"M={M} N={N} K={K} G={G}: rel err {err:.2e}"


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 16])
@pytest.mark.parametrize("N,K", [(1792, 5120), (32768, 1280), (5120, 8192)])
def test_cuda_prequantised(M, N, K):
    """The pre-quantised variant on the GPU: the codes are given, so only the fp32 sums' order and the bf16 output
    rounding separate it from the reference."""
    x, w8, ws = make_rows(M, N, K, seed=M * N, device="cuda")
    q, s = formats.quant_fp8_tokens(x)
    want = fv.fp8_gemv_q_ref(q.cpu(), s.cpu(), w8.cpu(), ws.cpu()).float().cuda()
    for _ in range(3):
        got = torch.ops.dsv41.fp8_gemv_q(q, s, w8, ws).float()
        err = ((got - want).norm() / want.norm()).item()
        assert err < 3e-3, f"M={M} N={N} K={K}: rel err {err:.2e}"


@requires_cuda
@pytest.mark.gpu
def test_cuda_two_streams_at_once():
    """Launches on two streams that may overlap (the model's side stream) each keep their own counters: both results
    equal the serial ones, repeatedly."""
    x, w8, ws = make_rows(1, 5120, 8192, seed=7, device="cuda")
    x2, w82, ws2 = make_rows(1, 1792, 5120, seed=8, device="cuda")
    want, want2 = torch.ops.dsv41.fp8_gemv(x, w8, ws), torch.ops.dsv41.fp8_gemv(x2, w82, ws2)
    side = torch.cuda.Stream()
    for _ in range(20):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            got2 = torch.ops.dsv41.fp8_gemv(x2, w82, ws2)
        got = torch.ops.dsv41.fp8_gemv(x, w8, ws)
        torch.cuda.current_stream().wait_stream(side)
        assert torch.equal(got, want) and torch.equal(got2, want2)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("N,K,G", [(1792, 5120, 1), (5120, 8192, 1), (8192, 4096, 8)])
def test_cuda_prefetch_first_is_bitwise(monkeypatch, N, K, G):
    """``VLLM_DSV41_PDL_PREFETCH=1`` without PDL: the weight block asked of L2 before the amax pass changes when bytes
    move, not one output bit."""
    monkeypatch.setenv("VLLM_DSV41_PDL", "0")
    x = torch.randn(1, G * K, device="cuda").bfloat16()
    _, w8, ws = make_rows(1, N, K, seed=N + K, device="cuda")
    monkeypatch.setenv(fv.PREFETCH_ENV, "0")
    off = torch.ops.dsv41.fp8_gemv(x, w8, ws, G)
    monkeypatch.setenv(fv.PREFETCH_ENV, "1")
    on = torch.ops.dsv41.fp8_gemv(x, w8, ws, G)
    assert torch.equal(off, on)
