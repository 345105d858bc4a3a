"""mHC ops (vllm_dsv41/ops/mhc.py): references against the reference model, Triton against the references.

(a) CPU, always: each ``*_ref`` equals the composition of the reference-model helpers, and the
    registered ``torch.ops.dsv41.*`` ops dispatch to it on CPU.
(b) Triton interpreter: the launch wrappers run under ``TRITON_INTERPRET=1`` on CPU tensors in a
    subprocess (the variable must be set before Triton is imported); skipped without Triton.
(c) CUDA (H200 run): the registered ops at serving sizes (C=4, H=5120, bf16 stream).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.ops.conftest import assert_close, requires_cuda
from vllm_dsv41 import formats
from vllm_dsv41.ops import mhc
from vllm_dsv41.reference.model import hc_coefficients, hc_collapse, hc_post, rms_norm, sinkhorn

EPS, HC_EPS, ITERS = 1e-20, 1e-6, 20
REPO = Path(__file__).resolve().parents[2]


def make_inputs(T: int, C: int, H: int, dtype: torch.dtype = torch.float32, seed: int = 0,
                device: str = "cpu") -> dict[str, torch.Tensor]:
    """One boundary's inputs with realistic magnitudes (|m| ~ 1, comb logits of a few units)."""
    g = torch.Generator().manual_seed(seed)
    nmix = (2 + C) * C

    def rand(*shape, scale=1.0, shift=0.0):
        return torch.randn(*shape, generator=g) * scale + shift

    comb_prev = sinkhorn(rand(T, C, C, scale=2.0), HC_EPS, ITERS)
    t = dict(
        stream=rand(T, C, H).to(dtype),
        fn=rand(nmix, C * H, scale=(C * H) ** -0.5),
        base=rand(nmix, scale=0.5),
        scale=torch.tensor([0.8, 1.2, 3.0]),
        pre_prev=torch.sigmoid(rand(T, C)) + HC_EPS,
        norm_w=rand(H, scale=0.2, shift=1.0).to(dtype),
        y=rand(T, H).to(dtype),
        post_prev=2.0 * torch.sigmoid(rand(T, C)),
        comb_prev=comb_prev,
    )
    t["y2"] = rand(T, H).to(dtype)  # drawn last: the other inputs do not depend on it
    return {k: v.to(device) for k, v in t.items()}


def pre_args(t):
    return (t["stream"], t["fn"], t["base"], t["scale"], t["pre_prev"], t["norm_w"], EPS, HC_EPS, ITERS)


def post_args(t):
    return (t["stream"], t["y"], t["post_prev"], t["comb_prev"])


def post_add_args(t):
    """``mhc_post`` with the sublayer output in two parts (y + y2: the MoE's routed and shared experts)."""
    return (*post_args(t), t["y2"])


def post_collapse_add_args(t):
    """``mhc_post_collapse`` (and its ``_quant``) with the post-mixed output in two parts (the next layer folding the
    FFN boundary's post-mix: the MoE's routed and shared experts)."""
    return (*post_collapse_args(t), t["y2"])


def post_pre_add_args(t):
    return (*post_pre_args(t), t["y2"])


def post_pre_args(t):
    return (*post_args(t), *pre_args(t)[1:])


def collapse_args(t):
    return (t["stream"], t["pre_prev"], t["norm_w"], EPS)


def post_collapse_args(t):
    return (*post_args(t), t["pre_prev"], t["norm_w"], EPS)


def coeffs_args(t):
    return (t["stream"], t["fn"], t["base"], t["scale"], EPS, HC_EPS, ITERS)


ARGS = {"pre": pre_args, "post": post_args, "post_add": post_add_args, "post_pre": post_pre_args,
        "post_pre_add": post_pre_add_args, "post_collapse_add": post_collapse_add_args,
        "post_collapse_quant_add": post_collapse_add_args, "collapse": collapse_args,
        "post_collapse": post_collapse_args, "coeffs": coeffs_args, "collapse_quant": collapse_args,
        "post_collapse_quant": post_collapse_args}
REFS = {"pre": mhc.mhc_pre_ref, "post": mhc.mhc_post_ref, "post_add": mhc.mhc_post_ref, "post_pre": mhc.mhc_post_pre_ref,
        "post_pre_add": mhc.mhc_post_pre_ref, "post_collapse_add": mhc.mhc_post_collapse_ref,
        "post_collapse_quant_add": mhc.mhc_post_collapse_quant_ref,
        "collapse": mhc.mhc_collapse_ref, "post_collapse": mhc.mhc_post_collapse_ref, "coeffs": mhc.mhc_coeffs_ref,
        "collapse_quant": mhc.mhc_collapse_quant_ref, "post_collapse_quant": mhc.mhc_post_collapse_quant_ref}
OUT_NAMES = {"pre": ("x", "pre", "post", "comb"), "post": ("stream",), "post_add": ("stream",),
             "post_pre_add": ("stream", "x", "pre", "post", "comb"), "post_collapse_add": ("stream", "x"),
             "post_collapse_quant_add": ("stream", "x", "codes", "scales"),
             "post_pre": ("stream", "x", "pre", "post", "comb"), "collapse": ("x",), "post_collapse": ("stream", "x"),
             "coeffs": ("pre", "post", "comb"), "collapse_quant": ("x", "codes", "scales"),
             "post_collapse_quant": ("stream", "x", "codes", "scales")}
