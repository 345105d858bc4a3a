"""The fast CUDA path's Python on CPU: vLLM's Marlin entry points replaced by plain stand-ins.

The fast path (``WeightFormat.cuda_fast``: FP8 weights dequantised to bf16 or on Marlin, Marlin MXFP4 experts,
bf16 dense weights, fused RMSNorm, bf16 queries, the fused shared expert, the grouped ``wo_a`` as one batched
GEMM, or on Marlin as one all-rows GEMM at decode) only runs on CUDA,
where a wiring mistake (a dtype, a shape, a host read inside a captured step) costs a GPU session.  Here the
tiny checkpoint is served through that code with the six vLLM kernels it calls swapped for stand-ins that
take and return what the kernels do (products of the dequantised weights, the clamped SwiGLU, the routed
experts without a host read, the RMSNorm fused with its FP8 quantisation).  In bf16 (the fast path's
dtypes): served eagerly and as the padded static decode steps that CUDA captures, under the host-read probe
of ``test_padded_static_decode_steps``.  In fp32 (the same code with fp32 in place of bf16): every logit
equals the dequantised path's to fp32 rounding, which checks the numerics of the wiring (the grouped
all-rows GEMM's diagonal, the fused [w1; w3] split, the shared cast).  The CUDA arithmetic itself is checked
on the GPU (``tests/gpu``).  Under ``w8a8`` the q norm with its fused quantisation (``VLLM_DSV41_FUSED_QUANT``)
is served both ways, to the same tokens.
"""

from __future__ import annotations

import pytest
import torch

from tests.e2e.conftest import engine
from tests.e2e.test_engine_vs_reference import (_RAW_LOGITS, _assert_logits_close, _count_ops, _counted, _generate,
                                                _vocab_logits, probe_static_steps)
from vllm_dsv41 import formats
from vllm_dsv41.checkpoint import E8M0
from vllm_dsv41.model_executor import linear
from vllm_dsv41.reference.model import clamped_swiglu_act

pytestmark = pytest.mark.engine


def _prepare_mxfp8(shim) -> None:
    """FP8 [N, K] + UE8M0 row scales [N, K/32] -> the dequantised weight (fp32; the scale unused)."""
    scale = formats.e8m0_to_float(shim.weight_scale.data.view(E8M0)).repeat_interleave(32, 1)
    shim.weight.data = shim.weight.data.float() * scale[:, : shim.weight.shape[1]]


def _apply_mxfp8(input, weight, weight_scale, workspace, size_n, size_k, **_):
    assert input.dtype == linear.FAST_GEMM_DTYPE and input.shape[-1] == size_k
    assert weight.shape == (size_n, size_k)
    return input @ weight.to(input.dtype).t()


def _prepare_moe(layer, w13, w2, s13, s2, *_):
    def deq(w, s):
        return torch.stack([formats.dequant_mxfp4(w[e].view(torch.int8), s[e].view(E8M0))
                            for e in range(w.shape[0])])

    return deq(w13, s13), deq(w2, s2), s13, s2, None, None


def _silu_clamp(a: torch.Tensor, limit: float) -> torch.Tensor:
    """vLLM's fused activation over [gate; up] in one tensor (fp32 inside, a's dtype out)."""
    n = a.shape[-1] // 2
    return clamped_swiglu_act(a[..., :n].float(), a[..., n:].float(), limit).to(a.dtype)


def _fused_marlin_moe(x, w13, w2, b1, b2, s13, s2, wts, idx, *, activation_config, **_):
    assert x.dtype == linear.FAST_GEMM_DTYPE and wts.dtype == torch.float32 and idx.dtype == torch.int32
    y = torch.zeros_like(x, dtype=torch.float32)
    for e in range(w13.shape[0]):  # every expert on every row: no host read, as inside a captured graph
        h = _silu_clamp(x @ w13[e].to(x.dtype).t(), activation_config.clamp_limit) @ w2[e].to(x.dtype).t()
        y += h.float() * (wts * (idx == e)).sum(1, keepdim=True)
    return y.to(x.dtype)


