"""The ``VLLM_DSV41_MOE=ogs`` routed experts (``triton_kernels``' ``matmul_ogs`` on the MXFP4 bytes) on CUDA.

Run on the GPU machine: ``python -m pytest -q -s -m gpu tests/gpu/test_ogs_moe.py``.  Skipped without CUDA; needs
vLLM's CUDA wheel (it vendors ``triton_kernels``).  Random MXFP4 experts at the bench config's shapes (E 32, top-6,
H 5120, I 2304) against the expert loop over the dequantised weights in fp32 (``loop_moe``: ``formats.dequant_mxfp4``
and the clamped SwiGLU), against vLLM's Marlin MXFP4 MoE, and replayed from a CUDA graph (the decode steps capture
it).  bf16 activations and routing weights, so the bound is relative to the output scale, as for Marlin.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_marlin_weights import REL_TOL, _random_experts, _rel
from vllm_dsv41.model_executor.linear import loop_moe, marlin_expert_stack, marlin_moe, ogs_expert_stack, ogs_moe

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

E, H, I, K, LIMIT = 32, 5120, 2304, 6, 10.0


@pytest.fixture(scope="module")
def experts() -> torch.nn.ModuleList:
    return _random_experts(E, H, I)


@pytest.fixture(scope="module")
def ogs_stack(experts) -> tuple:
    return ogs_expert_stack(experts)


def _case(T: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, H] large enough that the clamp bites, k distinct experts per token, fp32 weights."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, H, device="cuda", generator=g) * 2
    idx = torch.rand(T, E, device="cuda", generator=g).argsort(1)[:, :K]
    return x, idx, torch.rand(T, K, device="cuda", generator=g)


@pytest.mark.parametrize("T", [1, 7, 64, 512])
def test_ogs_moe_matches_fp32_reference(T, experts, ogs_stack):
    x, idx, wts = _case(T, T)
    ref = loop_moe(x.to(torch.bfloat16).float(), experts, idx, wts, LIMIT)
    got = ogs_moe(x, ogs_stack, idx, wts, LIMIT)
    err = _rel(got, ref)
    print(f"ogs moe T={T}: rel err {err:.2e} vs the fp32 reference")
    assert got.shape == x.shape and got.dtype == x.dtype and err < REL_TOL


@pytest.mark.parametrize("T", [1, 64])
def test_ogs_moe_matches_marlin(T, experts, ogs_stack):
    x, idx, wts = _case(T, 100 + T)
    xb = x.to(torch.bfloat16)
    marlin = marlin_moe(xb, marlin_expert_stack(experts), idx, wts, LIMIT)
    got = ogs_moe(xb, ogs_stack, idx, wts, LIMIT)
    err = _rel(got, marlin)
    print(f"ogs vs marlin moe T={T}: rel diff {err:.2e}")
    assert got.dtype == torch.bfloat16 and err < REL_TOL


def test_ogs_moe_replays_from_a_cuda_graph(ogs_stack):
    """Captured once after an eager warm-up (a host read of the routing would fail the capture), then replayed on
    another batch copied into the captured buffers: the eager result of that batch."""
    T = 16
    x, idx, wts = _case(T, 7)
    ogs_moe(x, ogs_stack, idx, wts, LIMIT)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = ogs_moe(x, ogs_stack, idx, wts, LIMIT)
    x2, idx2, wts2 = _case(T, 8)
    x.copy_(x2)
    idx.copy_(idx2)
    wts.copy_(wts2)
    graph.replay()
    want = ogs_moe(x2, ogs_stack, idx2, wts2, LIMIT)
    err = _rel(out, want)
    print(f"ogs moe from a CUDA graph T={T}: rel diff {err:.2e} vs eager (bitwise equal: {torch.equal(out, want)})")
    assert err < 1e-3
