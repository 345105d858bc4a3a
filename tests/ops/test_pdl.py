"""Programmatic dependent launch (``VLLM_DSV41_PDL``): the setting, that every decode-path kernel waits for the
kernel before it as its first statement and every launch of it passes the setting, the instructions it compiles
to for sm_90 (no GPU needed), and on a GPU a chain of dependent kernels graph-replayed with it on bitwise equal to
the chain run eagerly with it off."""

import ast
import pathlib

import pytest
import torch

from tests.ops.conftest import requires_cuda
from vllm_dsv41.ops import _triton

OPS_DIR = pathlib.Path(_triton.__file__).parent
# the modules whose kernels run on the decode path; their launches all pass the setting
PDL_MODULES = ("compressor", "fp8_gemm", "fp8_gemv", "indexer", "mhc", "moe_gemv", "paged_rows", "ring", "rope",
               "router", "sparse_attn", "swa_insert", "swiglu_quant", "topk")
NO_PDL = {"_row_keys_kernel"}  # sparse_attn's gathered-prefill helper (prefill only, launched from another module)


def test_setting(monkeypatch):
    monkeypatch.delenv(_triton.PDL_ENV, raising=False)
    assert _triton.pdl_setting() is (_triton.DEFAULT_PDL == "1")
    for value, want in (("1", True), ("0", False), (" ", _triton.DEFAULT_PDL == "1")):
        monkeypatch.setenv(_triton.PDL_ENV, value)
        assert _triton.pdl_setting() is want
    monkeypatch.setenv(_triton.PDL_ENV, "yes")
    with pytest.raises(ValueError, match="VLLM_DSV41_PDL='yes': expected 1 or 0"):
        _triton.pdl_setting()
    monkeypatch.setenv(_triton.PDL_ENV, "1")
    assert _triton.pdl(torch.zeros(1)) is False  # a CPU tensor (the interpreter's) never takes it
    assert _triton.pdl_launch(False) == {"PDL": False}
    assert _triton.pdl_launch(True) == {"PDL": True, "launch_pdl": True}


def _is_gdc_call(stmt: ast.stmt, name: str) -> bool:
    return (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)
            and isinstance(stmt.value.func, ast.Name) and stmt.value.func.id == name)


@pytest.mark.parametrize("module", PDL_MODULES)
def test_kernels_wait_first_and_launches_pass_the_setting(module):
    """A kernel launched with ``launch_pdl`` that touched memory before ``gdc_wait`` would race the kernel before it
    (and one whose programs skipped the wait could finish first and let the next kernel race): every kernel of these
    modules takes ``PDL`` and opens with ``if PDL: gdc_wait(); gdc_launch_dependents()``, and every launch in them
    passes ``**pdl_launch(...)`` (sparse_attn's through its ``flags``)."""
    path = OPS_DIR / f"{module}.py"
    src = path.read_text()
    tree = ast.parse(src)
    kernels = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name.endswith("_kernel")
               and n.args.args and n.name not in NO_PDL]
    assert kernels, f"{module}: no kernels found"
    for k in kernels:
        assert "PDL" in [a.arg for a in k.args.args], f"{module}.{k.name} takes no PDL constexpr"
        body = k.body[1:] if isinstance(k.body[0], ast.Expr) and isinstance(k.body[0].value, ast.Constant) else k.body
        if isinstance(body[0], ast.If) and isinstance(body[0].test, ast.Name) and body[0].test.id == "PREFETCH":
            # an L2 prefetch of weights may come first: address arithmetic and prefetch hints, no memory access
            touched = {n.func.attr for n in ast.walk(body[0]) if isinstance(n, ast.Call)
                       and isinstance(n.func, ast.Attribute)} & {"load", "store", "atomic_add", "atomic_xchg",
                                                                 "atomic_cas", "atomic_max", "atomic_min"}
            assert not touched, f"{module}.{k.name}: the PREFETCH block touches memory ({touched})"
            body = body[1:]
        first = body[0]
        assert (isinstance(first, ast.If) and isinstance(first.test, ast.Name) and first.test.id == "PDL"
                and len(first.body) == 2 and _is_gdc_call(first.body[0], "gdc_wait")
                and _is_gdc_call(first.body[1], "gdc_launch_dependents")), \
            f"{module}.{k.name}: the first statement must be `if PDL: gdc_wait(); gdc_launch_dependents()`"
    launches = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Subscript)
                and ast.get_source_segment(src, n.func.value) not in ("x.shape", "torch")]
    assert launches, f"{module}: no launches found"
    for call in launches:
        starred = [ast.get_source_segment(src, kw.value) for kw in call.keywords if kw.arg is None]
        assert any("pdl_launch" in s or s == "flags" or f"{s} = pdl_launch(" in src for s in starred), \
            f"{module}:{call.lineno}: a launch without **pdl_launch(...)"
    if module == "sparse_attn":  # the kernel's flags (also the launch-config cache key) carry the setting
        assert "**pdl_launch(pdl(q))" in src


