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


_ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


def run_under_interpreter(args: list[str], timeout: int = 300):
    """Run ``python <args>`` from the repository root with ``TRITON_INTERPRET=1`` set before Triton is
    imported (the interpreter runs kernels on CPU tensors); skip without Triton, fail on a non-zero exit."""
    import importlib.util
    import os
    import subprocess
    import sys

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=str(_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, *args], cwd=_ROOT, env=env, capture_output=True, text=True,
                       timeout=timeout)
    print(r.stdout)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return r


#: Shared memory one block may use on an H100/H200 (227 KB): what Triton's OutOfResources compares against.
SM90_SHARED_LIMIT = 232448


def sm90_build(kernel, signature: dict, constexprs: dict, num_warps: int, num_stages: int = 3,
               divisible_by_16: tuple[str, ...] | None = None, want_ptx: bool = False) -> dict:
    """Compile a ``triton.jit`` kernel for sm_90 with Triton's own ptxas (no GPU needed) and return its
    ``regs``, ``stack`` (spilled bytes per thread) and ``shared`` (bytes per block); skip the calling test where
    this Triton cannot (no Triton, no cuobjdump in its wheel).  ``divisible_by_16``: the integer arguments a
    launch passes as multiples of 16; with it every pointer is taken as 16-byte aligned too, as Triton's JIT
    specialises them at a real launch (vector loads, pipelined copies).  ``want_ptx``: the PTX as well (``ptx``)."""
    import importlib.util
    import pathlib
    import re
    import subprocess
    import tempfile

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    tool = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        pytest.skip("this Triton wheel has no cuobjdump")
    import inspect

    # constexpr parameters with a default that the test does not name (PDL) take their default, as at a launch
    for name, par in inspect.signature(kernel.fn).parameters.items():
        if name not in constexprs and signature.get(name, "constexpr") == "constexpr" \
                and par.default is not inspect.Parameter.empty:
            signature, constexprs = {**signature, name: "constexpr"}, {**constexprs, name: par.default}
    attrs = None
    if divisible_by_16 is not None:
        attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in kernel.arg_names
                 if signature.get(n, "").startswith("*") or n in divisible_by_16}
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    line = next(ln for ln in usage.splitlines() if "REG:" in ln)
    regs, stack = (int(re.search(rf"{key}:(\d+)", line).group(1)) for key in ("REG", "STACK"))
    got = {"regs": regs, "stack": stack, "shared": int(compiled.metadata.shared)}
    return {**got, "ptx": compiled.asm["ptx"]} if want_ptx else got
