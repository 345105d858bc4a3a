"""Shared helpers for op tests: one closeness check that reports both numbers."""

import pytest
import torch


def assert_close(name: str, ref: torch.Tensor, got: torch.Tensor, ratio: float = 1e-3) -> None:
    """NaN check, then relative RMS error of ``got`` against ``ref``; prints both numbers."""
    ref, got = ref.float(), got.float()
    assert not torch.isnan(got).any(), f"{name}: NaN in result"
    err = (ref - got).pow(2).mean().sqrt().item()
    base = ref.pow(2).mean().sqrt().item() + 1e-12
    print(f"{name}: rms err {err:.3e} / rms ref {base:.3e} = {err / base:.3e}")
    assert err / base <= ratio, f"{name}: relative rms error {err / base:.3e} > {ratio}"


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (H200 run)")


def pytest_collection_modifyitems(config, items):
    """Interpreter runs (TRITON_INTERPRET=1 on CPU tensors) stand in for the GPU on CPU machines; where a
    GPU is present the compiled kernels are tested instead, and older Tritons' interpreters differ."""
    if not torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="CUDA present: the compiled kernels are tested instead of the interpreter")
    for item in items:
        if "interpret" in item.name:
            item.add_marker(skip)