def _compile_case(case: str, pdl: bool, prefetch: bool = False):
    """(kernel, signature, constexprs, options) of a decode kernel at its decode launch: the post-mix (plain loads) and
    the pre-quantised GEMV (its weight stream software-pipelined: the loads Triton could hoist above the wait)."""
    if case == "mhc_post":
        from vllm_dsv41.ops import mhc

        kernel = mhc._kernels().post
        ptrs = dict(zip(("s_ptr", "y_ptr", "y2_ptr", "post_ptr", "comb_ptr", "out_ptr"),
                        ("*bf16", "*bf16", "*bf16", "*fp32", "*fp32", "*bf16")))
        consts = {"C": 4, "BLOCK_T": 1, "BLOCK_H": 1024, "ADD_Y2": False}
        options = {"num_warps": 4}
    else:
        from vllm_dsv41.ops import fp8_gemv as fv

        fv._bind()
        kernel = fv._fp8_gemv_kernel
        N, K = 5120, 8192
        p = fv.plan(1, N, K, 132)
        ptrs = {"x_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "out_ptr": "*bf16",
                "part_ptr": "*fp32", "lock_ptr": "*i32", "floor": "fp32"}
        consts = {k: p[k] for k in ("BLOCK_N", "BLOCK_M", "BLOCK_K", "SPLIT_K")} | {
            "AMAX_K": 8192, "THREADS": 32 * p["num_warps"], "INTERPRET": False, "PREQUANT": True}
        options = {"num_warps": p["num_warps"], "num_stages": p["num_stages"]}
    consts["PDL"] = pdl
    if prefetch:
        consts["PREFETCH"] = True
    sig = {n: ptrs.get(n, "constexpr" if n in consts else "i32") for n in kernel.arg_names}
    return kernel, sig, consts, {**options, "launch_pdl": pdl}


@pytest.mark.parametrize("case", ["mhc_post", "fp8_gemv_q"])
@pytest.mark.parametrize("pdl", [False, True])
def test_pdl_compiles_to_griddepcontrol(case, pdl):
    """For sm_90 (Triton's compiler, no GPU): with PDL the kernel's PTX opens with ``griddepcontrol.wait`` before its
    first global load or asynchronous copy (the software pipeliner must not hoist one above it, triton-lang/triton
    #11905 with the wait inside a K loop), then ``griddepcontrol.launch_dependents``; without it neither appears."""
    pytest.importorskip("triton")
    if not _triton.HAS_GDC:
        pytest.skip("this Triton has no griddepcontrol intrinsics")
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel, sig, consts, options = _compile_case(case, pdl)
    compiled = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts),
                              target=GPUTarget("cuda", 90, 32), options=options)
    ptx = compiled.asm["ptx"]
    if not pdl:
        assert "griddepcontrol" not in ptx
        return
    wait, launch = ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents")
    first_mem = min(m.start() for m in re.finditer(r"\b(ld\.global|cp\.async|atom\.|st\.global)", ptx))
    assert 0 <= wait < launch < first_mem, (wait, launch, first_mem)
    assert compiled.metadata.launch_pdl


