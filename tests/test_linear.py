"""The weight-holding layers of ``model_executor/linear.py`` on CPU (the GPU side: tests/gpu/test_marlin_weights.py)."""

import pytest
import torch

from vllm_dsv41 import formats
from vllm_dsv41.model_executor.linear import QuantLinear, fused_rms_norm, weights_mode
from vllm_dsv41.reference.model import rms_norm


def test_fused_rms_norm_matches_reference():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(7, 512, generator=g) * 3, torch.rand(512, generator=g)
    err = (fused_rms_norm(x, w, 1e-20) - rms_norm(x, w, 1e-20)).abs().max().item()
    assert err < 1e-5, err


@pytest.mark.parametrize("groups", [1, 4])
def test_quant_linear_keeps_bytes_and_dequantises_exactly(groups):
    g = torch.Generator().manual_seed(1)
    N, K = 4 * 64, 96
    w, s = formats.quant_fp8_block(torch.randn(N, K, generator=g) * 0.1, 32)
    lin = QuantLinear(N, K, quant=True, groups=groups)
    lin.weight.data.copy_(w)
    lin.scale.data.copy_(formats.as_uint8(s))
    ref = formats.dequant_fp8_block(w, s, 32)
    assert torch.equal(lin.dequantized(), ref)
    lin.finalize()  # no-op off CUDA: the bytes stay as stored
    assert lin.marlin is None and lin.weight.dtype == torch.float8_e4m3fn
    x = torch.randn(3, groups, K, generator=g) if groups > 1 else torch.randn(3, K, generator=g)
    want = (torch.einsum("tgk,gok->tgo", x, ref.view(groups, N // groups, K)) if groups > 1 else x @ ref.t())
    assert torch.equal(lin(x), want)


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
