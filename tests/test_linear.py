"""The weight-holding layers of ``model_executor/linear.py`` on CPU (the GPU side: tests/gpu/test_marlin_weights.py)."""

import contextlib
import logging

import pytest
import torch

from vllm_dsv41 import formats
from vllm_dsv41.model_executor import linear
from vllm_dsv41.model_executor.linear import (QuantLinear, dense_gemm_backend, fused_rms_norm, grouped_by_all_pairs,
                                              weights_mode)
from vllm_dsv41.reference.model import rms_norm


def test_fused_rms_norm_matches_reference():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(7, 512, generator=g) * 3, torch.rand(512, generator=g)
    err = (fused_rms_norm(x, w, 1e-20) - rms_norm(x, w, 1e-20)).abs().max().item()
    assert err < 1e-5, err


N_OUT, K_IN = 4 * 64, 96


def _fp8_layer(groups: int, g: torch.Generator) -> tuple[QuantLinear, torch.Tensor]:
    """A quantised [N_OUT, K_IN] layer holding random FP8 bytes and tiles, and its dequantised weight."""
    w, s = formats.quant_fp8_block(torch.randn(N_OUT, K_IN, generator=g) * 0.1, 32)
    lin = QuantLinear(N_OUT, K_IN, quant=True, groups=groups)
    lin.weight.data.copy_(w)
    lin.scale.data.copy_(formats.as_uint8(s))
    return lin, formats.dequant_fp8_block(w, s, 32)


def _grouped_input(groups: int, g: torch.Generator) -> torch.Tensor:
    return torch.randn(3, groups, K_IN, generator=g) if groups > 1 else torch.randn(3, K_IN, generator=g)