def _silu_and_mul_with_clamp(out, inp, limit, *_):
    assert out.dtype == inp.dtype and out.shape[-1] * 2 == inp.shape[-1]
    out.copy_(_silu_clamp(inp, limit))


def _rms_norm_quant(input, weight, epsilon, quant_dtype, scale_ub=None, residual=None):
    """vLLM's fused RMSNorm + dynamic per-token FP8 quantisation: the checks its CUDA entry makes (weight in the
    input's dtype, rows contiguous, an E4M3 output; no bound, no residual here) and, on CPU, the unfused route's
    arithmetic (vLLM's rms_norm, then the per-token quantisation), so that both routes serve the same numbers."""
    assert input.dim() == 2 and input.stride(-1) == 1 and weight.dtype == input.dtype and weight.dim() == 1
    assert quant_dtype == torch.float8_e4m3fn and scale_ub is None and residual is None
    return formats.quant_fp8_tokens(linear.fused_rms_norm(input, weight, epsilon))


def _emulate_fast_path(monkeypatch, dtype: torch.dtype) -> None:
    import vllm._custom_ops as vllm_ops
    import vllm.model_executor.layers.fused_moe.activation as act
    import vllm.model_executor.layers.fused_moe.experts.marlin_moe as moe
    import vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 as fp4
    import vllm.model_executor.layers.quantization.utils.marlin_utils_fp8 as fp8

    from vllm_dsv41.model_executor import model

    monkeypatch.setattr(linear, "FAST_GEMM_DTYPE", dtype)
    monkeypatch.setattr(fp8, "prepare_mxfp8_layer_for_marlin", _prepare_mxfp8)
    monkeypatch.setattr(fp8, "apply_mxfp8_marlin_linear", _apply_mxfp8)
    monkeypatch.setattr(fp4, "prepare_moe_mxfp4_layer_for_marlin", _prepare_moe)
    monkeypatch.setattr(moe, "fused_marlin_moe", _fused_marlin_moe)
    monkeypatch.setattr(act, "silu_and_mul_with_clamp", _silu_and_mul_with_clamp)
    monkeypatch.setattr(vllm_ops, "rms_norm_dynamic_per_token_quant", _rms_norm_quant)
    monkeypatch.setattr(linear, "MARLIN_MOE_ALIGN", (1, 1))  # the stand-in has no tiles
    for mod in (linear, model):
        monkeypatch.setattr(mod, "on_fast_device", lambda t: True)
    monkeypatch.setattr(linear.WeightFormat, "choose", staticmethod(lambda exact: linear.WeightFormat(True, dtype, True)))
    monkeypatch.setenv("VLLM_DSV41_OPS", "1")


def _serve_fused_quant_both_ways(tiny_ckpt, prompts, monkeypatch, calls: dict,
                                 switch_env: str = linear.FUSED_QUANT_ENV) -> tuple[tuple, tuple]:
    """The tiny model served with ``switch_env`` (default ``VLLM_DSV41_FUSED_QUANT``) ``0`` and then ``1`` (the rest of
    the environment as the caller set it), the static decode steps under the host-read probe: per run (tokens,
    vocabulary logits, a copy of ``calls``, zeroed before each run), and no host read inside a static step."""
    probe = probe_static_steps(monkeypatch)
    kw = dict(logprobs_mode="raw_logits", max_logprobs=-1, max_num_seqs=6, dtype="bfloat16")
    runs = []
    for switch in ("0", "1"):
        monkeypatch.setenv(switch_env, switch)
        calls.update(dict.fromkeys(calls, 0))
        with engine(tiny_ckpt, exact=True, **kw) as llm:
            outs = _generate(llm, prompts, logits=True)
        runs.append(([list(o.outputs[0].token_ids) for o in outs], [_vocab_logits(o) for o in outs], dict(calls)))
    assert not probe.hits, f"host reads inside static decode steps: {sorted(probe.hits)}"
    return runs[0], runs[1]


