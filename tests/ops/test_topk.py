"""Indexer selections (vllm_dsv41/ops/topk.py) against the reference model, Triton against the refs.

(a) CPU, always: ``topk_select_ref`` / ``candidate_blocks_ref``, turned into masks with
    ``indices_to_mask`` / ``blocks_to_mask``, equal ``reference.model.topk_select`` /
    ``candidate_mask`` on data full of exact ties (small integers, +0.0 and -0.0, -inf inside the
    visible range) and odd sizes; the registered ops dispatch to the references on CPU.
(b) Triton interpreter: the launch wrappers under ``TRITON_INTERPRET=1`` on CPU tensors in a
    subprocess, compared index for index; skipped without Triton.
(c) CUDA (H200 run): the registered ops at serving sizes (topk 512; 2048 blocks of 8).
"""

from pathlib import Path

import pytest
import torch

from tests.ops.conftest import run_under_interpreter, requires_cuda
from vllm_dsv41.ops import topk as topk_mod
from vllm_dsv41.reference.model import candidate_mask, topk_select

REPO = Path(__file__).resolve().parents[2]
KINDS = ["ties", "relu", "distinct", "neginf"]


def make_scores(T: int, N: int, kind: str, seed: int = 0, device: str = "cpu",
                n_vis: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [T, N] fp32 with -inf past each row's n_vis, and n_vis [T] int32.

    kind "ties": integers in [-3, 3] (exact ties everywhere); "relu": indexer-like
    sum_h w_h * relu(.) with few heads, so most entries are +0.0 or -0.0 and many values repeat;
    "distinct": Gaussian; "neginf": small integers with a third of the visible entries -inf."""
    g = torch.Generator().manual_seed(seed)
    if kind == "relu":
        h = torch.relu(torch.randint(-4, 3, (T, N, 2), generator=g).float())
        s = h[..., 0] - 0.5 * h[..., 1]            # exact, mostly zero
        neg_zero = (s == 0) & (torch.rand(T, N, generator=g) < 0.5)
        s = torch.where(neg_zero, -0.0, s)         # head weights of either sign give both zeros
    elif kind == "distinct":
        s = torch.randn(T, N, generator=g)
    else:
        s = torch.randint(-3, 4, (T, N), generator=g).float()
        if kind == "neginf":
            s = s.masked_fill(torch.rand(T, N, generator=g) < 0.33, float("-inf"))
    if n_vis is None:
        n_vis = torch.randint(0, N + 1, (T,), generator=g).tolist()
    nv = torch.tensor(n_vis, dtype=torch.int32)
    s = s.masked_fill(torch.arange(N)[None, :] >= nv[:, None].long(), float("-inf"))
    return s.to(device), nv.to(device)


def edge_rows(N: int, limit: int, block: int = 1) -> list[int]:
    """n_vis values around the interesting boundaries (0, the limit, N)."""
    lim = limit * block
    vals = [0, 1, lim - 1, lim, lim + 1, lim + block, N - 1, N, N // 2 + 3]
    return [min(max(v, 0), N) for v in vals]


def check_index_rows(idx: torch.Tensor, n: torch.Tensor, width: int) -> None:
    """Shared structural contract: ascending valid ids first, then -1; min(n, width) of them."""
    for row, nv in zip(idx.tolist(), n.tolist()):
        valid = [i for i in row if i >= 0]
        assert row[:len(valid)] == valid and all(i == -1 for i in row[len(valid):]), row
        assert valid == sorted(set(valid)) and len(valid) == min(nv, width)


# --------------------------------------------------------------------------- (a) CPU: references


@pytest.mark.parametrize("T,N,topk", [(9, 1000, 64), (5, 777, 100), (4, 50, 64), (3, 129, 128)],
                         ids=lambda v: str(v))
@pytest.mark.parametrize("kind", KINDS)
def test_topk_ref_equals_reference(T, N, topk, kind):
    s, n_vis = make_scores(T, N, kind, seed=N + T)
    s2, n2 = make_scores(9, N, kind, seed=N + T + 1, n_vis=edge_rows(N, topk))
    for scores, nv in ((s, n_vis), (s2, n2)):
        idx = topk_mod.topk_select_ref(scores, nv, topk)
        assert idx.dtype == torch.int32 and idx.shape == (scores.shape[0], topk)
        check_index_rows(idx, nv, topk)
        assert torch.equal(topk_mod.indices_to_mask(idx, N), topk_select(scores, nv, topk))


def test_topk_ref_clamps_n_vis_beyond_n():
    s, _ = make_scores(3, 70, "ties", seed=1, n_vis=[70, 70, 70])
    n_vis = torch.tensor([500, 70, 10], dtype=torch.int32)
    idx = topk_mod.topk_select_ref(s, n_vis, 16)
    assert torch.equal(topk_mod.indices_to_mask(idx, 70), topk_select(s, n_vis, 16))


def test_relu_scores_hold_both_zeros():
    s, _ = make_scores(2, 500, "relu", n_vis=[500, 500])
    zeros = s[s == 0]
    assert torch.signbit(zeros).any() and (~torch.signbit(zeros)).any()


def test_topk_ties_go_to_lower_index():
    s = torch.tensor([[1.0, 2.0, 2.0, -0.0, 2.0, 0.0, 0.0, 2.0]])
    idx = topk_mod.topk_select_ref(s, torch.tensor([8]), 3)
    assert idx.tolist() == [[1, 2, 4]]
    idx = topk_mod.topk_select_ref(s, torch.tensor([8]), 6)
    assert idx.tolist() == [[0, 1, 2, 3, 4, 7]]  # -0.0 (index 3) ties +0.0 and is lowest


@pytest.mark.parametrize("T,N,block,n_blocks", [(6, 1001, 8, 16), (4, 64, 8, 16), (5, 3000, 4, 100),
                                                (7, 517, 8, 64), (3, 300, 1, 40)],
                         ids=lambda v: str(v))
@pytest.mark.parametrize("kind", KINDS)
def test_candidate_ref_equals_reference(T, N, block, n_blocks, kind):
    s, n_vis = make_scores(T, N, kind, seed=N + block)
    s2, n2 = make_scores(9, N, kind, seed=N + block + 1, n_vis=edge_rows(N, n_blocks, block))
    for scores, nv in ((s, n_vis), (s2, n2)):
        ids = topk_mod.candidate_blocks_ref(scores, nv, block, n_blocks)
        assert ids.dtype == torch.int32 and ids.shape == (scores.shape[0], n_blocks)
        check_index_rows(ids, -(-nv.long() // block), n_blocks)
        assert torch.equal(topk_mod.blocks_to_mask(ids, block, N), candidate_mask(scores, nv, block, n_blocks))


def test_candidate_newest_block_is_pinned():
    s = torch.arange(100, dtype=torch.float32).flip(0)[None, :].clone()  # older = better
    ids = topk_mod.candidate_blocks_ref(s, torch.tensor([83]), 4, 3)
    assert ids.tolist() == [[0, 1, 20]]  # blocks 0, 1 by score; block 20 holds entry 82


def test_registered_ops_on_cpu_are_the_references():
    s, n_vis = make_scores(6, 999, "relu", seed=3)
    assert torch.equal(torch.ops.dsv41.topk_select(s, n_vis, 77), topk_mod.topk_select_ref(s, n_vis, 77))
    assert torch.equal(torch.ops.dsv41.candidate_blocks(s, n_vis, 8, 20),
                       topk_mod.candidate_blocks_ref(s, n_vis, 8, 20))


def test_fake_impls():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        s, nv = torch.empty(5, 4000), torch.empty(5, dtype=torch.int32)
        a = torch.ops.dsv41.topk_select(s, nv, 512)
        b = torch.ops.dsv41.candidate_blocks(s, nv, 8, 2048)
    assert a.shape == (5, 512) and b.shape == (5, 2048)
    assert a.dtype == b.dtype == torch.int32


# --------------------------------------------------------------------------- (b) Triton interpreter

# name: (op, T, N, topk or (block, n_blocks), kind, config override or None).  Between them the
# cases take every branch of _select_row: tau = theta (gather from the row), radix over the
# compacted candidates, and the whole-row fallback (a small CAP), with 1..8 persistent programs
# (``IN_REGS`` False: these widths would otherwise take the register route); and the register route
# (``_select_row_in_registers``, the default up to ``REG_MAX_N``) on every kind of row, with 4- and 8-bit digits.
_OLD = {"IN_REGS": False}
INTERPRET_CASES = {
    "topk-T5-N1501-k64-ties": ("topk", 5, 1501, 64, "ties", _OLD),
    "topk-T5-N1201-k64-relu-block256-candbits8": ("topk", 5, 1201, 64, "relu",
                                                  {"BLOCK": 256, "CAND_BITS": 8, "CAND_BLOCK": 256, **_OLD}),
    "topk-T5-N1000-k100-neginf": ("topk", 5, 1000, 100, "neginf", _OLD),
    "topk-T4-N1500-k512-distinct-block512": ("topk", 4, 1500, 512, "distinct", {"BLOCK": 512, **_OLD}),
    "topk-T4-N40-k64-short": ("topk", 4, 40, 64, "ties", _OLD),
    "topk-T5-N1201-k64-ties-rowpath": ("topk", 5, 1201, 64, "ties", {"CAP": 100, "PROGRAMS": 2, **_OLD}),
    "topk-T5-N800-k50-distinct-rowpath-bits4": ("topk", 5, 800, 50, "distinct",
                                                {"CAP": 60, "ROW_BITS": 4, "PROGRAMS": 3, **_OLD}),
    "topk-regs-T5-N1501-k64-ties": ("topk", 5, 1501, 64, "ties", None),
    "topk-regs-T5-N1201-k64-relu": ("topk", 5, 1201, 64, "relu", None),
    "topk-regs-T5-N1000-k100-neginf-programs2": ("topk", 5, 1000, 100, "neginf", {"PROGRAMS": 2}),
    "topk-regs-T4-N1280-k512-distinct": ("topk", 4, 1280, 512, "distinct", None),
    "topk-regs-T4-N2048-k512-ties-bits8": ("topk", 4, 2048, 512, "ties", {"REG_BITS": 8}),
    "topk-regs-T4-N40-k64-short": ("topk", 4, 40, 64, "ties", None),
    # the register route's sort form (REG_SORT): ties (lower index first), -inf rows, a short visible part, 2 programs
    "topk-sort-T5-N1501-k64-ties": ("topk", 5, 1501, 64, "ties", {"REG_SORT": True}),
    "topk-sort-T5-N1000-k100-neginf-programs2": ("topk", 5, 1000, 100, "neginf", {"REG_SORT": True, "PROGRAMS": 2}),
    "topk-sort-T4-N2048-k512-relu": ("topk", 4, 2048, 512, "relu", {"REG_SORT": True}),
    "topk-sort-T4-N1280-k512-distinct": ("topk", 4, 1280, 512, "distinct", {"REG_SORT": True}),
    "cand-T5-N2003-b8-nb64-relu": ("cand", 5, 2003, (8, 64), "relu", None),
    "cand-T5-N1200-b4-nb100-ties-block256": ("cand", 5, 1200, (4, 100), "ties", {"BLOCK": 256}),
    "cand-T4-N1200-b8-nb40-neginf": ("cand", 4, 1200, (8, 40), "neginf", None),
    "cand-T5-N1200-b8-nb40-distinct-rowpath": ("cand", 5, 1200, (8, 40), "distinct", {"CAP": 45, "PROGRAMS": 1}),
}

_RUNNER = """
import sys, torch
from tests.ops import test_topk as t
from vllm_dsv41.ops import topk
out = {}
for name, (op, T, N, k, kind, cfg) in t.INTERPRET_CASES.items():
    limit, block = (k, 1) if op == "topk" else (k[1], k[0])
    for variant, rows in (("rand", None), ("edge", t.edge_rows(N, limit, block))):
        s, nv = t.make_scores(T if rows is None else len(rows), N, kind, seed=T + N, n_vis=rows)
        if op == "topk":
            got, ref = topk._topk_select_triton(s, nv, k, config=cfg), topk.topk_select_ref(s, nv, k)
        else:
            got = topk._candidate_blocks_triton(s, nv, *k, config=cfg)
            ref = topk.candidate_blocks_ref(s, nv, *k)
        out[f"{name}-{variant}"] = (ref, got)
torch.save(out, sys.argv[1])
"""


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    path = tmp_path_factory.mktemp("topk") / "interpreted.pt"
    run_under_interpreter(["-c", _RUNNER, str(path)])
    return torch.load(path)


@pytest.mark.parametrize("case", list(INTERPRET_CASES))
@pytest.mark.parametrize("variant", ["rand", "edge"])
def test_triton_interpreted(interpreted, case, variant):
    ref, got = interpreted[f"{case}-{variant}"]
    assert got.dtype == torch.int32 and got.shape == ref.shape
    assert torch.equal(got, ref), f"{case}: rows {(got != ref).any(1).nonzero().flatten().tolist()} differ"


def test_register_route_switch(monkeypatch):
    """Rows up to 4,096 wide take the register route by default; ``VLLM_DSV41_TOPK_REGISTER_WIDTH`` narrows it (0:
    never) and cannot widen it past the tile the route was built for; a misspelt value names itself."""
    def route(n):
        return topk_mod._resolve_in_regs(topk_mod._select_config(n, 512), n)["IN_REGS"]

    monkeypatch.delenv(topk_mod.REG_WIDTH_ENV, raising=False)
    assert [route(n) for n in (600, 2048, 4096, 4097)] == [True, True, True, False]
    monkeypatch.setenv(topk_mod.REG_WIDTH_ENV, "0")
    assert not route(600)
    monkeypatch.setenv(topk_mod.REG_WIDTH_ENV, "1 << 20")
    with pytest.raises(ValueError, match="VLLM_DSV41_TOPK_REGISTER_WIDTH"):
        route(600)
    monkeypatch.setenv(topk_mod.REG_WIDTH_ENV, str(1 << 20))
    assert not route(8192)


@pytest.mark.parametrize("n,bits,sort", [(2048, 4, False), (4096, 4, False), (4096, 8, False), (2048, 4, True)])
def test_register_route_builds_for_sm90_without_spills(n, bits, sort):
    """The register route at its widest tiles compiles for Hopper with the row in registers, nothing spilled (its
    sort form at the batch-1 decode rows' 2,048-wide tile)."""
    from tests.ops.conftest import sm90_build

    cfg = topk_mod._resolve_in_regs(topk_mod._select_config(n, 512), n)
    cfg["REG_BITS"] = bits
    cfg["REG_SORT"] = sort
    args = topk_mod._launch_args(cfg)
    num_warps = args.pop("num_warps")
    sig = {"scores_ptr": "*fp32", "nvis_ptr": "*i32", "out_ptr": "*i32", "cand_key_ptr": "*i32",
           "cand_idx_ptr": "*i32"}
    sig.update({name: "i32" for name in ("T", "N", "topk", "cap", "stride_s", "stride_o", "stride_c")})
    const = dict(args, OUT_BLOCK=512)
    sig.update({name: "constexpr" for name in const})
    got = sm90_build(topk_mod._topk_select_kernel, sig, const, num_warps)
    print(f"topk_select register route, N {n}, {bits}-bit digits, sort {sort}: {got}")
    assert got["stack"] == 0


# --------------------------------------------------------------------------- (c) CUDA


@requires_cuda
@pytest.mark.parametrize("N", [600, 1280, 2048, 4096])
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_topk_select_sort_form(N, kind):
    """The register route's sort form (``REG_SORT``) at serving sizes: the reference's indices exactly."""
    s, n_vis = make_scores(3, N, kind, seed=N, device="cuda")
    s2, n2 = make_scores(9, N, kind, seed=N + 1, device="cuda", n_vis=edge_rows(N, 512))
    for scores, nv in ((s, n_vis), (s2, n2)):
        got = topk_mod._topk_select_triton(scores, nv, 512, config={"REG_SORT": True})
        assert torch.equal(got, topk_mod.topk_select_ref(scores, nv, 512))


@requires_cuda
@pytest.mark.parametrize("T,N", [(64, 1280), (64, 2048), (7, 4096), (64, 4097), (33, 65536 + 37), (4, 1 << 20),
                                 (1, 300_001)],
                         ids=lambda v: str(v))
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_topk_select(T, N, kind):
    s, n_vis = make_scores(T, N, kind, seed=T, device="cuda")
    s2, n2 = make_scores(9, N, kind, seed=T + 1, device="cuda", n_vis=edge_rows(N, 512))
    for scores, nv in ((s, n_vis), (s2, n2)):
        got = torch.ops.dsv41.topk_select(scores, nv, 512)
        assert torch.equal(got, topk_mod.topk_select_ref(scores, nv, 512))


@requires_cuda
@pytest.mark.parametrize("T,N", [(16, 131072 + 5), (2, 1 << 20), (64, 20000)], ids=lambda v: str(v))
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_candidate_blocks(T, N, kind):
    s, n_vis = make_scores(T, N, kind, seed=T, device="cuda")
    s2, n2 = make_scores(9, N, kind, seed=T + 1, device="cuda", n_vis=edge_rows(N, 2048, 8))
    for scores, nv in ((s, n_vis), (s2, n2)):
        got = torch.ops.dsv41.candidate_blocks(scores, nv, 8, 2048)
        assert torch.equal(got, topk_mod.candidate_blocks_ref(scores, nv, 8, 2048))


@requires_cuda
def test_cuda_masks_equal_reference_model():
    """The mask helpers close the loop with the reference model's boolean form on the GPU output."""
    s, n_vis = make_scores(8, 40000, "relu", seed=5, device="cuda")
    idx = torch.ops.dsv41.topk_select(s, n_vis, 512)
    blocks = torch.ops.dsv41.candidate_blocks(s, n_vis, 8, 2048)
    s_cpu, n_cpu = s.cpu(), n_vis.cpu()
    assert torch.equal(topk_mod.indices_to_mask(idx, 40000).cpu(), topk_select(s_cpu, n_cpu, 512))
    assert torch.equal(topk_mod.blocks_to_mask(blocks, 8, 40000).cpu(), candidate_mask(s_cpu, n_cpu, 8, 2048))
