"""What every op micro-benchmark shares: the repository on ``sys.path``, the H200's bandwidth figure
and the opening lines (command, device; exit 0 with a message where there is no GPU or no Triton)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

#: H200 HBM3e bandwidth by the vendor's datasheet; "% of 4.8 TB/s" columns divide by it.
HBM_BYTES_PER_S = 4.8e12


def open_gpu(name: str, seed: int = 0):
    """Print the command and the device; return the ``triton`` module, or None when nothing can run."""
    print("command:", " ".join([sys.executable, *sys.argv]))
    if not torch.cuda.is_available():
        print(f"{name}: no CUDA GPU, nothing to benchmark")
        return None
    try:
        import triton
    except ImportError:
        print(f"{name}: triton is not installed, nothing to benchmark")
        return None
    torch.manual_seed(seed)
    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}, "
          f"triton {triton.__version__}")
    return triton


def graph_us(fn, calls: int = 16) -> float:
    """µs a call of ``fn`` replayed ``calls`` times from one CUDA graph (after one eager call that compiles it): no host
    launch cost, as in a captured decode step; the median of ``do_bench``."""
    import triton

    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return triton.testing.do_bench(g.replay, warmup=20, rep=200, return_mode="median") * 1e3 / calls