def _layout(m, dtype: torch.dtype) -> dict:
    """Which fast-path pieces the served model holds."""
    attn = [layer.attn for layer in m.model.layers]
    ffn = [layer.ffn for layer in m.model.layers]
    live = [q for q in m.modules() if isinstance(q, linear.QuantLinear) and not getattr(q, "retired", False)]
    gemms = {"bf16" if q.w16 is not None else "w8a8" if q.w8 is not None else "marlin" if q.marlin is not None
             else "fp8" if q.fp8_kept else "none" for q in live}
    return {
        "cuda_fast": m.weights.cuda_fast,
        "dense gemm": gemms.pop() if len(gemms) == 1 else sorted(gemms),
        "bf16 weights in dtype": all(q.w16.dtype == dtype for q in live if q.w16 is not None),
        "q_dtype": {a.q_dtype for a in attn} == {dtype},
        "wqkv_a fused": all(a.wqkv_a is not None for a in attn),
        "wo_a all rows": all((a.wo_a.marlin_all is not None) == (a.wo_a.marlin is not None) for a in attn),
        "router weight in dtype": all(f.gate.weight.dtype == dtype for f in ffn),
        "experts stacked": all(f.marlin is not None or f.mxfp4 is not None for f in ffn),
        "moe": "marlin" if all(f.marlin is not None for f in ffn) else "triton",
        # the MXFP4 stack that prefills of VLLM_DSV41_MOE_BF16_FROM (default 2048) tokens decode to bf16
        "prefill bf16 stack": all(f.mxfp4 is not None and f.bf16_from == 2048 for f in ffn),
        "shared w13": all(f.shared_experts.w13 is not None for f in ffn),
        "head": m.head.weight.dtype == dtype,
        "streams": str(m.stream_dtype).removeprefix("torch."),
    }


def fast_layout(gemm: str, moe: str = "marlin", streams: str = "float32") -> dict:
    return {"cuda_fast": True, "dense gemm": gemm, "bf16 weights in dtype": True, "q_dtype": True, "wqkv_a fused": True,
            "wo_a all rows": True, "router weight in dtype": True, "experts stacked": True, "moe": moe, "prefill bf16 stack": True, "shared w13": True,
            "head": True, "streams": streams}


# Static against eager decode steps: a padded static step runs the CPU GEMMs (bf16 or fp32) on other row counts
# than the eager step, which moves a row's sums by an ulp; the logits are bf16, 0.125 apart at the tiny model's
# magnitudes (16 to 32), and the first static step (step 1) moved by at most one such step when measured.  Later
# steps inherit a moved KV record, and a near-tie in a discrete choice (router top-k, indexer top-k, a cache-record
# code) can turn an ulp into another token: measured on fp32 streams, one prompt of nine (``w8a8-gemv``) chose another
# token at its fifth step, and eager steps on the padded row count (``max_num_seqs=4``: that prompt's batch of 3
# padded to 4) gave the static run's logits bit for bit.  A padding or buffer fault moves every prompt from step 1 on.
FIRST_STATIC_STEP_TOL = 0.25  # two bf16 steps at |logit| < 32
FP32_STREAM_TOKEN_MISSES = 1  # prompts whose greedy tokens may differ on fp32 streams


def _step_drift(eager: list[torch.Tensor], static: list[torch.Tensor], step: int) -> float:
    """The largest |logit difference| at ``step`` over the prompts (0: the prefill, eager in both runs; 1: the first
    decode step, static in one run)."""
    return max((a[step] - b[step]).abs().max().item() for a, b in zip(eager, static))


@pytest.mark.parametrize("gemm,streams", [("bf16", "fp32"), ("fp8", "fp32"), ("w8a8", "fp32"), ("w8a8", "auto"),
                                          ("w8a8-triton", "fp32"), ("w8a8-gemv", "fp32"), ("w8a8-woa", "fp32")])