@pytest.mark.parametrize("groups", [1, 4])
def test_quant_linear_keeps_bytes_and_dequantises_exactly(groups):
    g = torch.Generator().manual_seed(1)
    N, K = N_OUT, K_IN
    lin, ref = _fp8_layer(groups, g)
    assert torch.equal(lin.dequantized(), ref)
    lin.finalize()  # no-op off CUDA: the bytes stay as stored
    assert lin.marlin is None and lin.weight.dtype == torch.float8_e4m3fn
    x = _grouped_input(groups, g)
    want = (torch.einsum("tgk,gok->tgo", x, ref.view(groups, N // groups, K)) if groups > 1 else x @ ref.t())
    assert torch.equal(lin(x), want)


@pytest.mark.parametrize("T", [1, 5])
def test_grouped_by_all_pairs_takes_the_diagonal_blocks(T):
    """One GEMM over all of a grouped layer's rows, then group g's slice through group g's rows: the grouped
    product (the Marlin decode path of the grouped wo_a, here with a plain matmul as the GEMM)."""
    g = torch.Generator().manual_seed(2)
    G, O, K = 8, 16, 24
    w, x = torch.randn(G * O, K, generator=g), torch.randn(T, G, K, generator=g)
    calls = []

    def gemm(a):
        calls.append(a.shape)
        return a @ w.t()

    got = grouped_by_all_pairs(gemm, x)
    want = torch.einsum("tgk,gok->tgo", x, w.view(G, O, K))
    assert calls == [(T * G, K)] and got.shape == (T, G, O)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(got.flatten(1), got.reshape(T, G * O))


def test_weights_mode(monkeypatch):
    monkeypatch.delenv("VLLM_DSV41_WEIGHTS", raising=False)
    assert weights_mode(exact=False, on_cuda=True) == "quant"
    assert weights_mode(exact=True, on_cuda=True) == "dequant"
    assert weights_mode(exact=False, on_cuda=False) == "dequant"
    monkeypatch.setenv("VLLM_DSV41_WEIGHTS", "quant")
    assert weights_mode(exact=True, on_cuda=False) == "quant"
    monkeypatch.setenv("VLLM_DSV41_WEIGHTS", "fp4")
    with pytest.raises(ValueError, match="VLLM_DSV41_WEIGHTS"):
        weights_mode(exact=False, on_cuda=True)


def test_concat_rows_keeps_each_parts_rows_and_scales():
    from vllm_dsv41.model_executor.linear import concat_rows, fuse_rows_on_cuda

    g = torch.Generator().manual_seed(2)
    parts = []
    for N in (64, 32):
        w, s = formats.quant_fp8_block(torch.randn(N, 96, generator=g), 32)
        p = QuantLinear(N, 96, quant=True)
        p.weight.data.copy_(w)
        p.scale.data.copy_(formats.as_uint8(s))
        parts.append(p)
    both = concat_rows(*parts)
    assert torch.equal(both.dequantized(), torch.cat([p.dequantized() for p in parts]))
    assert fuse_rows_on_cuda(*parts) is None  # CPU: the parts stay as they are
    parts[0].retire()
    parts[0].finalize()  # a retired part does nothing
    assert not hasattr(parts[0], "weight")
    with pytest.raises(ValueError, match="concat_rows"):
        concat_rows(QuantLinear(48, 96, quant=True), parts[1])


def test_profile_run_reservation_scales_with_tokens_and_context(tmp_path, monkeypatch):
    """The profile run's activation reservation (model.activation_bytes): linear in the step's tokens but for the
    indexer's score rows, which the passes of ``index_chunk_rows`` bound (one pass, ``VLLM_DSV41_INDEX_CHUNK_MIB=0``:
    they grow with tokens and context).  Bench config at 66k: a 16k-token step under 17.5 GiB (24.08 GiB before the
    passes, too much for an 80 GB H100 beside the weights), ~9 GiB for 8k tokens."""
    import types

    from vllm_dsv41.config import load_config
    from vllm_dsv41.model_executor.model import DeepseekV41ForCausalLM
    from vllm_dsv41.tools.make_checkpoint import make_checkpoint

    make_checkpoint(str(tmp_path), preset="bench", no_engram=True)
    cfg = load_config(str(tmp_path))

    def est(T, ctx):
        fake = types.SimpleNamespace(cfg=cfg, vllm_config=types.SimpleNamespace(
            model_config=types.SimpleNamespace(max_model_len=ctx)))
        return DeepseekV41ForCausalLM.activation_bytes(fake, T)

    from vllm_dsv41.model_executor import model as model_mod

    monkeypatch.setenv(model_mod.INDEX_CHUNK_ENV, "1024")
    per_token = est(8192, 66560) - est(8191, 66560)
    assert est(16384, 66560) - est(8192, 66560) == 8192 * per_token  # the indexer's term is already at its bound
    assert est(16384, 131072) - est(16384, 66560) < 2**28
    assert 8 * 2**30 < est(8192, 66560) < 10 * 2**30 and est(16384, 66560) < 17.5 * 2**30
    assert est(1, 66560) == per_token + model_mod.INDEX_BYTES_PER_ENTRY * 66560
    monkeypatch.setenv(model_mod.INDEX_CHUNK_ENV, "0")
    assert est(8192, 66560) == 4 * est(2048, 66560)
    assert est(8192, 131072) > est(8192, 66560) + 4 * 2**30


def test_profile_run_reservation_oom_names_the_settings(monkeypatch, caplog):
    """A reservation that does not fit raises torch's OOM error again, naming the step's tokens, the GiB it asked
    for and the settings that shrink it (seen on an 80 GB H100 at max_model_len 66,560: 24.08 GiB for 16k tokens); under
    ``kv_cache_memory_bytes`` (the pool sized by the user) the same text is a warning and the start goes on."""
    import types

    from vllm_dsv41.model_executor.model import DeepseekV41ForCausalLM

    vc = types.SimpleNamespace(model_config=types.SimpleNamespace(max_model_len=66560),
                               scheduler_config=types.SimpleNamespace(max_num_batched_tokens=16384))
    fake = types.SimpleNamespace(vllm_config=vc, activation_bytes=lambda T: T * 3 * 2**19)

    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 24.00 GiB.")

    DeepseekV41ForCausalLM._reserve_activations(fake, 16, torch.device("cpu"))  # fits: no error
    monkeypatch.setattr(torch, "empty", no_memory)
    # a pool the user sized (kv_cache_memory_bytes): vLLM does not read the dummy runs' peak, so a warning, no error
    vc.cache_config = types.SimpleNamespace(kv_cache_memory_bytes=16 << 30)
    with caplog.at_level("WARNING"):
        DeepseekV41ForCausalLM._reserve_activations(fake, 16384, torch.device("cpu"))
    assert "16384-token step needs ~24.00 GiB" in caplog.text and "kv_cache_memory_bytes" in caplog.text
    vc.cache_config = types.SimpleNamespace(kv_cache_memory_bytes=None)
    with pytest.raises(torch.OutOfMemoryError) as info:
        DeepseekV41ForCausalLM._reserve_activations(fake, 16384, torch.device("cpu"))
    msg = str(info.value)
    assert "16384-token step needs ~24.00 GiB" in msg
    assert "max_num_batched_tokens=16384" in msg and "max_model_len=66560" in msg
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError)


@pytest.mark.parametrize("groups", [1, 4])
def test_bf16_dense_gemm_backend(groups, monkeypatch):
    """``VLLM_DSV41_DENSE_GEMM=bf16``: finalize on the fast device keeps the dequantised weight
    in the fast GEMM dtype and frees the FP8 bytes; the layer's output is the product with that weight (here
    in bf16 on CPU, the device seam patched), in the input's dtype."""
    monkeypatch.setenv(linear.DENSE_GEMM_ENV, "bf16")
    monkeypatch.setattr(linear, "on_fast_device", lambda t: True)
    g = torch.Generator().manual_seed(3)
    lin, ref = _fp8_layer(groups, g)
    w16 = ref.to(torch.bfloat16)
    lin.finalize()
    assert lin.marlin is None and torch.equal(lin.w16, w16) and not hasattr(lin, "weight")
    x = _grouped_input(groups, g)
    xb = x.to(torch.bfloat16)
    want = (torch.einsum("tgk,gok->tgo", xb, w16.view(groups, N_OUT // groups, K_IN)) if groups > 1
            else torch.nn.functional.linear(xb, w16))
    got = lin(x)
    assert got.dtype == x.dtype and torch.equal(got, want.float())


def test_grouped_gemv_route(monkeypatch):
    """``VLLM_DSV41_GROUPED_GEMM=gemv`` with the other layers on CUTLASS: the grouped layer keeps its FP8 rows and its
    bf16 copy, passes of at most 16 rows go through ``dsv41::fp8_gemv`` (its groups in one call), longer ones through
    the batched bf16 GEMM; an ungrouped layer is left on the default route (no GEMV rows)."""
    from vllm_dsv41.ops import fp8_gemv

    monkeypatch.setenv(linear.GROUPED_GEMM_ENV, "gemv")
    monkeypatch.delenv(linear.SMALL_GEMM_ENV, raising=False)
    monkeypatch.delenv(linear.DENSE_GEMM_ENV, raising=False)
    monkeypatch.setattr(linear, "on_fast_device", lambda t: True)
    g = torch.Generator().manual_seed(5)
    lin, ref = _fp8_layer(4, g)
    lin.finalize()
    assert lin.gemv_rows == 16 and lin.w8 is not None and torch.equal(lin.w16, ref.to(torch.bfloat16))
    x = _grouped_input(4, g)  # 3 rows: the GEMV
    want = fp8_gemv.fp8_gemv_ref(x.reshape(3, -1).bfloat16(), lin.w8, lin.w8_scale, 4).view(3, 4, -1)
    assert torch.equal(lin(x), want.to(x.dtype))
    long = torch.randn(20, 4, K_IN, generator=g)  # past the GEMV rows: the bf16 copy
    w16 = lin.w16.view(4, N_OUT // 4, K_IN)
    assert torch.equal(lin(long), torch.einsum("tgk,gok->tgo", long.bfloat16(), w16).float())
    plain, _ = _fp8_layer(1, g)
    plain.finalize()
    assert plain.gemv_rows == 0 and plain.w16 is None and plain.w8 is not None


def test_grouped_gemm_backend_env(monkeypatch):
    monkeypatch.delenv(linear.GROUPED_GEMM_ENV, raising=False)
    assert linear.grouped_gemm_backend() == "bf16"
    monkeypatch.setenv(linear.GROUPED_GEMM_ENV, " GEMV ")
    assert linear.grouped_gemm_backend() == "gemv"
    monkeypatch.setenv(linear.GROUPED_GEMM_ENV, "cutlass")
    with pytest.raises(ValueError, match="VLLM_DSV41_GROUPED_GEMM='cutlass': expected bf16, fused_moe or gemv"):
        linear.grouped_gemm_backend()


def test_dense_gemm_backend_env(monkeypatch):
    monkeypatch.delenv(linear.DENSE_GEMM_ENV, raising=False)
    assert dense_gemm_backend() == "w8a8"
    monkeypatch.setenv(linear.DENSE_GEMM_ENV, "BF16")
    assert dense_gemm_backend() == "bf16"
    monkeypatch.setenv(linear.DENSE_GEMM_ENV, " Marlin ")
    assert dense_gemm_backend() == "marlin"
    monkeypatch.setenv(linear.DENSE_GEMM_ENV, "FP8")
    assert dense_gemm_backend() == "fp8"
    monkeypatch.setenv(linear.DENSE_GEMM_ENV, "w8a8")
    assert dense_gemm_backend() == "w8a8"
    monkeypatch.setenv(linear.DENSE_GEMM_ENV, "fp4")
    with pytest.raises(ValueError, match="VLLM_DSV41_DENSE_GEMM='fp4': expected bf16, w8a8, marlin or fp8"):
        dense_gemm_backend()


def test_moe_bf16_from_env(monkeypatch):
    monkeypatch.delenv(linear.MOE_BF16_FROM_ENV, raising=False)
    assert linear.moe_bf16_from() == linear.moe_bf16_from("marlin") == 2048
    assert linear.moe_bf16_from("ogs") == 0  # matmul_ogs beats the bf16 path at prefill sizes too
    monkeypatch.setenv(linear.MOE_BF16_FROM_ENV, "0")
    assert linear.moe_bf16_from() == 0
    monkeypatch.setenv(linear.MOE_BF16_FROM_ENV, "8192")
    assert linear.moe_bf16_from("ogs") == 8192
    for bad in ("-1", "many"):
        monkeypatch.setenv(linear.MOE_BF16_FROM_ENV, bad)
        with pytest.raises(ValueError, match=f"VLLM_DSV41_MOE_BF16_FROM='{bad}'"):
            linear.moe_bf16_from()


def test_moe_takes_the_bf16_path_from_the_threshold(monkeypatch):
    """On the fast device (seam patched) a forward of at least ``VLLM_DSV41_MOE_BF16_FROM`` tokens runs the routed
    experts through ``bf16_moe`` (here recorded, computing the MXFP4 reference), smaller ones through the decode
    kernel (``moe_mxfp4`` with ``VLLM_DSV41_MOE=triton``; its CPU op is the reference); both give the expert loop."""
    from vllm_dsv41.model_executor import model as m

    monkeypatch.setattr(m, "on_fast_device", lambda t: True)
    monkeypatch.setenv(linear.MOE_ENV, "triton")
    monkeypatch.setenv(linear.MOE_BF16_FROM_ENV, "8")
    calls = []
    monkeypatch.setattr(m, "bf16_moe", _recording_reference(calls))
    moe, experts = _cpu_moe(m)
    moe.finalize()
    assert moe.bf16_from == 8 and moe.mxfp4 is not None and not hasattr(moe, "experts")
    for T in (3, 8, 20):
        _assert_expert_loop(m, moe, experts, T)
    assert calls == [8, 20]


def _recording_reference(calls: list):
    """A stand-in for an expert backend: records the batch size, computes the MXFP4 reference on the stack."""
    from vllm_dsv41.ops.moe_mxfp4 import moe_mxfp4_ref

    def run(x, stack, idx, wts, limit):
        calls.append(x.shape[0])
        return moe_mxfp4_ref(x, *stack, idx, wts, limit)
    return run


def _assert_expert_loop(m, moe, experts, T: int, static: bool = False) -> None:
    """``moe`` on T random rows (inside a static decode step if asked) equals the expert loop of ``experts``."""
    from vllm_dsv41.model_executor import graphs

    x = torch.randn(T, moe.gate.weight.shape[1], generator=torch.Generator().manual_seed(T))
    idx, wts = m.route(x, moe.gate.weight, moe.gate.bias, moe.k, 1.0)
    want = linear.loop_moe(x, experts, idx, wts, 2.0)
    with graphs._static_step() if static else contextlib.nullcontext():
        got = moe(x)
    assert (got - want).abs().max().item() < 1e-4 * want.abs().max().item()


def _cpu_moe(m, H: int = 64, I: int = 64, E: int = 4, k: int = 2):
    """A quantised MoE layer (random MXFP4 experts, a zero shared expert, limit 2) built without a config, and its
    experts; ``finalize`` is left to the test."""
    from tests.ops.test_moe_mxfp4 import experts_from_stack, make_case

    moe = m.MoE.__new__(m.MoE)
    torch.nn.Module.__init__(moe)
    moe.k, moe.scale, moe.limit, moe.act_dtype = k, 1.0, 2.0, torch.float32
    moe.gate = m.Gate(E, H)
    moe.gate.weight.data.normal_()
    _, w13, s13, w2, s2, _, _ = make_case(1, H, I, E, k)
    experts = moe.experts = experts_from_stack(w13, s13, w2, s2)
    moe.shared_experts = lambda x: torch.zeros_like(x)
    moe.marlin, moe.mxfp4, moe.ogs = None, None, None
    return moe, experts


def test_moe_backend_env(monkeypatch):
    monkeypatch.delenv(linear.MOE_ENV, raising=False)
    assert linear.moe_backend() == "auto"
    for v, want in ((" OGS ", "ogs"), ("triton", "triton"), ("Marlin", "marlin")):
        monkeypatch.setenv(linear.MOE_ENV, v)
        assert linear.moe_backend() == want
    monkeypatch.setenv(linear.MOE_ENV, "ogz")
    with pytest.raises(ValueError, match="VLLM_DSV41_MOE='ogz': expected auto, ogs, marlin or triton"):
        linear.moe_backend()


def test_fp8_moe_gemm_env(monkeypatch):
    """``VLLM_DSV41_FP8_MOE_GEMM`` picks the prefill FP8 experts' grouped GEMM; a bad value names the variable."""
    monkeypatch.delenv(linear.FP8_MOE_GEMM_ENV, raising=False)
    assert linear.fp8_moe_gemm_backend() == "triton"
    monkeypatch.setenv(linear.FP8_MOE_GEMM_ENV, " CUTLASS ")
    assert linear.fp8_moe_gemm_backend() == "cutlass"
    monkeypatch.setenv(linear.FP8_MOE_GEMM_ENV, "deepgemm")
    with pytest.raises(ValueError, match="VLLM_DSV41_FP8_MOE_GEMM='deepgemm': expected triton or cutlass"):
        linear.fp8_moe_gemm_backend()


@pytest.mark.parametrize("version,hidden,inter,want", [
    ("3.5.1", 5120, 2304, "ogs"),     # the bench / full widths, triton_kernels as vLLM's CUDA wheel vendors it
    ("3.6", 5120, 2304, "ogs"),
    ("3.5.1", 512, 192, "marlin"),    # widths Marlin tiles that matmul_ogs was not measured at
    ("3.5.1", 64, 32, "loop"),        # the tiny model: below Marlin's tiles too
    (None, 5120, 2304, "marlin"),     # no triton_kernels (the CPU wheel)
    ("3.8", 5120, 2304, "marlin"),    # a triton_kernels without matmul_ogs
    (None, 64, 32, "loop"),
])
def test_auto_moe_backend(version, hidden, inter, want, monkeypatch):
    from vllm.utils import import_utils

    monkeypatch.setattr(import_utils, "get_triton_kernels_version", lambda: version)
    assert linear.resolve_moe_backend("auto", hidden, inter) == want
    for explicit in ("ogs", "triton"):  # an explicit choice is kept (ogs then fails where it cannot run)
        assert linear.resolve_moe_backend(explicit, hidden, inter) == explicit
    if hidden % 128 == 0 and inter % 64 == 0:
        assert linear.resolve_moe_backend("marlin", hidden, inter) == "marlin"
    else:  # Marlin's launch would fail at the first large batch ("Invalid thread config"): refused at load, named
        with pytest.raises(ValueError, match=f"hidden size {hidden} and intermediate size {inter}"):
            linear.resolve_moe_backend("marlin", hidden, inter)


@pytest.mark.parametrize("version,why", [(None, "does not import"), ("3.8", "no matmul_ogs")])
def test_ogs_needs_triton_kernels_at_engine_start(version, why, monkeypatch):
    """Without a ``triton_kernels`` that has ``matmul_ogs`` (the CPU wheel ships none), ``VLLM_DSV41_MOE=ogs`` fails
    where the experts are stacked, in the MoE layer's ``finalize`` (engine start), naming the variable."""
    from vllm.utils import import_utils

    from vllm_dsv41.model_executor import model as m

    monkeypatch.setattr(import_utils, "get_triton_kernels_version", lambda: version)
    monkeypatch.setattr(m, "on_fast_device", lambda t: True)
    monkeypatch.setenv(linear.MOE_ENV, "ogs")
    moe, experts = _cpu_moe(m)
    msg = f"VLLM_DSV41_MOE=ogs needs the triton_kernels .*{why}"
    with pytest.raises(RuntimeError, match=msg):
        linear.ogs_expert_stack(experts)
    with pytest.raises(RuntimeError, match=msg):
        moe.finalize()


def test_moe_takes_the_ogs_path_in_and_out_of_static_steps(monkeypatch):
    """``VLLM_DSV41_MOE=ogs`` on the fast device (seam patched): ``finalize`` builds only the ogs stack (no Marlin, no
    bf16 prefill stack with ``VLLM_DSV41_MOE_BF16_FROM=0``) and every forward, captured decode steps included (its
    routing reads nothing on the host), goes through ``ogs_moe`` (here the MXFP4 reference on the stacked bytes)."""
    from vllm_dsv41.model_executor import model as m

    monkeypatch.setattr(m, "on_fast_device", lambda t: True)
    monkeypatch.setenv(linear.MOE_ENV, "ogs")
    monkeypatch.setenv(linear.MOE_BF16_FROM_ENV, "0")
    monkeypatch.setenv(linear.MOE_FP8_FROM_ENV, "0")
    monkeypatch.setenv(linear.MOE_GEMV_ROWS_ENV, "0")  # the one-token route off (its own test below)
    monkeypatch.setattr(m, "ogs_expert_stack", linear.mxfp4_expert_stack)
    calls = []
    monkeypatch.setattr(m, "ogs_moe", _recording_reference(calls))
    moe, experts = _cpu_moe(m)
    moe.finalize()
    assert moe.ogs is not None and moe.marlin is None and moe.mxfp4 is None and not hasattr(moe, "experts")
    _assert_expert_loop(m, moe, experts, 3)
    _assert_expert_loop(m, moe, experts, 4, static=True)
    assert calls == [3, 4]


def test_moe_gemv_rows_env(monkeypatch):
    monkeypatch.delenv(linear.MOE_GEMV_ROWS_ENV, raising=False)
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert linear.moe_gemv_rows(cpu) == linear.DEFAULT_MOE_GEMV_ROWS == 1
    monkeypatch.setattr(linear, "w8a8_supported", lambda d: False)  # no FP8 tensor cores (the op's MMAs): off
    assert linear.moe_gemv_rows(gpu) == 0
    monkeypatch.setenv(linear.MOE_GEMV_ROWS_ENV, "4")
    assert linear.moe_gemv_rows(gpu) == 4
    for bad, msg in (("17", "VLLM_DSV41_MOE_GEMV_ROWS=17: moe_gemv serves at most 16 tokens"),
                     ("-1", "VLLM_DSV41_MOE_GEMV_ROWS='-1'"), ("one", "VLLM_DSV41_MOE_GEMV_ROWS='one'")):
        monkeypatch.setenv(linear.MOE_GEMV_ROWS_ENV, bad)
        with pytest.raises(ValueError, match=msg):
            linear.moe_gemv_rows(cpu)


def test_moe_one_token_route_by_default(monkeypatch):
    """Defaults on the fast device (seams patched, ogs backend): ``finalize`` keeps the MXFP4 stack beside the ogs one
    and reserves moe_gemv's buffers; a one-token forward (bf16 into the experts), inside a static decode step or not, runs
    ``dsv41::moe_gemv`` on the stack (its output is the layer's, bit for bit), two tokens run ``ogs_moe``."""
    import types

    from vllm_dsv41.model_executor import graphs
    from vllm_dsv41.model_executor import model as m
    from vllm_dsv41.ops import moe_gemv

    monkeypatch.setattr(m, "on_fast_device", lambda t: True)
    monkeypatch.setenv(linear.MOE_ENV, "ogs")
    for env in (linear.MOE_GEMV_ROWS_ENV, linear.MOE_BF16_FROM_ENV):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setenv(linear.MOE_FP8_FROM_ENV, "0")  # so the MXFP4 stack is the route's doing
    monkeypatch.setattr(m, "ogs_expert_stack", linear.mxfp4_expert_stack)
    ogs_calls, gemv_calls, reserved = [], [], []
    monkeypatch.setattr(m, "ogs_moe", _recording_reference(ogs_calls))
    real = m._ops()

    def gemv(x, *args):
        gemv_calls.append(x.shape[0])
        return real.moe_gemv(x, *args)
    monkeypatch.setattr(m, "_ops", lambda: types.SimpleNamespace(moe_gemv=gemv, router=real.router))
    monkeypatch.setattr(moe_gemv, "reserve", lambda dev, H, I, k, rows, streams: reserved.append((H, I, k, rows)))
    moe, _ = _cpu_moe(m)
    moe.act_dtype = torch.bfloat16
    moe.finalize()
    assert moe.gemv_rows == 1 and moe.ogs is not None and moe.mxfp4 is not None and reserved == [(64, 64, 2, 1)]
    for T, static in ((1, False), (1, True), (2, False), (2, True)):
        x = torch.randn(T, 64, generator=torch.Generator().manual_seed(T))  # fp32 streams; the experts read bf16
        with graphs._static_step() if static else contextlib.nullcontext():
            got = moe(x)
        if T == 1:
            idx, wts = m.route(x, moe.gate.weight, moe.gate.bias, moe.k, 1.0)
            assert torch.equal(got, real.moe_gemv(x.bfloat16(), *moe.mxfp4, idx, wts, 2.0))
    assert gemv_calls == [1, 1] and ogs_calls == [2, 2]


def test_moe_fp8_from_env(monkeypatch):
    monkeypatch.delenv(linear.MOE_FP8_FROM_ENV, raising=False)
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert linear.moe_fp8_from(cpu) == linear.DEFAULT_MOE_FP8_FROM == 4096
    monkeypatch.setattr(linear, "w8a8_supported", lambda d: False)  # no FP8 tensor cores: off unless asked
    assert linear.moe_fp8_from(gpu) == 0
    monkeypatch.setenv(linear.MOE_FP8_FROM_ENV, "16384")
    assert linear.moe_fp8_from(gpu) == 16384
    monkeypatch.setenv(linear.MOE_FP8_FROM_ENV, "0")
    assert linear.moe_fp8_from(cpu) == 0
    for bad in ("-2", "lots"):
        monkeypatch.setenv(linear.MOE_FP8_FROM_ENV, bad)
        with pytest.raises(ValueError, match=f"VLLM_DSV41_MOE_FP8_FROM='{bad}'"):
            linear.moe_fp8_from(cpu)


def test_moe_takes_the_fp8_path_from_the_threshold(monkeypatch):
    """With ``VLLM_DSV41_MOE_FP8_FROM`` set (ogs decode backend, stand-ins on CPU) ``finalize`` keeps the MXFP4 stack
    and its per-row exponents, and a forward of at least that many tokens outside static steps runs ``fp8_moe`` (here
    recorded: it must get the stack's rows, and computes the exact MXFP4 reference) before any bf16 threshold; smaller
    ones and static steps keep the decode backend."""
    from vllm_dsv41.model_executor import model as m

    monkeypatch.setattr(m, "on_fast_device", lambda t: True)
    monkeypatch.setenv(linear.MOE_ENV, "ogs")
    monkeypatch.setenv(linear.MOE_BF16_FROM_ENV, "8")
    monkeypatch.setenv(linear.MOE_FP8_FROM_ENV, "8")
    monkeypatch.setattr(m, "ogs_expert_stack", linear.mxfp4_expert_stack)
    ogs_calls, fp8_calls, bf16_calls = [], [], []
    monkeypatch.setattr(m, "ogs_moe", _recording_reference(ogs_calls))
    monkeypatch.setattr(m, "bf16_moe", _recording_reference(bf16_calls))
    moe, experts = _cpu_moe(m)

    def fp8_stand_in(x, stack, rows, idx, wts, limit):
        want = linear.fp8_row_exponents(stack)
        assert all(torch.equal(a, b) for a, b in zip(rows, want))
        return _recording_reference(fp8_calls)(x, stack, idx, wts, limit)

    monkeypatch.setattr(m, "fp8_moe", fp8_stand_in)
    moe.finalize()
    assert moe.fp8_from == 8 and moe.mxfp4 is not None and moe.fp8_rows is not None
    for T in (3, 8, 20):
        _assert_expert_loop(m, moe, experts, T)
    _assert_expert_loop(m, moe, experts, 12, static=True)
    assert fp8_calls == [8, 20] and ogs_calls == [3, 12] and bf16_calls == []


def test_fp8_moe_reference_is_the_expert_loop_to_fp8_precision():
    """``fp8_moe``'s arithmetic (FP8 weights under per-row scales, per-token FP8 activations) against the fp32 loop
    over the dequantised experts: the activations' E4M3 rounding, as the W8A8 dense GEMMs (~3e-2)."""
    from vllm_dsv41.model_executor import model as m

    moe, experts = _cpu_moe(m, H=128, I=64, E=6, k=3)
    x = torch.randn(40, 128, generator=torch.Generator().manual_seed(5))
    idx, wts = m.route(x, moe.gate.weight, moe.gate.bias, moe.k, 1.0)
    want = linear.loop_moe(x, experts, idx, wts, 2.0)
    got = linear.fp8_moe_ref(x, linear.mxfp4_expert_stack(experts), idx, wts, 2.0)
    err = ((got - want).norm() / want.norm()).item()
    assert 1e-3 < err < 6e-2, err  # FP8 rounding is there, and only that


def test_beside_runs_both_in_order_off_cuda(monkeypatch):
    """Off CUDA (and with ``VLLM_DSV41_OVERLAP_ROWS=0``) :func:`overlap.beside` runs the side callable first, then the
    main one, and returns (main, side); the row limit comes from the environment, a bad one is named."""
    from vllm_dsv41.model_executor import overlap

    order = []
    x = torch.zeros(4, 2)
    got = overlap.beside(x, lambda: order.append("side") or 1, lambda: order.append("main") or 2)
    assert got == (2, 1) and order == ["side", "main"] and overlap.side_stream_for(x) is None
    monkeypatch.delenv(overlap.OVERLAP_ROWS_ENV, raising=False)
    assert overlap.overlap_rows() == overlap.DEFAULT_OVERLAP_ROWS
    monkeypatch.setenv(overlap.OVERLAP_ROWS_ENV, "0")
    assert overlap.overlap_rows() == 0
    monkeypatch.setenv(overlap.OVERLAP_ROWS_ENV, "x")
    with pytest.raises(ValueError, match="VLLM_DSV41_OVERLAP_ROWS='x'"):
        overlap.overlap_rows()


def test_prefetching_is_a_hint_off_cuda_and_names_a_bad_switch(monkeypatch):
    """:func:`overlap.prefetching` returns ``main()`` whatever the switch (off CUDA no prefetch is issued); the switch
    names its targets (``1``: wo_a, ``all``, a comma list), and an unknown one fails naming the variable."""
    from vllm_dsv41.model_executor import overlap

    x, w = torch.zeros(1, 8), torch.zeros(4, 8)
    calls = []
    for v in ("0", "1", "all", "qkv_a, w13"):
        monkeypatch.setenv(overlap.L2_PREFETCH_ENV, v)
        assert overlap.prefetching(x, w, lambda: calls.append(v) or v, "w13") == v
        assert overlap.prefetching(x, None, lambda: v) == v
    assert calls == ["0", "1", "all", "qkv_a, w13"] and overlap.side_stream_for(x, lane=2) is None
    want = {"0": set(), "1": {"wo_a"}, "all": set(overlap.PREFETCH_TARGETS), "w13,wo_a": {"w13", "wo_a"}}
    for v, targets in want.items():
        monkeypatch.setenv(overlap.L2_PREFETCH_ENV, v)
        assert overlap.l2_prefetch_targets() == targets
    for bad in ("yes", "wo_a,wq_b", ","):
        monkeypatch.setenv(overlap.L2_PREFETCH_ENV, bad)
        with pytest.raises(ValueError, match="VLLM_DSV41_L2_PREFETCH"):
            overlap.prefetching(x, w, lambda: None)


def test_weight_read_names_the_streamed_tensor(monkeypatch):
    """``QuantLinear.weight_read``: the grouped layer under ``VLLM_DSV41_GROUPED_GEMM=gemv`` streams its E4M3 rows for
    GEMV passes and its bf16 copy for longer ones; a bf16 layer its bf16 matrix."""
    monkeypatch.setenv(linear.GROUPED_GEMM_ENV, "gemv")
    monkeypatch.delenv(linear.SMALL_GEMM_ENV, raising=False)
    monkeypatch.delenv(linear.DENSE_GEMM_ENV, raising=False)
    monkeypatch.setattr(linear, "on_fast_device", lambda t: True)
    g = torch.Generator().manual_seed(6)
    lin, _ = _fp8_layer(4, g)
    lin.finalize()
    assert lin.weight_read(1) is lin.w8 and lin.weight_read(16) is lin.w8 and lin.weight_read(17) is lin.w16
    monkeypatch.setenv(linear.DENSE_GEMM_ENV, "bf16")
    monkeypatch.delenv(linear.GROUPED_GEMM_ENV)
    plain, _ = _fp8_layer(1, g)
    plain.finalize()
    assert plain.w16 is not None and plain.weight_read(1) is plain.w16


def test_bf16_moe_takes_our_tiles_where_vllm_has_no_tuned_file(monkeypatch):
    """32 experts of 2304 (the bench): vLLM ships no tuned file, so the H200 sweep's winner; where a file exists
    (here faked), vLLM's tuned choice for the batch."""
    from vllm.model_executor.layers.fused_moe import fused_moe as fm

    w13, w2 = (32, 4608, 5120), (32, 5120, 2304)
    assert linear._bf16_moe_tiles(w13, w2, 6, 16384) == linear.BF16_MOE_TILES
    tuned = {4096: dict(BLOCK_SIZE_M=64, BLOCK_SIZE_N=64, BLOCK_SIZE_K=64, GROUP_SIZE_M=8, num_warps=4, num_stages=3)}
    monkeypatch.setattr(fm, "get_moe_configs", lambda E, N, dtype, *a, **kw: tuned if (E, N) == (32, 2304) else None)
    assert linear._bf16_moe_tiles(w13, w2, 6, 16384) == tuned[4096]


def test_w8a8_dense_gemm_backend(monkeypatch):
    """``VLLM_DSV41_DENSE_GEMM=w8a8``: finalize on the fast device keeps the weight as E4M3 rows under one power-of-two
    scale each (here exact: the tiles of a row are within E4M3's range of each other) and frees the tiled bytes; the
    output is the per-token FP8 quantisation of the bf16 input times that weight (the CPU reference of the CUDA
    kernel), which is within FP8's rounding of the exact product; a grouped layer keeps the bf16 batched GEMM."""
    monkeypatch.setenv(linear.DENSE_GEMM_ENV, "w8a8")
    monkeypatch.setattr(linear, "on_fast_device", lambda t: True)
    g = torch.Generator().manual_seed(5)
    lin, ref = _fp8_layer(1, g)
    lin.finalize()
    assert lin.w16 is None and lin.w8.dtype == torch.float8_e4m3fn and not hasattr(lin, "weight")
    assert torch.equal(lin.w8.float() * lin.w8_scale, ref)
    x = _grouped_input(1, g)
    xb = x.to(torch.bfloat16)
    q, sa = formats.quant_fp8_tokens(xb)
    want = ((q.float() @ lin.w8.float().t()) * sa * lin.w8_scale.t()).to(torch.bfloat16).float()
    got = lin(x)
    assert got.dtype == x.dtype and torch.equal(got, want)
    exact = xb.float() @ ref.t()
    err = ((got - exact).norm() / exact.norm()).item()
    assert 1e-3 < err < 4e-2, err  # FP8 activations: ~2.7e-2 on random data (bf16 weights alone: ~2e-3)
    assert linear.w8a8_gemm(xb[:0], lin.w8, lin.w8_scale).shape == (0, N_OUT)

    grouped, gref = _fp8_layer(4, g)
    grouped.finalize()
    assert grouped.w8 is None and torch.equal(grouped.w16, gref.to(torch.bfloat16))


def test_gemv_small_gemm_route(monkeypatch):
    """``VLLM_DSV41_SMALL_GEMM=gemv``: passes of 1 .. ``VLLM_DSV41_GEMV_ROWS`` rows go through ``dsv41::fp8_gemv`` (bf16
    rows) or ``dsv41::fp8_gemv_q`` (QuantRows) and give bitwise what the CUTLASS route's reference gives; longer passes
    keep that route; the grouped layer keeps both its FP8 rows (short passes, each (token, group) slice under its own
    scale) and the bf16 weight (longer passes: the batched GEMM); a bad row count names the variable."""
    from vllm_dsv41.ops import fp8_gemv

    monkeypatch.setenv(linear.DENSE_GEMM_ENV, "w8a8")
    monkeypatch.setenv(linear.SMALL_GEMM_ENV, "gemv")
    monkeypatch.setenv(linear.GEMV_ROWS_ENV, "4")
    monkeypatch.setattr(linear, "on_fast_device", lambda t: True)
    calls = []
    for name in ("fp8_gemv", "fp8_gemv_q"):
        op = getattr(fp8_gemv, name)
        monkeypatch.setattr(fp8_gemv, name, lambda *a, _op=op, _n=name: calls.append(_n) or _op(*a))
    g = torch.Generator().manual_seed(15)
    lin, _ = _fp8_layer(1, g)
    lin.finalize()
    assert lin.gemv_rows == 4 and lin.w16 is None
    x = torch.randn(6, K_IN, generator=g).to(torch.bfloat16)
    for T, route in ((1, ["fp8_gemv"]), (4, ["fp8_gemv"]), (5, []), (6, [])):
        calls.clear()
        got = lin(x[:T])
        assert calls == route and torch.equal(got, linear.w8a8_ref(x[:T], lin.w8, lin.w8_scale).bfloat16()), T
    rows, _ = _prequantised(3, g)
    calls.clear()
    assert torch.equal(lin(rows), linear.w8a8_gemm_rows(rows, lin.w8, lin.w8_scale)) and calls == ["fp8_gemv_q"]
    assert linear.reads_quantised_rows([lin], torch.bfloat16)

    grouped, gref = _fp8_layer(4, g)
    grouped.finalize()
    assert grouped.w8 is not None and torch.equal(grouped.w16, gref.to(torch.bfloat16))
    xg = torch.randn(5, 4, K_IN, generator=g).to(torch.bfloat16)
    calls.clear()
    got = grouped(xg[:2])
    n = N_OUT // 4
    want = torch.stack([linear.w8a8_ref(xg[:2, j], grouped.w8[j * n:(j + 1) * n], grouped.w8_scale[j * n:(j + 1) * n])
                        for j in range(4)], 1).bfloat16()
    assert calls == ["fp8_gemv"] and got.shape == (2, 4, n) and torch.equal(got, want)
    calls.clear()
    assert torch.equal(grouped(xg), torch.einsum("tgk,gok->tgo", xg, grouped.w16.view(4, n, K_IN)))
    assert calls == []
    monkeypatch.setenv(linear.GEMV_ROWS_ENV, "17")
    with pytest.raises(ValueError, match="VLLM_DSV41_GEMV_ROWS=17: fp8_gemv serves at most 16 rows"):
        linear.gemv_rows()
    monkeypatch.setenv(linear.SMALL_GEMM_ENV, "gemm")
    with pytest.raises(ValueError, match="VLLM_DSV41_SMALL_GEMM='gemm': expected cutlass, gemv or triton"):
        linear.small_gemm_backend()


def test_grouped_w8a8_through_fused_moe_switch(monkeypatch):
    """``VLLM_DSV41_GROUPED_GEMM=fused_moe``: a grouped layer under ``w8a8`` keeps E4M3 rows too, and each (token,
    group) slice goes through its group's rows under its own per-slice FP8 quantisation (the CPU arithmetic of the
    CUDA fused-MoE call: ``w8a8_ref`` per group), within FP8's rounding of the exact grouped product.  The default
    keeps bf16; a misspelt value is an error."""
    monkeypatch.setenv(linear.DENSE_GEMM_ENV, "w8a8")
    monkeypatch.setattr(linear, "on_fast_device", lambda t: True)
    monkeypatch.delenv(linear.GROUPED_GEMM_ENV, raising=False)
    assert linear.grouped_gemm_backend() == "bf16"
    monkeypatch.setenv(linear.GROUPED_GEMM_ENV, "Fused_MoE ")
    assert linear.grouped_gemm_backend() == "fused_moe"
    G, n = 4, N_OUT // 4
    gen = torch.Generator().manual_seed(6)
    lin, ref = _fp8_layer(G, gen)
    lin.finalize()
    assert lin.w16 is None and lin.w8.dtype == torch.float8_e4m3fn and torch.equal(lin.w8.float() * lin.w8_scale, ref)
    x = _grouped_input(G, gen)
    got = lin(x)
    assert got.dtype == x.dtype and got.shape == (x.shape[0], G, n)
    xb = x.to(torch.bfloat16)
    for g in range(G):
        q, sa = formats.quant_fp8_tokens(xb[:, g])
        rows = slice(g * n, (g + 1) * n)
        want = (q.float() @ lin.w8[rows].float().t()) * sa * lin.w8_scale[rows].t()
        assert torch.equal(got[:, g], want.to(torch.bfloat16).float()), g
    exact = torch.einsum("tgk,gok->tgo", xb.float(), ref.view(G, n, K_IN))
    err = ((got - exact).norm() / exact.norm()).item()
    assert 1e-3 < err < 4e-2, err
    assert linear.grouped_w8a8(xb[:0], lin.w8, lin.w8_scale).shape == (0, G, n)
    monkeypatch.setenv(linear.GROUPED_GEMM_ENV, "moe")
    with pytest.raises(ValueError, match="VLLM_DSV41_GROUPED_GEMM='moe'"):
        linear.grouped_gemm_backend()


def test_moe_too_narrow_for_fused_kernels_keeps_the_expert_loop(tiny_ckpt, monkeypatch):
    """A quantised MoE on the fast device whose widths neither matmul_ogs nor Marlin tile (the tiny preset's 64 x 32)
    keeps its experts and runs the expert loop on them (no stack, no bf16 prefill copy), instead of failing at the
    first large batch inside Marlin; the output is the loop's over the dequantised experts."""
    from vllm_dsv41.config import load_config
    from vllm_dsv41.model_executor import model

    monkeypatch.delenv(linear.MOE_ENV, raising=False)
    for mod in (linear, model):
        monkeypatch.setattr(mod, "on_fast_device", lambda t: True)
    cfg = load_config(tiny_ckpt)
    plan = cfg.plans[0]
    moe = model.MoE(cfg, plan, linear.WeightFormat(True, torch.float32, True))
    g = torch.Generator().manual_seed(2)
    for ex in moe.experts:
        for name in ("w1", "w3", "w2"):
            sub = getattr(ex, name)
            packed, sc = formats.quant_mxfp4(torch.randn(sub.weight.shape[0], 2 * sub.weight.shape[1], generator=g))
            sub.weight.data.copy_(packed.view(torch.int8))
            sub.scale.data.copy_(formats.as_uint8(sc))
    moe.gate.weight.data.normal_(generator=g)
    moe.finalize()
    assert moe.marlin is None and moe.mxfp4 is None and moe.ogs is None and moe.bf16_from == 0
    assert len(moe.experts) == plan.n_routed_experts
    x = torch.randn(300, cfg.hidden_size, generator=g)
    idx, wts = model.route(x, moe.gate.weight, moe.gate.bias, moe.k, moe.scale)
    want = linear.loop_moe(x, moe.experts, idx, wts, moe.limit)
    torch.testing.assert_close(moe(x) - moe.shared_experts(x), want)


def test_w8a8_falls_back_to_bf16_without_fp8_tensor_cores(monkeypatch):
    """On a CUDA device below compute capability 8.9 (no FP8 tensor cores: e.g. an A100) the default ``w8a8`` keeps the
    bf16 weights instead of failing at the first forward, and says so once; 8.9 and 9.0 take ``w8a8``."""
    monkeypatch.delenv(linear.DENSE_GEMM_ENV, raising=False)
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100")
    records = []  # on the module's logger itself (vLLM's logging setup may stop records reaching caplog)
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    linear.logger.addHandler(handler)
    try:
        for cap, want in (((8, 0), False), ((8, 9), True), ((9, 0), True)):
            monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None, cap=cap: cap)
            linear._log_w8a8_fallback.cache_clear()
            records.clear()
            assert linear.w8a8_supported(cuda) is want
            assert any("no FP8 tensor cores" in r.getMessage() for r in records) is not want
    finally:
        linear.logger.removeHandler(handler)
    assert linear.w8a8_supported(torch.device("cpu"))

    monkeypatch.setattr(linear, "on_fast_device", lambda t: True)
    monkeypatch.setattr(linear, "w8a8_supported", lambda device: False)
    lin, ref = _fp8_layer(1, torch.Generator().manual_seed(4))
    lin.finalize()
    assert lin.w8 is None and torch.equal(lin.w16, ref.to(torch.bfloat16))


def test_stream_dtype(monkeypatch):
    """The mHC residual streams: the fast path's activation dtype (bf16) by default, fp32 elsewhere (the reference,
    exact mode) and with ``VLLM_DSV41_STREAMS=fp32``; a bad value is named."""
    from vllm_dsv41.model_executor.model import STREAMS_ENV, stream_dtype

    fast, plain = linear.WeightFormat(True, torch.bfloat16, True), linear.WeightFormat(False, torch.float32)
    monkeypatch.delenv(STREAMS_ENV, raising=False)
    assert stream_dtype(fast) == torch.bfloat16 and stream_dtype(plain) == torch.float32
    monkeypatch.setenv(STREAMS_ENV, "fp32")
    assert stream_dtype(fast) == torch.float32
    monkeypatch.setenv(STREAMS_ENV, "bf16")
    with pytest.raises(ValueError, match="VLLM_DSV41_STREAMS='bf16': expected auto or fp32"):
        stream_dtype(fast)


def _kernel_order_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """vLLM 0.32's ``rms_norm_dynamic_per_token_quant`` order of rounding (its CUDA kernel and the Python baseline in
    ``vllm/kernels/helion/ops/rms_norm_dynamic_per_token_quant.py``): fp32 statistics, ``x * rms`` rounded to x's
    dtype, times the weight in that dtype."""
    return rms_norm(x.float(), None, eps).to(x.dtype) * w.to(x.dtype)


def test_rms_norm_quant_ref_is_the_norm_then_the_token_quantisation():
    """The fused norm + quantisation's CPU arithmetic (``rms_norm_quant_ref``): on fp32 input bitwise ``rms_norm``
    then ``formats.quant_fp8_tokens`` (the same operations in the same order); on bf16 input bitwise the quantisation
    of the kernel's bf16 rows (``_kernel_order_norm``), and within E4M3's rounding (half a step: 2^-4 relative) plus
    bf16's of the fp32 norm.  An all-zero row takes the scale floor and zero codes, as the kernel."""
    g = torch.Generator().manual_seed(11)
    eps = 1e-6
    x, w = torch.randn(9, 1280, generator=g) * 3, torch.rand(1280, generator=g) + 0.5
    x[4] = 0.0
    got = linear.rms_norm_quant_ref(x, w, eps)
    q, s = formats.quant_fp8_tokens(rms_norm(x, w, eps))
    assert got.dtype == torch.float32 and got.q.dtype == torch.float8_e4m3fn and got.scale.shape == (9, 1)
    assert torch.equal(got.q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(got.scale, s)
    floor = torch.tensor(formats.FP8_TOKEN_SCALE_FLOOR, dtype=torch.float32)  # the kernel's fp32 1 / (448 * 512)
    assert got.scale[4].item() == floor.item() and not got.q[4].float().any()

    xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)
    got = linear.rms_norm_quant_ref(xb, wb, eps)
    q, s = formats.quant_fp8_tokens(_kernel_order_norm(xb, wb, eps))
    assert got.dtype == torch.bfloat16
    assert torch.equal(got.q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(got.scale, s)
    exact = rms_norm(xb.float(), wb.float(), eps)
    back = got.q.float() * got.scale
    err = (back - exact).abs()
    assert (err <= exact.abs() * (2.0 ** -4 + 2.0 ** -7) + got.scale * 2.0 ** -9).all()


def _prequantised(T: int, g: torch.Generator) -> tuple[linear.QuantRows, torch.Tensor]:
    """bf16 rows through the q norm both ways: (the fused route's QuantRows, the unfused route's bf16 rows)."""
    x, w = (torch.randn(T, K_IN, generator=g) * 2).to(torch.bfloat16), (torch.rand(K_IN, generator=g) + 0.5)
    w = w.to(torch.bfloat16)
    return linear.rms_norm_quant_ref(x, w, 1e-6), _kernel_order_norm(x, w, 1e-6)


def test_quant_linear_takes_prequantised_rows(monkeypatch):
    """Under ``w8a8`` a QuantLinear given QuantRows skips its own quantisation: bitwise what it gives on the bf16 rows
    they quantise (the unfused route, through ``w8a8_ref``), within fp32 rounding of the dequantised rows times the
    dequantised weight (the same arithmetic in another order), row selection commutes with it, an empty pass is
    empty, and a layer that is not an ungrouped w8a8 weight refuses them."""
    monkeypatch.setenv(linear.DENSE_GEMM_ENV, "w8a8")
    monkeypatch.setattr(linear, "on_fast_device", lambda t: True)
    g = torch.Generator().manual_seed(12)
    lin, _ = _fp8_layer(1, g)
    lin.finalize()
    rows, normed = _prequantised(6, g)
    got = lin(rows)
    assert got.dtype == torch.bfloat16 and got.shape == (6, N_OUT)
    assert torch.equal(got, lin(normed))
    fp32 = lin(rows._replace(dtype=torch.float32))
    deq = (rows.q.float() * rows.scale) @ (lin.w8.float() * lin.w8_scale).t()
    assert torch.allclose(fp32, deq, rtol=1e-5, atol=1e-5 * deq.abs().max().item())
    idx = torch.tensor([4, 0, 5])
    assert torch.equal(lin(rows.rows(lambda t: t[idx])), got[idx])
    assert lin(rows.rows(lambda t: t[:0])).shape == (0, N_OUT)
    grouped, _ = _fp8_layer(4, g)
    grouped.finalize()  # grouped: stays bf16
    for other in (grouped, _fp8_layer(1, g)[0]):  # and an unfinalised one (dequantised per call)
        with pytest.raises(TypeError, match="pre-quantised rows need an ungrouped w8a8 weight"):
            other(rows)


def test_fused_quant_switch(monkeypatch):
    """``VLLM_DSV41_FUSED_QUANT``: on by default; the readers take QuantRows only when every one is an ungrouped w8a8
    weight, the rows are in the fast GEMMs' dtype and the small GEMMs quantise (not ``VLLM_DSV41_SMALL_GEMM=triton``);
    ``0`` turns it off; a misspelt value names the variable."""
    monkeypatch.setenv(linear.DENSE_GEMM_ENV, "w8a8")
    monkeypatch.setattr(linear, "on_fast_device", lambda t: True)
    monkeypatch.delenv(linear.FUSED_QUANT_ENV, raising=False)
    monkeypatch.delenv(linear.SMALL_GEMM_ENV, raising=False)
    g = torch.Generator().manual_seed(13)
    a, b, grouped = _fp8_layer(1, g)[0], _fp8_layer(1, g)[0], _fp8_layer(4, g)[0]
    for lin in (a, b, grouped):
        lin.finalize()
    bf16 = torch.bfloat16
    assert linear.fused_quant() and linear.reads_quantised_rows([a, b], bf16)
    assert not linear.reads_quantised_rows([a, grouped], bf16) and not linear.reads_quantised_rows([a], torch.float32)
    monkeypatch.setenv(linear.SMALL_GEMM_ENV, "triton")
    assert not linear.reads_quantised_rows([a], bf16)
    monkeypatch.delenv(linear.SMALL_GEMM_ENV)
    monkeypatch.setenv(linear.FUSED_QUANT_ENV, "0")
    assert not linear.fused_quant() and not linear.reads_quantised_rows([a], bf16)
    monkeypatch.setenv(linear.FUSED_QUANT_ENV, "on")
    with pytest.raises(ValueError, match="VLLM_DSV41_FUSED_QUANT='on': expected 1 or 0"):
        linear.fused_quant()


def test_fused_act_quant_switch(monkeypatch):
    """``VLLM_DSV41_FUSED_ACT_QUANT``: off by default (measured slower, session 21); ``1`` lets the activation
    producers' readers take QuantRows (on top of the norms'), unless ``VLLM_DSV41_FUSED_QUANT=0`` turns every fused
    quantisation off; a misspelt value names the variable."""
    monkeypatch.setenv(linear.DENSE_GEMM_ENV, "w8a8")
    monkeypatch.setattr(linear, "on_fast_device", lambda t: True)
    for env in (linear.FUSED_QUANT_ENV, linear.FUSED_ACT_QUANT_ENV, linear.SMALL_GEMM_ENV):
        monkeypatch.delenv(env, raising=False)
    a = _fp8_layer(1, torch.Generator().manual_seed(14))[0]
    a.finalize()
    bf16 = torch.bfloat16
    assert not linear.fused_act_quant() and not linear.reads_quantised_rows([a], bf16, activation=True)
    assert linear.reads_quantised_rows([a], bf16)  # the norms' fused quantisation stays on
    monkeypatch.setenv(linear.FUSED_ACT_QUANT_ENV, "1")
    assert linear.fused_act_quant() and linear.reads_quantised_rows([a], bf16, activation=True)
    monkeypatch.setenv(linear.FUSED_QUANT_ENV, "0")
    assert not linear.fused_act_quant() and not linear.reads_quantised_rows([a], bf16, activation=True)
    monkeypatch.setenv(linear.FUSED_ACT_QUANT_ENV, "yes")
    with pytest.raises(ValueError, match="VLLM_DSV41_FUSED_ACT_QUANT='yes': expected 1 or 0"):
        linear.fused_act_quant()


def test_misspelt_fused_quant_fails_the_engine_start(tiny_ckpt, monkeypatch):
    """``DeepseekV41ForCausalLM.__init__`` reads ``VLLM_DSV41_FUSED_QUANT`` with the other switches: a misspelt value
    fails the engine start, before any weight is made, instead of the first forward."""
    import types

    from vllm_dsv41.config import load_config
    from vllm_dsv41.model_executor import model

    monkeypatch.setattr(model, "from_hf_config", lambda hf: load_config(tiny_ckpt))
    monkeypatch.setenv(linear.FUSED_QUANT_ENV, "true")
    with pytest.raises(ValueError, match="VLLM_DSV41_FUSED_QUANT='true': expected 1 or 0"):
        vllm_config = types.SimpleNamespace(model_config=types.SimpleNamespace(hf_config=None))
        model.DeepseekV41ForCausalLM(vllm_config=vllm_config)


def _cutlass_moe_stand_ins(monkeypatch, calls: list) -> None:
    """CPU stand-ins for the vLLM kernels ``linear._cutlass_moe_gemms`` calls, each doing what vLLM documents (the
    problem sizes swapped, and the kernel's own swap-AB choice, below 65 rows), and checking the strides it is given
    against the contiguous layouts the CUDA kernels assume."""
    from vllm import _custom_ops as vops
    from vllm.model_executor.layers.fused_moe import activation, moe_permute_unpermute

    from vllm_dsv41.reference.model import clamped_swiglu_act

    def quant(x, scale=None, use_per_token_if_dynamic=False, output=None):
        assert use_per_token_if_dynamic and scale is None and x.is_contiguous()
        return formats.quant_fp8_tokens(x)

    def permute(a, a_scale, idx, n_expert, n_local):
        T, k = idx.shape
        order = torch.sort(idx.flatten().long(), stable=True).indices  # (token, slot) pairs, grouped by expert
        first = torch.zeros(n_expert + 1, dtype=torch.int64)
        first[1:] = torch.bincount(idx.flatten().long(), minlength=n_expert).cumsum(0)
        inverse = torch.empty(T * k, dtype=torch.int32)
        inverse[order] = torch.arange(T * k, dtype=torch.int32)
        return a[order // k], a_scale[order // k], first, inverse, order

    def sizes(first, ps1, ps2, n, k, swap_ab):
        calls.append(("swap_ab", swap_ab))
        m = (first[1:] - first[:-1]).int()
        for ps, cols, inner in ((ps1, 2 * n, k), (ps2, k, n)):  # (M, N, K) per expert, (N, M, K) when swapped
            ps[:, 0], ps[:, 1], ps[:, 2] = (cols, m, inner) if swap_ab else (m, cols, inner)

    def moe_mm(out, a, b, a_scales, b_scales, offsets, ps, a_strides, b_strides, c_strides, per_act, per_out):
        assert per_act and per_out and a.dtype == b.dtype == torch.float8_e4m3fn
        swap = a.shape[0] <= 64
        assert (a_strides == a.shape[1]).all() and (b_strides == b.shape[2]).all() and (c_strides == out.shape[1]).all()
        for e in range(b.shape[0]):
            m, n, kk = ps[e].tolist()
            if swap:
                m, n = n, m
            assert (n, kk) == (b.shape[1], b.shape[2]) and kk == a.shape[1]
            r = slice(int(offsets[e]), int(offsets[e]) + m)
            out[r] = ((a[r].float() @ b[e].float().t()) * a_scales[r] * b_scales[e].reshape(1, -1)).to(out.dtype)
        calls.append(("cutlass_moe_mm", a.shape[0]))

    def act(kind, out, h, activation_config=None, **_):
        I = out.shape[1]
        out.copy_(clamped_swiglu_act(h[:, :I].float(), h[:, I:].float(), activation_config.clamp_limit))

    def unpermute(out, permuted_hidden_states, topk_weights, inv_permuted_idx, expert_first_token_offset=None):
        T, k = topk_weights.shape
        y = permuted_hidden_states[inv_permuted_idx.long()].float().view(T, k, -1)
        out.copy_((y * topk_weights.float()[..., None]).sum(1).to(out.dtype))

    monkeypatch.setattr(vops, "scaled_fp8_quant", quant)
    monkeypatch.setattr(vops, "get_cutlass_moe_mm_problem_sizes_from_expert_offsets", sizes)
    monkeypatch.setattr(vops, "cutlass_moe_mm", moe_mm)
    monkeypatch.setattr(activation, "apply_moe_activation", act)
    monkeypatch.setattr(moe_permute_unpermute, "moe_permute", permute)
    monkeypatch.setattr(moe_permute_unpermute, "moe_unpermute", unpermute)


@pytest.mark.parametrize("T", [5, 40])  # 10 (token, slot) rows: the swap-AB problem sizes; 80: the plain ones
def test_cutlass_moe_glue_matches_fp8_reference(T, monkeypatch):
    """``linear._cutlass_moe_gemms`` (``VLLM_DSV41_FP8_MOE_GEMM=cutlass``) wires vLLM's permute, CUTLASS grouped GEMM
    and unpermute so that, with stand-ins doing what each kernel documents, the layer computes ``fp8_moe_ref``'s
    arithmetic (FP8 rows per expert, per-token activation scales, the clamped SwiGLU, routing weights).  The CUDA
    kernels themselves are checked on the GPU (tests/gpu/test_marlin_weights.py::test_fp8_moe[cutlass])."""
    E, H, I, k, limit = 4, 64, 32, 2, 1.5
    g = torch.Generator().manual_seed(T)
    stack = []
    for r, c in ((2 * I, H), (H, I)):
        q, s = formats.quant_mxfp4(torch.randn(E, r, c, generator=g) * 0.2)
        stack += [q.view(torch.uint8), formats.as_uint8(s)]
    w13q, s13, w2q, s2 = stack
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    idx = torch.rand(T, E, generator=g).argsort(1)[:, :k]
    wts = torch.rand(T, k, generator=g)
    calls: list = []
    _cutlass_moe_stand_ins(monkeypatch, calls)
    w13, r13 = formats.mxfp4_to_fp8_rows(w13q, s13)
    w2, r2 = formats.mxfp4_to_fp8_rows(w2q, s2)
    got = linear._cutlass_moe_gemms(x, w13, w2, (r13, r2), idx, wts, limit)
    want = linear.fp8_moe_ref(x, (w13q, s13, w2q, s2), idx, wts, limit)
    assert calls == [("swap_ab", T * k <= 64), ("cutlass_moe_mm", T * k), ("cutlass_moe_mm", T * k)]
    assert got.dtype == x.dtype and got.shape == (T, H)
    # the routing weight multiplies a bf16 GEMM output here (fp32 in the reference): a bf16 rounding apart
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * want.float().abs().max().item())
