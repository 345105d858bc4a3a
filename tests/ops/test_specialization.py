"""Row counts never compile extra kernel variants.

Triton compiles a kernel once per specialisation of its integer arguments (equal to 1, divisible by 16, other)
besides its constexprs and launch options; a fresh H200 compiled ~100 variants of our kernels as a server's
shapes arrived (docs/benchmarks.md, session 10).  Here the launches of the CUDA wrappers are intercepted on the
CPU, the specialisation Triton's own binder gives each one for an sm_90 target is recorded, and for every
kernel and constexpr configuration the row counts that a server sees (decode buckets, prefill chunks, a chunk's
tail) must give one variant.  Needs only Triton's Python package (no GPU; nothing is launched).
"""

from __future__ import annotations

import collections

import pytest
import torch

triton = pytest.importorskip("triton")
jit = pytest.importorskip("triton.runtime.jit")
nvidia = pytest.importorskip("triton.backends.nvidia.compiler")

from triton.backends.compiler import GPUTarget  # noqa: E402

ROWS = (1, 2, 7, 16, 29, 64, 157, 1024, 4096)


@pytest.fixture
def variants(monkeypatch):
    """{kernel name: {constexpr config: {specialisations of the other arguments}}} of the launches made while
    the fixture is active; the launches themselves do nothing."""
    backend = nvidia.CUDABackend(GPUTarget("cuda", 90, 32))
    seen: dict[str, dict[tuple, set]] = collections.defaultdict(lambda: collections.defaultdict(set))

    def record(self, *args, grid, warmup=False, **kwargs):
        spec = jit.create_function_from_signature(self.signature, self.params, backend)(*args, **kwargs)[1]
        declared = {i for i, p in enumerate(self.params) if p.is_constexpr}
        config = tuple(s for i, s in enumerate(spec) if i in declared)
        options = tuple(sorted((k, v) for k, v in kwargs.items() if k in ("num_warps", "num_stages")))
        seen[self.fn.__name__][config + options].add(tuple(s for i, s in enumerate(spec) if i not in declared))

    monkeypatch.setattr(jit.JITFunction, "run", record)
    return seen


def _assert_one_per_config(seen: dict, kernels: list[str]) -> None:
    for name in kernels:
        assert seen[name], f"{name} was not launched"
        for config, specs in seen[name].items():
            assert len(specs) == 1, f"{name}: {len(specs)} variants of one config over row counts {ROWS}: {specs}"


def test_mhc(variants):
    from tests.ops.test_mhc import make_inputs, post_args, post_pre_args, pre_args
    from vllm_dsv41.ops import mhc

    for T in ROWS[:-1]:
        t = make_inputs(T, 4, 5120)  # the served width: the H split counts follow it
        mhc._mhc_pre_triton(*pre_args(t))
        mhc._mhc_post_pre_triton(*post_pre_args(t))
        mhc._mhc_post_triton(*post_args(t))
    _assert_one_per_config(variants, ["_mhc_pre_kernel", "_mhc_pre_epilogue_kernel", "_mhc_post_kernel"])


def test_router(variants):
    from tests.ops.test_router import make_inputs
    from vllm_dsv41.ops import router

    for T in ROWS:
        x, w, bias = make_inputs(T, 32, 512, x_dtype=torch.float32)
        router._router_triton(x, w, bias, 6, 2.5)
        router._router_triton(x, w, bias, 6, 2.5, fuse_epilogue=False)
    _assert_one_per_config(variants, ["_router_gemm_kernel", "_router_epilogue_kernel"])


def test_topk_and_candidate_blocks(variants):
    from vllm_dsv41.ops import topk

    for T in ROWS:
        scores = torch.randn(T, 2048)
        n_vis = torch.full((T,), 2048, dtype=torch.int32)
        topk._topk_select_triton(scores, n_vis, 512)
        topk._candidate_blocks_triton(scores, n_vis, 64, 16)
    _assert_one_per_config(variants, ["_topk_select_kernel", "_candidate_blocks_kernel"])


def test_paged_rows_over_block_table_widths(variants):
    from tests.ops.test_paged_rows import make_case
    from vllm_dsv41.ops.paged_rows import _paged_rows_triton

    for R in ROWS[:6]:
        for M in (1, 3, 16, 70):  # the block table's width follows the batch's longest request
            bt, req, ent = make_case(R, 128, M, 64)
            _paged_rows_triton(bt, req, ent, 64, 1 << 20, 272)
    _assert_one_per_config(variants, ["_paged_rows_kernel"])


def test_compress_insert(variants):
    from vllm_dsv41.ops.compressor import _compress_insert_triton

    D, ID, R = 512, 128, 64
    comp = torch.zeros(64, D // 2 + D // 16, dtype=torch.uint8)
    idx = torch.zeros(64, ID // 2 + ID // 32, dtype=torch.uint8)
    for T in ROWS:
        kv = torch.randn(T, 2 * D)
        slots = torch.arange(T, dtype=torch.int64) % 64
        _compress_insert_triton(kv, torch.randn(T, 2 * D), torch.arange(T), 2, torch.ones(D), torch.randn(ID, D),
                                torch.ones(ID), 1e-6, torch.rand(R // 2), slots, slots, comp, idx)
    _assert_one_per_config(variants, ["_compress_insert_kernel"])


def test_sparse_attn_decode_buckets(variants):
    """The pinned config's launches for the decode buckets: ``t_bucket`` (an autotune key) and the split count
    (the combine kernel's loop bound) do not split them."""
    from tests.ops.test_sparse_attn import _args, random_case
    from vllm_dsv41.ops import sparse_attn

    for T in (1, 2, 4, 8, 16, 32, 64):
        c = random_case(T, 64, 512, 64, 128, 512, dtype=torch.bfloat16)
        sparse_attn._sparse_attn_triton(*_args(c))
    _assert_one_per_config(variants, ["_sparse_attn_kernel", "_sparse_attn_combine_kernel"])