def test_fast_path_wiring_on_cpu(tiny_ckpt, prompts, monkeypatch, gemm, streams):
    """bf16: the tiny model through the fast path's code, eager and as padded static decode steps: the
    layout is the fast one, every logit is finite, no op inside a static step reads a device value on the
    host, and the static steps give the eager run's logits and greedy tokens (dense GEMMs on bf16 weights, on the kept
    FP8 bytes through ``dsv41::fp8_gemm``, or FP8 x FP8 with the grouped ``wo_a`` on bf16): the first static step's
    logits within two bf16 steps of the eager ones for every prompt, the tokens equal for all prompts but at most one
    (a near-tie that the padded row count's ulps flip: see ``FIRST_STATIC_STEP_TOL``).

    The logit and token checks run on fp32 residual streams (``VLLM_DSV41_STREAMS=fp32``): with the default bf16
    streams a padded step's different row count moves the CPU GEMMs' fp32 sums by an ulp, which rounding the stream
    to bf16 sometimes turns into a different stream value that this random model amplifies into another token (5 of
    9 prompts kept their tokens when tried).  The default (``auto``: bf16 on the fast path) is run too, for its layout, finite
    logits, no host reads and an equal (eager) prefill step.  ``w8a8-triton``: ``VLLM_DSV41_SMALL_GEMM=triton``, the
    passes of at most 64 rows through ``dsv41::fp8_rows_gemm`` (the grouped ``wo_a`` too, on its FP8 rows), longer
    ones through the W8A8 path; ``w8a8-gemv``: ``VLLM_DSV41_SMALL_GEMM=gemv``, the passes of at most 16 rows (decode)
    through ``dsv41::fp8_gemv`` (the grouped ``wo_a`` on the FP8 copy it keeps beside the bf16 one); ``w8a8-woa``:
    ``VLLM_DSV41_GROUPED_GEMM=gemv``, only the grouped ``wo_a``'s decode passes through ``dsv41::fp8_gemv``."""
    from vllm_dsv41.ops import fp8_gemm, fp8_gemv

    dense, _, small = gemm.partition("-")
    monkeypatch.setenv(linear.DENSE_GEMM_ENV, dense)
    monkeypatch.setenv(linear.SMALL_GEMM_ENV, small if small in ("triton", "gemv") else "cutlass")
    monkeypatch.setenv(linear.GROUPED_GEMM_ENV, "gemv" if small == "woa" else "bf16")
    monkeypatch.setenv("VLLM_DSV41_STREAMS", streams)
    _emulate_fast_path(monkeypatch, torch.bfloat16)
    rows_calls = {"ungrouped": 0, "grouped": 0}
    small_op = (fp8_gemv, "fp8_gemv") if small in ("gemv", "woa") else (fp8_gemm, "fp8_rows_gemm")
    rows_gemm = getattr(*small_op)

    def counted(x, w8, w_scale, groups=1):
        rows_calls["grouped" if groups > 1 else "ungrouped"] += 1
        return rows_gemm(x, w8, w_scale, groups)

    monkeypatch.setattr(*small_op, counted)
    probe = probe_static_steps(monkeypatch)
    kw = dict(logprobs_mode="raw_logits", max_logprobs=-1, max_num_seqs=6, dtype="bfloat16")
    runs = {}
    for mode in ("0", "static"):
        monkeypatch.setenv("VLLM_DSV41_CUDAGRAPH", mode)
        with engine(tiny_ckpt, exact=True, **kw) as llm:
            layout = llm.apply_model(lambda m: _layout(m, torch.bfloat16))[0]
            outs = _generate(llm, prompts, logits=True)
            runs[mode] = ([list(o.outputs[0].token_ids) for o in outs], [_vocab_logits(o) for o in outs])
    assert layout == fast_layout(["bf16", "w8a8"] if gemm in ("w8a8", "w8a8-gemv", "w8a8-woa") else dense,
                                 streams="bfloat16" if streams == "auto" else "float32"), layout
    if small == "woa":  # the grouped layer's decode passes only
        assert rows_calls["grouped"] and not rows_calls["ungrouped"], rows_calls
    else:
        assert all(rows_calls.values()) if small else not any(rows_calls.values()), rows_calls
    for tokens, logits in runs.values():
        assert all(len(t) == 8 for t in tokens) and all(torch.isfinite(lg).all() for lg in logits)
    assert not probe.hits, f"host reads inside static decode steps: {sorted(probe.hits)}"
    same = sum(a == b for a, b in zip(*(r[0] for r in runs.values())))
    worst = _step_drift(runs["0"][1], runs["static"][1], 0)
    print(f"emulated fast path: static vs eager decode: {same}/{len(prompts)} prompts' tokens equal, "
          f"step-0 |logit difference| {worst:.2e}")
    assert worst == 0.0  # step 0 is the prefill, eager in both runs
    first = _step_drift(runs["0"][1], runs["static"][1], 1)
    print(f"  first static step: |logit difference| {first:.2e}")
    if streams == "fp32":
        assert first <= FIRST_STATIC_STEP_TOL, f"the first static decode step moved a logit by {first:.3e}"
        assert same >= len(prompts) - FP32_STREAM_TOKEN_MISSES, f"{same}/{len(prompts)} prompts' tokens equal"