# argument sets of an op under a name of their own: the ops with y2, the sublayer output's second part
OP_OF = {"post_add": "post", "post_pre_add": "post_pre", "post_collapse_add": "post_collapse",
         "post_collapse_quant_add": "post_collapse_quant"}
QUANT_OPS = {"collapse_quant": "collapse", "post_collapse_quant": "post_collapse",  # -> the op without the codes
             "post_collapse_quant_add": "post_collapse"}


def model_pre(t):
    """The boundary as the reference model composes it (fp32 stream)."""
    S = t["stream"].float()
    pre, post, comb = hc_coefficients(S, t["fn"], t["base"], t["scale"], EPS, HC_EPS, ITERS)
    x = rms_norm(hc_collapse(S, t["pre_prev"]), t["norm_w"].float(), EPS)
    return x, pre, post, comb


# --------------------------------------------------------------------------- (a) CPU: references


@pytest.mark.parametrize("T", [1, 3, 17])
@pytest.mark.parametrize("H", [64, 96])
def test_pre_ref_equals_reference_model(T, H):
    t = make_inputs(T, 4, H)
    for name, want, got in zip(("x", "pre", "post", "comb"), model_pre(t), mhc.mhc_pre_ref(*pre_args(t))):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.parametrize("T", [1, 3, 17])
@pytest.mark.parametrize("H", [64, 96])
def test_post_ref_equals_reference_model(T, H):
    t = make_inputs(T, 4, H)
    want = hc_post(t["stream"], t["y"], t["post_prev"], t["comb_prev"])
    torch.testing.assert_close(mhc.mhc_post_ref(*post_args(t)), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_post_ref_adds_the_second_part_first(dtype):
    """y2 goes into y in y's dtype before the mix: the same stream as mhc_post of the summed output, so the MoE's
    separate ``routed + shared`` can move into the post-mix bitwise; the op on CPU is the reference."""
    t = make_inputs(5, 4, 96, dtype)
    want = mhc.mhc_post_ref(t["stream"], t["y"] + t["y2"], t["post_prev"], t["comb_prev"])
    assert torch.equal(mhc.mhc_post_ref(*post_add_args(t)), want)
    assert torch.equal(torch.ops.dsv41.mhc_post(*post_add_args(t)), want)
    assert not torch.equal(want, mhc.mhc_post_ref(*post_args(t)))  # y2 is not ignored


@pytest.mark.parametrize("T", [1, 17])
def test_post_pre_ref_is_post_then_pre(T):
    t = make_inputs(T, 4, 96)
    S_new = hc_post(t["stream"], t["y"], t["post_prev"], t["comb_prev"])
    want = (S_new, *model_pre({**t, "stream": S_new}))
    got = mhc.mhc_post_pre_ref(*post_pre_args(t))
    for name, a, b in zip(("stream", "x", "pre", "post", "comb"), want, got):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6, msg=name)