def test_gemv_prefetch_compiles_before_the_wait():
    """With ``PREFETCH`` the GEMV's PTX asks L2 for its weight lines (``prefetch.global.L2``) before
    ``griddepcontrol.wait``, and still reads or writes nothing before it."""
    pytest.importorskip("triton")
    if not _triton.HAS_GDC:
        pytest.skip("this Triton has no griddepcontrol intrinsics")
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel, sig, consts, options = _compile_case("fp8_gemv_q", True, prefetch=True)
    ptx = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                         options=options).asm["ptx"]
    wait = ptx.find("griddepcontrol.wait")
    first_mem = min(m.start() for m in re.finditer(r"\b(ld\.global|cp\.async|atom\.|st\.global)", ptx))
    assert 0 <= ptx.find("prefetch.global.L2") < wait < first_mem


def test_gemv_prefetch_without_pdl_comes_first():
    """Without PDL, ``PREFETCH`` still asks L2 for the weight lines before the kernel's first global load (the input
    row for the token amax), and no ``griddepcontrol`` appears."""
    pytest.importorskip("triton")
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel, sig, consts, options = _compile_case("fp8_gemv_q", False, prefetch=True)
    ptx = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                         options=options).asm["ptx"]
    first_mem = min(m.start() for m in re.finditer(r"\b(ld\.global|cp\.async|atom\.|st\.global)", ptx))
    assert 0 <= ptx.find("prefetch.global.L2") < first_mem
    assert "griddepcontrol" not in ptx


def test_prefetch_setting(monkeypatch):
    from vllm_dsv41.ops import fp8_gemv

    monkeypatch.delenv(fp8_gemv.PREFETCH_ENV, raising=False)
    assert fp8_gemv.prefetch_setting() is False
    monkeypatch.setenv(fp8_gemv.PREFETCH_ENV, "1")
    assert fp8_gemv.prefetch_setting() is True
    monkeypatch.setenv(fp8_gemv.PREFETCH_ENV, "2")
    with pytest.raises(ValueError, match="VLLM_DSV41_PDL_PREFETCH='2': expected 1 or 0"):
        fp8_gemv.prefetch_setting()


@requires_cuda
def test_cuda_graph_chain_with_pdl_is_bitwise(monkeypatch):
    """Sixteen dependent boundaries (``mhc_post_pre``: pre kernel, then epilogue reading its partials; each next
    boundary reads the new stream) of one token, captured in a CUDA graph with PDL on and replayed: every x and the
    last stream bitwise the eager chain's with PDL off.  A kernel reading before the one before it finished would
    show as a difference here."""
    from tests.ops.test_mhc import make_inputs, post_pre_args

    t = make_inputs(1, 4, 5120, torch.bfloat16, seed=3, device="cuda")

    def chain():
        s, xs = t["stream"], []
        for _ in range(16):
            s, x, *_ = torch.ops.dsv41.mhc_post_pre(*post_pre_args({**t, "stream": s}))
            xs.append(x)
        return s, torch.stack(xs)

    monkeypatch.setenv(_triton.PDL_ENV, "0")
    want = chain()
    monkeypatch.setenv(_triton.PDL_ENV, "1")
    assert _triton.pdl(t["stream"]) is (torch.cuda.get_device_capability() >= (9, 0))
    eager = chain()  # compiles the PDL variants outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = chain()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    for name, a, b, c in zip(("stream", "x"), want, eager, got):
        assert torch.equal(a, b), f"eager chain with PDL: {name} differs"
        assert torch.equal(a, c), f"graph-replayed chain with PDL: {name} differs"