@pytest.mark.parametrize("gemm,moe", [("bf16", "marlin"), ("marlin", "marlin"), ("fp8", "marlin"), ("bf16", "triton")])
def test_fast_path_numerics_on_cpu(tiny_ckpt, prompts, monkeypatch, gemm, moe):
    """fp32: the fast path's code with fp32 where the GPU uses bf16 gives the dequantised ops path's logits
    (every step, whole vocabulary) to fp32 rounding, for both dense GEMM backends and both routed-expert
    paths: the fused GEMMs' splits, the grouped wo_a (batched on the dequantised weights; on Marlin the
    all-rows diagonal at decode and per-group GEMMs at prefill; on ``fp8`` the grouped ``dsv41::fp8_gemm`` at decode
    and a per-call dequantisation at prefill), the shared expert and the routed stack
    (Marlin's stand-in, or ``dsv41::moe_mxfp4`` whose CPU implementation is its reference) compute the same
    products."""
    monkeypatch.setenv("VLLM_DSV41_OPS", "1")
    monkeypatch.setenv(linear.DENSE_GEMM_ENV, gemm)
    monkeypatch.setenv(linear.MOE_ENV, moe)
    kw = dict(logprobs_mode="raw_logits", max_logprobs=-1)
    if (None, "1") not in _RAW_LOGITS:
        with engine(tiny_ckpt, exact=True, **kw) as llm:
            _RAW_LOGITS[(None, "1")] = [_vocab_logits(o) for o in _generate(llm, prompts, logits=True)]
    _emulate_fast_path(monkeypatch, torch.float32)
    with engine(tiny_ckpt, exact=True, **kw) as llm:
        layout = llm.apply_model(lambda m: _layout(m, torch.float32))[0]
        got = [_vocab_logits(o) for o in _generate(llm, prompts, logits=True)]
    assert layout == fast_layout(gemm, moe), layout
    worst = _assert_logits_close(_RAW_LOGITS[(None, "1")], got, "emulated fast path (fp32) and dequantised path")
    print(f"emulated fast path ({gemm} dense GEMMs, {moe} MoE) in fp32 vs dequantised: largest |logit difference| {worst:.2e}")


def test_fused_norm_quant_route_on_cpu(tiny_ckpt, prompts, monkeypatch):
    """``w8a8`` with ``VLLM_DSV41_FUSED_QUANT=1`` against ``0``, served as padded static decode steps (fp32 streams, as
    the wiring test's token check): with 1 the q norm's rows reach ``wq_b`` and the indexer's ``wq_b`` pre-quantised
    (vLLM's fused kernel's stand-in, no host reads inside the static steps), every GEMM that took them is one that
    quantised its own input with 0 and the indexer layers share one quantisation between two GEMMs; with 0 the
    route is never taken; both serve the same tokens and logits (the stand-in computes the unfused arithmetic, so
    this checks the wiring: row selection, the shared rows, the GEMM on them)."""
    monkeypatch.setenv(linear.DENSE_GEMM_ENV, "w8a8")
    monkeypatch.setenv(linear.SMALL_GEMM_ENV, "cutlass")
    monkeypatch.setenv("VLLM_DSV41_STREAMS", "fp32")
    monkeypatch.setenv("VLLM_DSV41_CUDAGRAPH", "static")
    _emulate_fast_path(monkeypatch, torch.bfloat16)
    import vllm._custom_ops as vllm_ops

    calls = dict.fromkeys(("norm_quant", "gemm_on_rows", "gemm_quantising", "swiglu_quant"), 0)
    monkeypatch.setattr(vllm_ops, "rms_norm_dynamic_per_token_quant", _counted(calls, "norm_quant", _rms_norm_quant))
    monkeypatch.setattr(linear, "w8a8_gemm_rows", _counted(calls, "gemm_on_rows", linear.w8a8_gemm_rows))
    monkeypatch.setattr(linear, "w8a8_ref", _counted(calls, "gemm_quantising", linear.w8a8_ref))
    _count_ops(monkeypatch, calls, {"swiglu_quant"})
    (tok0, lg0, c0), (tok1, lg1, c1) = _serve_fused_quant_both_ways(tiny_ckpt, prompts, monkeypatch, calls)
    print(f"fused q norm + quantisation: {c1} against {c0}")
    assert c0["norm_quant"] == c0["gemm_on_rows"] == 0 and c1["norm_quant"] > 0
    assert c1["gemm_quantising"] + c1["gemm_on_rows"] == c0["gemm_quantising"]
    # the indexer layers share the q norm's rows (the activations' own quantisations, VLLM_DSV41_FUSED_ACT_QUANT, are
    # off by default)
    assert c1["swiglu_quant"] == 0 and c1["norm_quant"] < c1["gemm_on_rows"] < 2 * c1["norm_quant"]
    assert tok1 == tok0 and all(len(t) == 8 for t in tok1)
    assert all(torch.equal(a, b) for a, b in zip(lg0, lg1))