def test_comb_is_doubly_stochastic():
    t = make_inputs(17, 4, 64)
    _, pre, post, comb = mhc.mhc_pre_ref(*pre_args(t))
    assert (comb > 0).all()
    torch.testing.assert_close(comb.sum(-2), torch.ones(17, 4), atol=1e-5, rtol=0)  # columns: last step
    torch.testing.assert_close(comb.sum(-1), torch.ones(17, 4), atol=5e-2, rtol=0)  # rows: 20 rounds, ~converged
    assert ((pre > 0) & (pre <= 1 + 2 * HC_EPS)).all() and ((post > 0) & (post < 2)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_registered_ops_on_cpu_are_the_references(dtype):
    t = make_inputs(5, 4, 96, dtype)
    ops = torch.ops.dsv41
    pairs = [(ops.mhc_pre(*pre_args(t)), mhc.mhc_pre_ref(*pre_args(t))),
             ((ops.mhc_post(*post_args(t)),), (mhc.mhc_post_ref(*post_args(t)),)),
             (ops.mhc_post_pre(*post_pre_args(t)), mhc.mhc_post_pre_ref(*post_pre_args(t)))]
    for got, want in pairs:
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and torch.equal(a, b)
    x, *_ = ops.mhc_pre(*pre_args(t))
    assert x.dtype == dtype and x.shape == (5, 96)


def test_fake_impls():
    t = make_inputs(3, 4, 64, torch.bfloat16)
    for name, args in ARGS.items():
        op = OP_OF.get(name, name)
        torch.library.opcheck(getattr(torch.ops.dsv41, f"mhc_{op}"), args(t),
                              test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_boundary_refs_compose_to_the_fused_ones(dtype):
    """The deferred-coefficient boundary (``mhc_collapse`` / ``mhc_post_collapse`` now, ``mhc_coeffs`` beside the
    sublayer) gives bitwise the fused ops' numbers on the reference path: the model may take either."""
    t = make_inputs(5, 4, 96, dtype)
    fused = mhc.mhc_pre_ref(*pre_args(t))
    split = (mhc.mhc_collapse_ref(*collapse_args(t)), *mhc.mhc_coeffs_ref(*coeffs_args(t)))
    assert all(torch.equal(a, b) for a, b in zip(fused, split, strict=True))
    fused = mhc.mhc_post_pre_ref(*post_pre_args(t))
    S, x = mhc.mhc_post_collapse_ref(*post_collapse_args(t))
    split = (S, x, *mhc.mhc_coeffs_ref(S, *coeffs_args(t)[1:]))
    assert all(torch.equal(a, b) for a, b in zip(fused, split, strict=True))


# --------------------------------------------------------------------------- (b) Triton interpreter

# Each case: (op, T, C, H, dtype, launch config override or None, non-contiguous inputs?)
INTERPRET_CASES = {
    "pre-T3-H96-fp32": ("pre", 3, 4, 96, "float32", None, False),
    "pre-T17-H64-bf16-bt16": ("pre", 17, 4, 64, "bfloat16", {"block_t": 16}, False),
    "pre-T5-H96-bf16-bh64-split1": ("pre", 5, 4, 96, "bfloat16", {"block_h": 64, "split": 1}, False),
    "pre-T3-C2-H64-fp32-strided": ("pre", 3, 2, 64, "float32", {"block_h": 16}, True),
    "post-T3-H96-bf16": ("post", 3, 4, 96, "bfloat16", None, False),
    "post-T17-H64-fp32-bt4-strided": ("post", 17, 4, 64, "float32", {"block_t": 4, "block_h": 32}, True),
    "post_add-T3-H96-bf16": ("post_add", 3, 4, 96, "bfloat16", None, False),
    "post_add-T17-H64-fp32-bt4-strided": ("post_add", 17, 4, 64, "float32", {"block_t": 4, "block_h": 32}, True),
    "post_pre-T3-H96-bf16": ("post_pre", 3, 4, 96, "bfloat16", None, False),
    # the fused post-mixes with the output in two parts (a layer's FFN post-mix folded into the next boundary)
    "post_pre_add-T5-H96-bf16": ("post_pre_add", 5, 4, 96, "bfloat16", None, False),
    "post_pre_add-T9-H640-fp32-gemm-strided": ("post_pre_add", 9, 4, 640, "float32", {"project": False}, True),
    "post_collapse_add-T3-H96-bf16": ("post_collapse_add", 3, 4, 96, "bfloat16", None, False),
    "post_collapse_add-T17-H64-fp32-bt4-strided": ("post_collapse_add", 17, 4, 64, "float32",
                                                   {"block_t": 4, "block_h": 32}, True),
    "post_collapse_quant_add-T5-H640-bf16": ("post_collapse_quant_add", 5, 4, 640, "bfloat16", {"block_h": 32},
                                             False),
    "post_pre-T17-H64-fp32-bt16-split1": ("post_pre", 17, 4, 64, "float32", {"block_t": 16, "split": 1}, True),
    # 40 splits: three rounds of the epilogue's EPILOGUE_SPLITS-wide reads, the last one partly masked
    "pre-T9-H640-fp32-split40": ("pre", 9, 4, 640, "float32", {"block_h": 16, "split": 40}, False),
    # the projection through one fp32 GEMM after a streaming kernel (the prefill path)
    "pre-T9-H640-fp32-gemm": ("pre", 9, 4, 640, "float32", {"project": False}, False),
    "pre-T5-H96-bf16-gemm-bh32": ("pre", 5, 4, 96, "bfloat16", {"project": False, "block_h": 32}, False),
    "post_pre-T17-H64-fp32-gemm-strided": ("post_pre", 17, 4, 64, "float32", {"project": False, "split": 2,
                                                                               "block_h": 32}, True),
    # the deferred-coefficient boundary: collapse now (normalising epilogue columns only), coefficients beside
    # the sublayer (the coefficient column only)
    "collapse-T3-H96-bf16": ("collapse", 3, 4, 96, "bfloat16", None, False),
    "collapse-T9-H640-fp32-split40-strided": ("collapse", 9, 4, 640, "float32", {"block_h": 16, "split": 40}, True),
    "post_collapse-T3-H96-bf16": ("post_collapse", 3, 4, 96, "bfloat16", None, False),
    "post_collapse-T17-H64-fp32-bt4-strided": ("post_collapse", 17, 4, 64, "float32", {"block_t": 4, "block_h": 32},
                                               True),
    "coeffs-T3-H96-bf16": ("coeffs", 3, 4, 96, "bfloat16", None, False),
    "coeffs-T9-H640-fp32-split40": ("coeffs", 9, 4, 640, "float32", {"block_h": 16, "split": 40}, False),
    "coeffs-T5-H96-bf16-gemm": ("coeffs", 5, 4, 96, "bfloat16", {"project": False, "block_h": 32}, False),
    # the same collapse with x quantised per row in the normalising launch (each split's max |h * w| from the pre
    # kernel; 40 splits: three rounds of the epilogue's reads)
    "collapse_quant-T3-H96-bf16": ("collapse_quant", 3, 4, 96, "bfloat16", None, False),
    "collapse_quant-T9-H5120-bf16-split40-strided": ("collapse_quant", 9, 4, 5120, "bfloat16", {"split": 40}, True),
    "post_collapse_quant-T5-H640-bf16-strided": ("post_collapse_quant", 5, 4, 640, "bfloat16", {"block_h": 32}, True),
    "post_collapse_quant-T3-H96-fp32": ("post_collapse_quant", 3, 4, 96, "float32", None, False),
    # the one-launch collapse (each token's programs sum the whole row's squares): one and several programs a token,
    # H not a multiple of the chunk, the post-mix with the MoE's two parts, the quantising variants
    "collapse-T2-H96-bf16-rows": ("collapse", 2, 4, 96, "bfloat16", {"rows": True}, False),
    "collapse-T3-H640-fp32-rows-bh64-p4-strided": ("collapse", 3, 4, 640, "float32",
                                                   {"rows": True, "block_h": 64, "programs": 4}, True),
    "post_collapse-T3-H96-bf16-rows-bh32-p2": ("post_collapse", 3, 4, 96, "bfloat16",
                                               {"rows": True, "block_h": 32, "programs": 2}, False),
    "post_collapse_add-T2-H640-bf16-rows-bh128-p3-strided": ("post_collapse_add", 2, 4, 640, "bfloat16",
                                                             {"rows": True, "block_h": 128, "programs": 3}, True),
    "collapse_quant-T2-H5120-bf16-rows": ("collapse_quant", 2, 4, 5120, "bfloat16", {"rows": True}, False),
    "post_collapse_quant_add-T3-H640-bf16-rows-bh64-p4": ("post_collapse_quant_add", 3, 4, 640, "bfloat16",
                                                          {"rows": True, "block_h": 64, "programs": 4}, False),
    "post_collapse_quant-T1-H96-fp32-rows-p1": ("post_collapse_quant", 1, 4, 96, "float32",
                                                {"rows": True, "programs": 1}, False),
}

# Triton's interpreter (3.9) casts fp32 -> bf16 by truncation, the GPU rounds to nearest even; the
# runner makes the interpreter round like the GPU so that bf16 results are held to the GPU's tolerance.
_RUNNER = """
import sys, numpy as np, torch, triton.language as tl
from triton.runtime import interpreter
from tests.ops import test_mhc as t
from vllm_dsv41.ops import mhc

_convert = getattr(interpreter, "_convert_float", None)
def _convert_rtne(data, src, dst, rounding_mode):
    if src == tl.float32 and dst == tl.bfloat16:
        bf16 = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32)).to(torch.bfloat16)
        return bf16.view(torch.int16).numpy().view(np.uint16)
    return _convert(data, src, dst, rounding_mode)
if _convert is not None:
    interpreter._convert_float = _convert_rtne

out = {}
for name, case in t.INTERPRET_CASES.items():
    inputs, args, ref = t.interpret_case(*case)
    fn = getattr(mhc, f"_mhc_{t.OP_OF.get(case[0], case[0])}_triton")
    got = fn(*args, config=case[5])
    # the fused ops' stream must equal mhc_post's bit for bit (same arithmetic, same order), with y2 too; mhc_post's
    # own y2 that of y + y2 added beforehand
    base = t.OP_OF.get(case[0], case[0])
    y2 = args[-1] if case[0].endswith("_add") else None
    alone = (mhc._mhc_post_triton(*args[:4], y2) if base in ("post_pre", "post_collapse", "post_collapse_quant")
             else None)
    if case[0] == "post_add":
        alone = mhc._mhc_post_triton(args[0], args[1] + args[4], *args[2:4], config=case[5])
    # the quantising ops' x must equal the op's without the codes bit for bit
    plain = (getattr(mhc, f"_mhc_{t.QUANT_OPS[case[0]]}_triton")(*args, config=case[5])
             if case[0] in t.QUANT_OPS else None)
    out[name] = (ref, got if isinstance(got, tuple) else (got,), alone, plain)
torch.save(out, sys.argv[1])
"""


def _strided(x: torch.Tensor) -> torch.Tensor:
    """The same values with a padded last-but-one layout (inner dim still contiguous)."""
    pad = torch.zeros(*x.shape[:-1], x.shape[-1] + 8, dtype=x.dtype)
    pad[..., :x.shape[-1]] = x
    return pad[..., :x.shape[-1]]


def interpret_case(op, T, C, H, dtype, config, strided):
    """Inputs, the op's argument tuple and its reference outputs (used by the interpreter runner)."""
    t = make_inputs(T, C, H, getattr(torch, dtype), seed=T * 100 + H)
    if strided:
        t.update(stream=_strided(t["stream"]), y=_strided(t["y"]), y2=_strided(t["y2"]), pre_prev=_strided(t["pre_prev"]))
    args = ARGS[op](t)
    ref = REFS[op](*args)
    return t, args, ref if isinstance(ref, tuple) else (ref,)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    path = tmp_path_factory.mktemp("mhc") / "interpreted.pt"
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))}
    proc = subprocess.run([sys.executable, "-c", _RUNNER, str(path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(path)


@pytest.mark.parametrize("case", list(INTERPRET_CASES))
def test_triton_interpreted(interpreted, case):
    ref, got, post_alone, plain = interpreted[case]
    op = INTERPRET_CASES[case][0]
    names = OUT_NAMES[op]
    for name, a, b in zip(names, ref, got, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert_close(f"{case} {name}", a, b, ratio=_ratio(a.dtype, name))
    if post_alone is not None:
        assert torch.equal(got[0], post_alone)
    if plain is not None:
        assert_quantised_x(case, got, plain)


def assert_quantised_x(name: str, got: tuple, plain) -> None:
    """A ``*_quant`` op's outputs: the stream and x bitwise those of the op without the codes (the same kernels), and
    the codes and scales those of ``formats.quant_fp8_tokens`` on that x, computed on CPU (correctly rounded division;
    CUDA's division by a scalar multiplies by its reciprocal): bitwise for every row whose scale came out equal, which
    is every row but where the fp32 products behind the row's amax straddle a rounding point of x's dtype (then the
    scale is one ulp of x's dtype apart, and the codes are that scale's, each within one E4M3 step of x)."""
    plain = plain if isinstance(plain, tuple) else (plain,)
    n = len(plain)
    assert all(torch.equal(a, b) for a, b in zip(got[:n], plain, strict=True)), f"{name}: x differs from the plain op"
    x = got[n - 1].cpu()
    codes, scales = formats.quant_fp8_tokens(x)
    q, s = got[n].cpu(), got[n + 1].cpu()
    same = (s == scales).squeeze(1)
    differ = int((~same).sum())
    assert differ <= max(1, same.numel() // 10), f"{name}: {differ} of {same.numel()} rows' scales differ"
    assert ((s - scales).abs() <= scales * 2.0 ** -7).all(), f"{name}: scales more than an ulp of x's dtype apart"
    assert torch.equal(q[same].view(torch.uint8), codes[same].view(torch.uint8)), f"{name}: codes differ from quant(x)"
    back = q.float() * s
    assert ((back - x.float()).abs() <= x.float().abs() * 2.0 ** -3 + s * 2.0 ** -9).all(), f"{name}: codes off x"


def _ratio(dtype: torch.dtype, name: str = "") -> float:
    # bf16: one output rounding (~1e-3 relative rms), plus at most one extra for x (h is parked in bf16).
    # fp32: summation order and the split fn (2^-17 per product) in the projection.
    # The codes and scales of a quantised x follow x's last-bit differences from the reference (an E4M3 step is
    # 2^-3 relative); assert_quantised_x holds them bitwise to the kernel's own x.
    if name in ("codes", "scales"):
        return 3e-2
    return 1e-2 if dtype == torch.bfloat16 else 1e-4


# --------------------------------------------------------------------------- (c) CUDA, serving sizes


@requires_cuda
@pytest.mark.parametrize("T", [1, 7, 64, 2048])
@pytest.mark.parametrize("op", list(ARGS))
def test_cuda_ops_match_reference(op, T):
    t = make_inputs(T, 4, 5120, torch.bfloat16, seed=T, device="cuda")
    args = ARGS[op](t)
    got = getattr(torch.ops.dsv41, f"mhc_{OP_OF.get(op, op)}")(*args)
    ref = REFS[op](*args)
    got, ref = (got, ref) if isinstance(ref, tuple) else ((got,), (ref,))
    for i, (a, b) in enumerate(zip(ref, got, strict=True)):
        assert a.shape == b.shape and a.dtype == b.dtype and b.is_cuda
        assert_close(f"mhc_{op} T={T} out{i}", a, b, ratio=_ratio(a.dtype, OUT_NAMES[op][i]))


@requires_cuda
@pytest.mark.parametrize("T", [1, 5, 64])
@pytest.mark.parametrize("op", list(QUANT_OPS))
def test_cuda_quantised_collapse(op, T):
    """At serving sizes: the quantising collapse's x bitwise the plain op's, its codes and scales bitwise the per-row
    quantisation of that x (as ``formats.quant_fp8_tokens`` computes it)."""
    t = make_inputs(T, 4, 5120, torch.bfloat16, seed=T, device="cuda")
    args = ARGS[op](t)
    got = getattr(torch.ops.dsv41, f"mhc_{OP_OF.get(op, op)}")(*args)
    assert_quantised_x(f"mhc_{op} T={T}", got, getattr(torch.ops.dsv41, f"mhc_{QUANT_OPS[op]}")(*args))


@requires_cuda
@pytest.mark.parametrize("T", [1, 64, 2048])
def test_cuda_fused_stream_is_bitwise_post(T):
    t = make_inputs(T, 4, 5120, torch.bfloat16, seed=T, device="cuda")
    fused = torch.ops.dsv41.mhc_post_pre(*post_pre_args(t))
    assert torch.equal(fused[0], torch.ops.dsv41.mhc_post(*post_args(t)))
    pre_on_new = torch.ops.dsv41.mhc_pre(fused[0], *pre_args(t)[1:])
    for name, a, b in zip(("x", "pre", "post", "comb"), pre_on_new, fused[1:]):
        assert_close(f"fused vs post+pre T={T} {name}", a, b, ratio=_ratio(a.dtype))


@requires_cuda
@pytest.mark.parametrize("T", [1, 64, 2048])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_post_with_two_parts_is_post_of_their_sum(T, dtype):
    """``mhc_post`` with y2 (the MoE's shared expert output) equals, bitwise, ``mhc_post`` of PyTorch's ``y + y2``."""
    t = make_inputs(T, 4, 5120, dtype, seed=T, device="cuda")
    ops = torch.ops.dsv41
    assert torch.equal(ops.mhc_post(*post_add_args(t)),
                       ops.mhc_post(t["stream"], t["y"] + t["y2"], t["post_prev"], t["comb_prev"]))


@requires_cuda
@pytest.mark.parametrize("T", [1, 64, 2048])
def test_cuda_folded_post_mix_is_bitwise_post(T):
    """The previous layer's FFN post-mix folded into the next boundary with the MoE's two parts (``y2``): the new
    stream of ``mhc_post_collapse`` / ``mhc_post_collapse_quant`` / ``mhc_post_pre`` bitwise ``mhc_post``'s with y2,
    so the folded and the unfolded layer orders serve the same streams."""
    t = make_inputs(T, 4, 5120, torch.bfloat16, seed=T, device="cuda")
    ops = torch.ops.dsv41
    want = ops.mhc_post(*post_add_args(t))
    assert torch.equal(ops.mhc_post_pre(*post_pre_add_args(t))[0], want)
    if T <= 64:  # the split boundary's decode sizes
        assert torch.equal(ops.mhc_post_collapse(*post_collapse_add_args(t))[0], want)
        assert torch.equal(ops.mhc_post_collapse_quant(*post_collapse_add_args(t))[0], want)


@requires_cuda
@pytest.mark.parametrize("T", [1, 16, 64])
def test_cuda_split_boundary_equals_fused(T):
    """The deferred-coefficient boundary against the fused ops at decode sizes: the post-mixed stream bitwise equal
    to ``mhc_post``'s, x and the coefficients to the fused ops' tolerance."""
    t = make_inputs(T, 4, 5120, torch.bfloat16, seed=T, device="cuda")
    ops = torch.ops.dsv41
    fused = ops.mhc_post_pre(*post_pre_args(t))
    S, x = ops.mhc_post_collapse(*post_collapse_args(t))
    assert torch.equal(S, ops.mhc_post(*post_args(t)))
    split = (S, x, *ops.mhc_coeffs(S, *coeffs_args(t)[1:]))
    for name, a, b in zip(("stream", "x", "pre", "post", "comb"), fused, split, strict=True):
        assert_close(f"split vs fused T={T} {name}", a, b, ratio=_ratio(a.dtype))


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", ["pre", "post_pre"])
def test_cuda_projection_in_kernel_or_gemm(op, dtype):
    """Both places of the projection (the kernel's MMA below ``gemm_from()`` rows, cuBLAS from there: an fp32 GEMM
    on fp32 streams, a bf16 GEMM with fp32 output over fn's hi + lo split on bf16 streams) against the reference, and
    the fused stream bitwise equal either way."""
    T = 1500
    t = make_inputs(T, 4, 5120, dtype, seed=T, device="cuda")
    args = {"pre": pre_args, "post_pre": post_pre_args}[op](t)
    fn = {"pre": mhc._mhc_pre_triton, "post_pre": mhc._mhc_post_pre_triton}[op]
    ref = {"pre": mhc.mhc_pre_ref, "post_pre": mhc.mhc_post_pre_ref}[op](*args)
    got = {p: fn(*args, config={"project": p}) for p in (True, False)}
    for p, outs in got.items():
        for i, (a, b) in enumerate(zip(ref, outs, strict=True)):
            assert_close(f"mhc_{op} {dtype} T={T} project={p} out{i}", a, b,
                         ratio=1e-4 if dtype == torch.float32 else _ratio(a.dtype))
    if op == "post_pre":
        assert torch.equal(got[True][0], got[False][0])


def test_gemm_from_env(monkeypatch):
    monkeypatch.setenv(mhc.GEMM_FROM_ENV, "0")
    assert mhc.gemm_from() > 1 << 40
    monkeypatch.setenv(mhc.GEMM_FROM_ENV, "512")
    assert mhc.gemm_from() == 512
    monkeypatch.setenv(mhc.GEMM_FROM_ENV, "many")
    with pytest.raises(ValueError, match="VLLM_DSV41_MHC_GEMM_FROM"):
        mhc.gemm_from()


def test_split_rows_env(monkeypatch):
    monkeypatch.delenv(mhc.SPLIT_ROWS_ENV, raising=False)
    assert mhc.split_rows() == mhc.SPLIT_ROWS_DEFAULT
    monkeypatch.setenv(mhc.SPLIT_ROWS_ENV, "0")
    assert mhc.split_rows() == 0
    for bad in ("some", "-1"):
        monkeypatch.setenv(mhc.SPLIT_ROWS_ENV, bad)
        with pytest.raises(ValueError, match="VLLM_DSV41_MHC_SPLIT_ROWS"):
            mhc.split_rows()


@requires_cuda
def test_cuda_empty_batch():
    t = make_inputs(0, 4, 5120, torch.bfloat16, device="cuda")
    x, pre, post, comb = torch.ops.dsv41.mhc_pre(*pre_args(t))
    assert x.shape == (0, 5120) and comb.shape == (0, 4, 4)
    assert torch.ops.dsv41.mhc_post(*post_args(t)).shape == (0, 4, 5120)


@requires_cuda
@pytest.mark.parametrize("T", [7, 300])
def test_cuda_pre_fp32_stream(T):
    t = make_inputs(T, 4, 5120, torch.float32, seed=T, device="cuda")
    for name, a, b in zip(("x", "pre", "post", "comb"), mhc.mhc_pre_ref(*pre_args(t)),
                          torch.ops.dsv41.mhc_pre(*pre_args(t))):
        assert_close(f"mhc_pre fp32 T={T} {name}", a, b, ratio=1e-4)


def test_fn_split_follows_the_tensor_not_its_address():
    """The bf16 hi + lo split of fn (the bf16-stream projection) is kept per tensor and version: an in-place update
    or another tensor at a reused address gets its own split (a cache keyed by address gave a freed tensor's split
    to the next one on the GPU), and hi + lo gives fn back to ~2^-17."""
    fn = torch.randn(24, 64)
    both = mhc._fn_split(fn)
    assert both.shape == (48, 64) and both.dtype == torch.bfloat16 and mhc._fn_split(fn) is both
    back = both[:24].float() + both[24:].float()
    assert ((back - fn).abs() <= fn.abs() * 2.0 ** -16).all()
    fn.mul_(2)
    assert torch.equal(mhc._fn_split(fn), both * 2)
    other = torch.randn(24, 64)
    assert not torch.equal(mhc._fn_split(other), mhc._fn_split(fn))


@pytest.mark.parametrize("T", [1, 64])
@pytest.mark.parametrize("kind", ["coeffs", "collapse", "post_collapse"])
def test_split_boundary_kernels_build_for_sm90(kind, T):
    """The pre kernel's variants of the split boundary compile for Hopper (Triton's own ptxas, no GPU) with the
    launch parameters the wrappers pick at decode sizes, bf16 streams: the projection without the collapse
    (``mhc_coeffs``, its MMA tiles: at most a few spilled bytes, 24 at one row, as the fused ``mhc_pre`` there) and
    the streaming collapse with and without the post-mix (every value in registers)."""
    from tests.ops.conftest import SM90_SHARED_LIMIT, sm90_build

    pytest.importorskip("triton")
    kernel = mhc._kernels().pre
    fuse = kind == "post_collapse"
    sms = 132
    cfg = _cfg_for(T, fuse, sms, project=kind == "coeffs")
    C, nmix = 4, 24
    ptr = {"s_ptr": "*bf16", "y_ptr": "*bf16", "y2_ptr": "*bf16", "post_prev_ptr": "*fp32", "comb_prev_ptr": "*fp32",
           "snew_ptr": "*bf16", "fn_ptr": "*fp32", "pre_prev_ptr": "*fp32", "h_ptr": "*bf16", "part_ptr": "*fp32",
           "w_ptr": "*bf16"}
    consts = {"C": C, "NMIX": nmix, "NP": 32, "BLOCK_T": cfg["block_t"], "BLOCK_H": cfg["block_h"], "FUSE_POST": fuse,
              "BF16_SPLIT": True, "BF16_MMA": True, "PROJECT": kind == "coeffs", "COLLAPSE": kind != "coeffs",
              "AMAX": False, "ADD_Y2": fuse}  # the post-mix with the MoE's two parts (as the model runs it)
    sig = {n: ptr.get(n, "constexpr" if n in consts else "i32") for n in kernel.arg_names}
    got = sm90_build(kernel, sig, consts, cfg["num_warps"], cfg["num_stages"])
    print(f"mhc {kind} T={T} {cfg}: {got}")
    assert got["shared"] <= SM90_SHARED_LIMIT and got["regs"] <= 255
    assert got["stack"] <= (64 if kind == "coeffs" else 0), got


def _cfg_for(T: int, fuse: bool, sms: int, project: bool) -> dict:
    """The wrappers' launch parameters for an H200-sized GPU (``sm_count`` needs a device; the formulas are the
    configs' own)."""
    from unittest import mock

    with mock.patch.object(mhc, "sm_count", lambda device: sms):
        dev = torch.device("cuda")
        return mhc._pre_config(T, 5120, fuse, dev) if project else mhc._collapse_config(T, 5120, fuse, dev)


@pytest.mark.parametrize("add_y2", [False, True])
def test_post_kernel_builds_for_sm90(add_y2):
    """``_mhc_post_kernel`` with and without the second part of y compiles for Hopper without spills."""
    from tests.ops.conftest import sm90_build

    names = ("s_ptr", "y_ptr", "y2_ptr", "post_ptr", "comb_ptr", "out_ptr")
    sig = dict(zip(names, ("*bf16", "*bf16", "*bf16", "*fp32", "*fp32", "*bf16")))
    sig.update({n: "i32" for n in ("T", "H", "stride_st", "stride_sc", "stride_sh", "stride_yt", "stride_yh",
                                   "stride_y2t", "stride_y2h", "stride_pot", "stride_poc", "stride_cot", "stride_coi",
                                   "stride_coj", "stride_ot", "stride_oc", "stride_oh")})
    const = {"C": 4, "BLOCK_T": 1, "BLOCK_H": 1024, "ADD_Y2": add_y2}
    sig.update({n: "constexpr" for n in const})
    got = sm90_build(mhc._kernels().post, sig, const, 4)
    assert got["stack"] == 0, got


def test_quantising_collapse_builds_for_sm90():
    """The quantising collapse's two kernels at the launch parameters the wrapper takes at decode sizes, bf16 streams:
    the pre kernel with each split's max |h * w| (AMAX) and the epilogue's normalising columns with the codes (QUANT,
    the E4M3 rounding in integer arithmetic) compile for Hopper without spills (Triton's own ptxas, no GPU)."""
    from tests.ops.conftest import SM90_SHARED_LIMIT, sm90_build

    pytest.importorskip("triton")
    k = mhc._kernels()
    floats = ("inv_ch", "inv_h", "eps", "hc_eps", "floor")
    ptr = {"part_ptr": "*fp32", "base_ptr": "*fp32", "scale_ptr": "*fp32", "w_ptr": "*bf16", "x_ptr": "*bf16",
           "pre_ptr": "*fp32", "post_ptr": "*fp32", "comb_ptr": "*fp32", "q_ptr": "*u8", "qs_ptr": "*fp32"}
    consts = {"C": 4, "NMIX": 24, "BLOCK_T": 8, "BLOCK_H": 512, "BLOCK_S": mhc.EPILOGUE_SPLITS, "QUANT": True}
    sig = {n: ptr.get(n, "constexpr" if n in consts else "fp32" if n in floats else "i32")
           for n in k.pre_epilogue.arg_names}
    got = sm90_build(k.pre_epilogue, sig, consts, num_warps=4, num_stages=1)
    print(f"epilogue with QUANT: {got}")
    assert got["shared"] <= SM90_SHARED_LIMIT and got["regs"] <= 255 and got["stack"] == 0, got
    for fuse in (False, True):
        cfg = _cfg_for(64, fuse, 132, project=False)
        pre_ptr = {"s_ptr": "*bf16", "y_ptr": "*bf16", "y2_ptr": "*bf16", "post_prev_ptr": "*fp32",
                   "comb_prev_ptr": "*fp32", "snew_ptr": "*bf16", "fn_ptr": "*fp32", "pre_prev_ptr": "*fp32",
                   "h_ptr": "*bf16", "part_ptr": "*fp32", "w_ptr": "*bf16"}
        pc = {"C": 4, "NMIX": 24, "NP": 32, "BLOCK_T": cfg["block_t"], "BLOCK_H": cfg["block_h"], "FUSE_POST": fuse,
              "BF16_SPLIT": False, "BF16_MMA": False, "PROJECT": False, "COLLAPSE": True, "AMAX": True,
              "ADD_Y2": fuse}
        psig = {n: pre_ptr.get(n, "constexpr" if n in pc else "i32") for n in k.pre.arg_names}
        got = sm90_build(k.pre, psig, pc, cfg["num_warps"], cfg["num_stages"])
        print(f"pre kernel with AMAX, post-mix {fuse}: {got}")
        assert got["shared"] <= SM90_SHARED_LIMIT and got["regs"] <= 255 and got["stack"] == 0, got


@pytest.mark.parametrize("fuse", [False, True])
def test_one_launch_collapse_builds_for_sm90(fuse):
    """The one-launch collapse with the quantised x, with and without the post-mix (the MoE's two parts), at the
    wrapper's launch parameters for H = 5120, bf16 streams: compiles for Hopper without spills."""
    from tests.ops.conftest import SM90_SHARED_LIMIT, sm90_build

    pytest.importorskip("triton")
    kernel = mhc._kernels().collapse_rows
    cfg = mhc._rows_config(5120, fuse)
    ptr = {"s_ptr": "*bf16", "y_ptr": "*bf16", "y2_ptr": "*bf16", "post_prev_ptr": "*fp32", "comb_prev_ptr": "*fp32",
           "snew_ptr": "*bf16", "pre_prev_ptr": "*fp32", "w_ptr": "*bf16", "x_ptr": "*bf16", "q_ptr": "*u8",
           "qs_ptr": "*fp32"}
    consts = {"C": 4, "BLOCK_H": cfg["block_h"], "FUSE_POST": fuse, "ADD_Y2": fuse, "QUANT": True}
    sig = {n: ptr.get(n, "constexpr" if n in consts else "fp32" if n in ("inv_h", "eps", "floor") else "i32")
           for n in kernel.arg_names}
    got = sm90_build(kernel, sig, consts, cfg["num_warps"], 1)
    print(f"one-launch collapse, post-mix {fuse}, {cfg}: {got}")
    assert got["shared"] <= SM90_SHARED_LIMIT and got["regs"] <= 255 and got["stack"] == 0, got


def test_collapse_rows_env(monkeypatch):
    monkeypatch.delenv(mhc.COLLAPSE_ROWS_ENV, raising=False)
    assert mhc.collapse_rows() == mhc.COLLAPSE_ROWS_DEFAULT
    monkeypatch.setenv(mhc.COLLAPSE_ROWS_ENV, "4")
    assert mhc.collapse_rows() == 4
    monkeypatch.setenv(mhc.COLLAPSE_ROWS_ENV, "few")
    with pytest.raises(ValueError, match="VLLM_DSV41_MHC_COLLAPSE_ROWS"):
        mhc.collapse_rows()


@requires_cuda
@pytest.mark.parametrize("T", [1, 4, 16])
@pytest.mark.parametrize("op", ["collapse", "post_collapse", "post_collapse_add", "collapse_quant",
                                "post_collapse_quant", "post_collapse_quant_add"])
def test_cuda_one_launch_collapse(op, T):
    """The one-launch collapse at serving sizes against the reference, its stream bitwise ``mhc_post``'s, its x within
    the last bit of the two-launch route's (the sum of squares in another order), and a quantising variant's codes
    those of its own x."""
    t = make_inputs(T, 4, 5120, torch.bfloat16, seed=T, device="cuda")
    args = ARGS[op](t)
    fn = getattr(mhc, f"_mhc_{OP_OF.get(op, op)}_triton")
    got = fn(*args, config={"rows": True})
    got = got if isinstance(got, tuple) else (got,)
    two = fn(*args, config={"rows": False})
    two = two if isinstance(two, tuple) else (two,)
    ref = REFS[op](*args)
    ref = ref if isinstance(ref, tuple) else (ref,)
    for name, a, b in zip(OUT_NAMES[op], ref, got, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert_close(f"mhc_{op} rows T={T} {name}", a, b, ratio=_ratio(a.dtype, name))
    if "post" in op:
        assert torch.equal(got[0], torch.ops.dsv41.mhc_post(*args[:4], args[-1] if op.endswith("_add") else None))
    xi = OUT_NAMES[op].index("x")
    ulp = two[xi].float().abs() * 2.0 ** -7
    assert ((got[xi].float() - two[xi].float()).abs() <= ulp).all(), f"{op}: x more than an ulp from the two launches"
    if op in QUANT_OPS:
        plain = getattr(mhc, f"_mhc_{QUANT_OPS[op]}_triton")(*args, config={"rows": True})
        assert_quantised_x(f"mhc_{op} rows T={T}", got, plain)
