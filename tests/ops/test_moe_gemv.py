"""``dsv41::moe_gemv`` (the few-token MXFP4 experts on MXFP8 activations) against its reference, the reference against
a pair-by-pair formulation, the kernels in Triton's interpreter on CPU, built for sm_90 without a GPU, and compiled on
CUDA.  ``python -m tests.ops.test_moe_gemv --interpret`` is the interpreter run."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.ops.conftest import SM90_SHARED_LIMIT, requires_cuda, run_under_interpreter, sm90_build
from tests.ops.test_moe_mxfp4 import make_case
from vllm_dsv41 import formats
from vllm_dsv41.ops import moe_gemv as mg
from vllm_dsv41.ops.moe_mxfp4 import moe_mxfp4_ref
from vllm_dsv41.reference.model import clamped_swiglu_act

LIMIT = 10.0


def pairwise(x, w13, s13, w2, s2, idx, wts, limit):
    """The op's definition written pair by pair: token t's slot j through expert idx[t, j] on the MXFP8 records of x
    and of h, weighted and summed over the slots."""
    T, H = x.shape
    I = w13.shape[1] // 2
    y = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        xq = formats.decode_mxfp8_record(formats.encode_mxfp8_record(x[t].float()), H)
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            ab = formats.dequant_mxfp4(w13[e], s13[e]) @ xq
            h = clamped_swiglu_act(ab[:I], ab[I:], limit)
            hq = formats.decode_mxfp8_record(formats.encode_mxfp8_record(h), I)
            y[t] += float(wts[t, j]) * (formats.dequant_mxfp4(w2[e], s2[e]) @ hq).double()
    return y


@pytest.mark.parametrize("T,H,I,E,k", [(1, 64, 32, 4, 2), (3, 96, 64, 5, 3), (2, 128, 64, 8, 1)])
def test_ref_is_the_pairwise_definition(T, H, I, E, k):
    case = make_case(T, H, I, E, k, seed=T + k)
    got = mg.moe_gemv_ref(*case, LIMIT)
    want = pairwise(*case, LIMIT)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert torch.equal(torch.ops.dsv41.moe_gemv(*case, LIMIT), got)  # CPU dispatch: the reference


def test_ref_differs_from_bf16_activations_by_mxfp8_rounding_only():
    """MXFP8 activations (E4M3 under a power-of-two scale per 32) against the unquantised ones of ``moe_mxfp4_ref``: a
    few per cent apart (two roundings of three mantissa bits), not more; the swap of x and h quantisation would not
    be."""
    case = make_case(4, 256, 128, 8, 3, seed=5)
    got, base = mg.moe_gemv_ref(*case, LIMIT), moe_mxfp4_ref(*case, LIMIT)
    err = ((got - base).norm() / base.norm()).item()
    assert 1e-3 < err < 0.08, err


def test_bad_shapes_name_the_tensor():
    x, w13, s13, w2, s2, idx, wts = make_case(2, 64, 32, 4, 2)
    with pytest.raises(ValueError, match="moe_mxfp4: s2 "):
        mg.moe_gemv_ref(x, w13, s13, w2, s2[:, :1], idx, wts, LIMIT)
    with pytest.raises(ValueError, match="moe_mxfp4: wts "):
        mg.moe_gemv_ref(x, w13, s13, w2, s2, idx, wts[:, :1], LIMIT)


@pytest.mark.parametrize("H,I", [(5120, 2304), (512, 256), (96, 64), (64, 32)])
def test_plan_tiles_whole_groups(H, I):
    p = mg.plan(H, I)
    assert p["UP_BLOCK_N"] % 32 == 0 and p["DOWN_BLOCK_N"] % 32 == 0
    assert (H // 32) % p["UP_SPLIT_K"] == 0


# (T, H, I, E, k, config override)
INTERPRET_CASES = [
    (1, 128, 64, 4, 2, None),                                                  # plan: one partial tile each GEMM
    (3, 96, 64, 5, 3, {"UP_BLOCK_N": 32, "DOWN_BLOCK_N": 32, "UP_G": 1, "DOWN_G": 2}),  # one group a tile
    (2, 64, 128, 3, 1, None),                                                  # one slot: no reduction
    (2, 256, 128, 6, 6, {"UP_BLOCK_N": 128, "DOWN_BLOCK_N": 64, "UP_SPLIT_K": 4, "UP_G": 2, "DOWN_G": 4}),
    (1, 512, 192, 4, 3, {"UP_SPLIT_K": 2, "UP_G": 8, "DOWN_G": 16}),          # 16 groups: K split; 6 of a 16-tile
    (2, 320, 96, 4, 2, {"UP_G": 4, "DOWN_G": 2, "UP_SPLIT_K": 3}),            # 10 groups in tiles of 4 (ragged)
]

_TOL = 1e-2


def _interpret() -> int:
    """Each case twice (the second launch finds the counters reset by the first) against the fp32 reference: one
    bf16 rounding of the output, fp32 sums in another order, and now and then an E4M3 code of h one step off (the
    kernel's exp and division are not torch's)."""
    bad = []
    for i, (T, H, I, E, k, cfg) in enumerate(INTERPRET_CASES):
        x, w13, s13, w2, s2, idx, wts = make_case(T, H, I, E, k, seed=i)
        x = x.bfloat16()
        want = mg.moe_gemv_ref(x.float(), w13, s13, w2, s2, idx, wts, LIMIT)
        for rep in range(2):
            got = mg._moe_gemv_triton(x, w13, s13, w2, s2, idx, wts, LIMIT, config=cfg)
            err = ((got.float() - want).norm() / want.norm()).item()
            ok = got.dtype == torch.bfloat16 and got.shape == want.shape and err < _TOL
            print(f"{'ok' if ok else 'FAIL'} T={T} H={H} I={I} E={E} k={k} cfg={cfg} launch {rep}: rel err {err:.2e}")
            bad += [] if ok else [i]
    from vllm_dsv41.ops import fp8_gemv

    if any(int(b.abs().sum()) for b in fp8_gemv._LOCKS.values()):
        print("FAIL: arrival counters not reset")
        bad.append(-1)
    return 1 if bad else 0


def test_triton_interpreter():
    run_under_interpreter(["-m", "tests.ops.test_moe_gemv", "--interpret"])


def _sigs():
    ints = lambda *names: {n: "i32" for n in names}  # noqa: E731
    up = {"xd_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "w_ptr": "*u8", "s_ptr": "*u8", "idx_ptr": "*i32",
          "hd_ptr": "*fp8e4nv", "hs_ptr": "*fp32", "part_ptr": "*fp32", "lock_ptr": "*i32",
          **ints("K", "I", "k_slots", "stride_we", "stride_wn", "stride_se", "stride_sn"), "limit": "fp32",
          "floor": "fp32", **{n: "constexpr" for n in ("BLOCK_N", "SPLIT_K", "G", "H_G", "EVEN", "THREADS",
                                                            "INTERPRET", "PDL")}}
    down = {"hd_ptr": "*fp8e4nv", "hs_ptr": "*fp32", "w_ptr": "*u8", "s_ptr": "*u8", "idx_ptr": "*i32",
            "wts_ptr": "*fp32", "out_ptr": "*bf16", "part_ptr": "*fp32", "lock_ptr": "*i32",
            **ints("H", "I", "stride_we", "stride_wn", "stride_se", "stride_sn"),
            **{n: "constexpr" for n in ("BLOCK_N", "K_SLOTS", "G", "EVEN", "THREADS", "INTERPRET", "PDL")}}
    return up, down


@pytest.mark.parametrize("block_n,split", [(128, 2), (64, 1)])
def test_kernels_build_for_sm90_without_spills(block_n, split):
    """Built for Hopper as a launch at the bench shapes specialises them: the FP8 tensor-core MMA, no spills, and the
    weight bytes (16 a row and step, w1 and w3) pipelined through shared memory."""
    pytest.importorskip("triton")
    mg._bind()
    up, down = _sigs()
    aligned = ("K", "I", "H", "stride_we", "stride_wn", "stride_se", "stride_sn")
    p = mg.plan(5120, 2304)
    got = sm90_build(mg._up_kernel, up, {"BLOCK_N": block_n, "SPLIT_K": split, "G": p["UP_G"], "H_G": p["DOWN_G"],
                                         "EVEN": True,
                                         "THREADS": 128, "INTERPRET": False},
                     p["num_warps"], p["num_stages"], divisible_by_16=aligned)
    print(f"moe_gemv up BLOCK_N={block_n} SPLIT_K={split}: {got}")
    assert got["stack"] == 0 and got["regs"] <= 255 and got["shared"] <= SM90_SHARED_LIMIT
    assert got["shared"] >= (p["num_stages"] - 1) * 2 * block_n * 16 * p["UP_G"], "the weight loads are not pipelined"
    got = sm90_build(mg._down_kernel, down, {"BLOCK_N": block_n, "K_SLOTS": 6, "G": p["DOWN_G"], "EVEN": True,
                                           "THREADS": 128, "INTERPRET": False},
                     p["num_warps"], p["num_stages"], divisible_by_16=aligned)
    print(f"moe_gemv down BLOCK_N={block_n}: {got}")
    assert got["stack"] == 0 and got["regs"] <= 255 and got["shared"] <= SM90_SHARED_LIMIT
    assert got["shared"] >= (p["num_stages"] - 1) * block_n * 16 * p["DOWN_G"], "the weight loads are not pipelined"


def test_kernels_use_the_fp8_mma_and_packed_decode():
    """The sm_90 code of the first GEMM runs FP8 warpgroup MMAs (QGMMA) fed from registers, and the nibbles become
    E4M3 bytes four at a time (the 0x07070707 / 0x1c1c1c1c masks of the packed decode), not per element."""
    pytest.importorskip("triton")
    import pathlib
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    tool = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        pytest.skip("this Triton wheel has no cuobjdump")
    mg._bind()
    up, _ = _sigs()
    src = ASTSource(fn=mg._up_kernel, signature=up,
                    constexprs={"BLOCK_N": 128, "SPLIT_K": 2, "G": 8, "H_G": 8, "EVEN": True, "THREADS": 128,
                                "INTERPRET": False, "PDL": False})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 4})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True).stdout
    assert "QGMMA" in sass and "E4M3.E4M3" in sass
    assert "0x7070707" in sass and "0x1c1c1c1c" in sass


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 2, 4, 16])
def test_cuda_bench_shapes(T):
    """The bench widths (hidden 5120, intermediate 2304, 32 experts, top-6) against the fp32 reference, and repeated
    launches bit-identical (the slot sums run in a fixed order)."""
    x, w13, s13, w2, s2, idx, wts = make_case(T, 5120, 2304, 32, 6, device="cuda", seed=T)
    x = x.bfloat16()
    want = mg.moe_gemv_ref(x.float(), w13, s13, w2, s2, idx, wts, LIMIT)
    first = torch.ops.dsv41.moe_gemv(x, w13, s13, w2, s2, idx, wts, LIMIT)
    err = ((first.float() - want).norm() / want.norm()).item()
    assert err < _TOL, f"T={T}: rel err {err:.2e}"
    for _ in range(3):
        assert torch.equal(torch.ops.dsv41.moe_gemv(x, w13, s13, w2, s2, idx, wts, LIMIT), first)


if __name__ == "__main__" and "--interpret" in sys.argv:
    sys.exit(_interpret())