def test_fused_collapse_quant_route_on_cpu(tiny_ckpt, prompts, monkeypatch):
    """``w8a8`` on bf16 streams (the fast path's default) with ``VLLM_DSV41_FUSED_ACT_QUANT=1`` and
    ``VLLM_DSV41_FUSED_QUANT=1`` against ``0`` (which turns both off), as padded
    static decode steps: with 1 the split mHC boundary's collapses quantise x in their own launch
    (``dsv41::mhc_collapse_quant`` for ``[wq_a; wkv]``, ``dsv41::mhc_post_collapse_quant`` for the shared expert's
    ``[w1; w3]``) at every decode step of every layer, the shared expert's activation quantises h for ``w2``
    (``dsv41::swiglu_quant``), and those GEMMs take the rows instead of quantising their input themselves; with 0
    none of these ops runs.  Both serve the same tokens and bitwise the same logits (on CPU the ops are
    their references: the codes the GEMM would have made of the same x), and nothing reads a device value on the
    host inside the static steps."""
    monkeypatch.setenv(linear.DENSE_GEMM_ENV, "w8a8")
    monkeypatch.setenv(linear.SMALL_GEMM_ENV, "cutlass")
    monkeypatch.setenv(linear.FUSED_ACT_QUANT_ENV, "1")
    monkeypatch.setenv("VLLM_DSV41_STREAMS", "auto")
    monkeypatch.setenv("VLLM_DSV41_CUDAGRAPH", "static")
    monkeypatch.setenv("VLLM_DSV41_FOLD_POST", "0")  # the counts below: one collapse op per boundary kind
    _emulate_fast_path(monkeypatch, torch.bfloat16)
    ops = {"mhc_collapse", "mhc_post_collapse", "mhc_collapse_quant", "mhc_post_collapse_quant", "swiglu_quant"}
    calls = dict.fromkeys((*ops, "gemm_on_rows", "gemm_quantising"), 0)
    _count_ops(monkeypatch, calls, ops)
    monkeypatch.setattr(linear, "w8a8_gemm_rows", _counted(calls, "gemm_on_rows", linear.w8a8_gemm_rows))
    monkeypatch.setattr(linear, "w8a8_ref", _counted(calls, "gemm_quantising", linear.w8a8_ref))
    (tok0, lg0, c0), (tok1, lg1, c1) = _serve_fused_quant_both_ways(tiny_ckpt, prompts, monkeypatch, calls)
    print(f"fused collapse quantisation: {c1} against {c0}")
    assert c0["mhc_collapse_quant"] == c0["mhc_post_collapse_quant"] == c0["swiglu_quant"] == 0
    assert c0["mhc_collapse"] > 0
    # the shared expert's activation quantises h for w2 in every pass (prefill passes of <= 1,024 rows too)
    assert c1["swiglu_quant"] >= c1["mhc_post_collapse_quant"] > 0
    assert c1["mhc_collapse"] == c1["mhc_post_collapse"] == 0  # every split boundary's readers take the rows
    assert c1["mhc_collapse_quant"] == c0["mhc_collapse"] and c1["mhc_post_collapse_quant"] == c0["mhc_post_collapse"]
    # every GEMM that took rows quantised its own input with 0; per attention collapse at least two take rows ([wq_a;
    # wkv], and wq_b from the fused q norm), per FFN collapse one (the shared [w1; w3]), per activation one (w2)
    assert c1["gemm_quantising"] + c1["gemm_on_rows"] == c0["gemm_quantising"] and c0["gemm_on_rows"] == 0
    assert c1["gemm_on_rows"] >= 2 * c1["mhc_collapse_quant"] + c1["mhc_post_collapse_quant"] + c1["swiglu_quant"]
    assert tok1 == tok0 and all(len(t) == 8 for t in tok1)
    assert all(torch.equal(a, b) for a, b in zip(lg0, lg1))


def test_fused_quant_rows_through_gemv_on_cpu(tiny_ckpt, prompts, monkeypatch):
    """``VLLM_DSV41_SMALL_GEMM=gemv`` with the activations quantised by their producers (``VLLM_DSV41_FUSED_QUANT=1``,
    ``VLLM_DSV41_FUSED_ACT_QUANT=1``) against gemv quantising inside (``FUSED_QUANT=0``), as padded static decode
    steps: with 1 the decode passes' pre-quantised rows (the q norm's, the collapses', the shared SwiGLU's) reach
    ``dsv41::fp8_gemv_q``, so a decode layer launches neither vLLM's per-token quantisation nor gemv's amax pass for
    those GEMMs; with 0 no pass takes ``fp8_gemv_q``.  Same tokens, bitwise the same logits (the codes are those gemv
    would have made of the same x)."""
    from vllm_dsv41.ops import fp8_gemv

    monkeypatch.setenv(linear.DENSE_GEMM_ENV, "w8a8")
    monkeypatch.setenv(linear.SMALL_GEMM_ENV, "gemv")
    monkeypatch.setenv(linear.FUSED_ACT_QUANT_ENV, "1")
    monkeypatch.setenv("VLLM_DSV41_STREAMS", "auto")
    monkeypatch.setenv("VLLM_DSV41_CUDAGRAPH", "static")
    _emulate_fast_path(monkeypatch, torch.bfloat16)
    calls = {"gemv_q": 0, "gemv": 0}
    monkeypatch.setattr(fp8_gemv, "fp8_gemv_q", _counted(calls, "gemv_q", fp8_gemv.fp8_gemv_q))
    monkeypatch.setattr(fp8_gemv, "fp8_gemv", _counted(calls, "gemv", fp8_gemv.fp8_gemv))
    (tok0, lg0, c0), (tok1, lg1, c1) = _serve_fused_quant_both_ways(tiny_ckpt, prompts, monkeypatch, calls)
    print(f"gemv on pre-quantised rows: {c1} against {c0}")
    assert c0["gemv_q"] == 0 and c0["gemv"] > 0
    assert c1["gemv_q"] > 0 and c1["gemv_q"] + c1["gemv"] == c0["gemv"]
    assert tok1 == tok0 and all(len(t) == 8 for t in tok1)
    assert all(torch.equal(a, b) for a, b in zip(lg0, lg1))


def test_moe_add_in_post_on_cpu(tiny_ckpt, prompts, monkeypatch):
    """``VLLM_DSV41_MOE_ADD_IN_POST=1`` against ``0`` on the fast path's code (bf16 streams, padded static decode
    steps and eager prefill): with 1 every FFN boundary's ``dsv41::mhc_post`` takes the MoE's routed and shared outputs
    as two parts and the MoE adds nothing; with 0 none does.  The tokens and the logits are bitwise the same."""
    from vllm_dsv41.model_executor import model as model_mod

    monkeypatch.setenv("VLLM_DSV41_STREAMS", "auto")
    monkeypatch.setenv("VLLM_DSV41_CUDAGRAPH", "static")
    monkeypatch.setenv("VLLM_DSV41_FOLD_POST", "0")  # every FFN post-mix through mhc_post (test_fold_post_on_cpu)
    _emulate_fast_path(monkeypatch, torch.bfloat16)
    calls = {"mhc_post": 0, "two parts": 0}

    class CountedOps:
        def __getattr__(self, name):
            op = getattr(torch.ops.dsv41, name)
            if name != "mhc_post":
                return op

            def run(stream, y, post, comb, y2=None):
                calls["mhc_post"] += 1
                calls["two parts"] += y2 is not None
                return op(stream, y, post, comb, y2)
            return run

    monkeypatch.setattr(model_mod, "_ops", lambda real=model_mod._ops: (real(), CountedOps())[1])  # real(): registers
    (tok0, lg0, c0), (tok1, lg1, c1) = _serve_fused_quant_both_ways(tiny_ckpt, prompts, monkeypatch, calls,
                                                                    model_mod.MOE_ADD_ENV)
    print(f"MoE add in the post-mix: {c1} against {c0}")
    assert c0["two parts"] == 0 and c0["mhc_post"] > 0
    assert c1["two parts"] == c1["mhc_post"] == c0["mhc_post"]
    assert tok1 == tok0 and all(len(t) == 8 for t in tok1)
    assert all(torch.equal(a, b) for a, b in zip(lg0, lg1))


def test_fold_post_on_cpu(tiny_ckpt, prompts, monkeypatch):
    """``VLLM_DSV41_FOLD_POST=1`` against ``0`` on the fast path's code (bf16 streams, padded static decode steps,
    eager prefill; the MoE's add in the post-mix on): with 1 each layer's FFN post-mix is left to the next layer, which
    folds it, with the MoE's two parts, into its first boundary (``mhc_post_collapse`` at decode sizes,
    ``mhc_post_pre`` above them), so ``mhc_post`` runs once a forward pass (the last layer) instead of once a layer;
    tokens and logits bitwise the same."""
    from vllm_dsv41.model_executor import model as model_mod

    monkeypatch.setenv("VLLM_DSV41_STREAMS", "auto")
    monkeypatch.setenv("VLLM_DSV41_CUDAGRAPH", "static")
    _emulate_fast_path(monkeypatch, torch.bfloat16)
    folding = {"mhc_post_collapse", "mhc_post_collapse_quant", "mhc_post_pre"}
    calls = {"mhc_post": 0, "folded": 0, "passes": 0}

    class CountedOps:
        def __getattr__(self, name):
            op = getattr(torch.ops.dsv41, name)
            if name != "mhc_post" and name not in folding:
                return op

            def run(*a):
                if name == "mhc_post":
                    calls["mhc_post"] += 1
                elif isinstance(a[-1], torch.Tensor) and a[-1].dim() == 2:  # y2: a folded FFN post-mix
                    calls["folded"] += 1
                return op(*a)
            return run

    monkeypatch.setattr(model_mod, "_ops", lambda real=model_mod._ops: (real(), CountedOps())[1])
    forward = model_mod.DeepseekV41Model.forward

    def counted_forward(self, *a, **kw):
        calls["passes"] += 1
        return forward(self, *a, **kw)

    monkeypatch.setattr(model_mod.DeepseekV41Model, "forward", counted_forward)
    (tok0, lg0, c0), (tok1, lg1, c1) = _serve_fused_quant_both_ways(tiny_ckpt, prompts, monkeypatch, calls,
                                                                    model_mod.FOLD_POST_ENV)
    print(f"FFN post-mixes folded into the next layer: {c1} against {c0}")
    from vllm_dsv41.config import load_config

    # left unfolded: the last layer's and those before an Engram layer (which reads the streams first)
    unfolded = 1 + len(load_config(tiny_ckpt).engram_layer_ids)
    assert c0["folded"] == 0 and c1["passes"] > 0 and c1["mhc_post"] == unfolded * c1["passes"] < c0["mhc_post"]
    assert c1["folded"] + c1["mhc_post"] == c0["mhc_post"]  # every other FFN post-mix was folded
    assert tok1 == tok0 and all(len(t) == 8 for t in tok1)
    assert all(torch.equal(a, b) for a, b in zip(lg0, lg1))
