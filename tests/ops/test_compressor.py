"""torch.ops.dsv41.compress_insert: the reference against ``Transformer._compress`` (CPU, exact bytes),
the Triton kernel in the interpreter (subprocess, CPU tensors) and on CUDA at the real sizes.

``python -m tests.ops.test_compressor --interpret`` (with TRITON_INTERPRET=1 in the environment) is
the interpreter run; the pytest case below starts it.
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from tests.ops.conftest import assert_close, requires_cuda, run_under_interpreter
from vllm_dsv41 import formats
from vllm_dsv41.ops import compressor as cp
from vllm_dsv41.reference.model import Options, Session, Transformer, _Step, apply_rope, rms_norm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EPS = 1e-20
tl = None  # triton.language, bound by interpreter_fma_is_exact() in the interpreter subprocess


# --------------------------------------------------------------------------- case builders


def _inv_freq(R: int, theta: float = 10000.0) -> torch.Tensor:
    return 1.0 / theta ** (torch.arange(0, R, 2, dtype=torch.float32) / R)


def make_case(ratio: int, D: int, ID: int, R: int, P: int, *, start: int = 0, seed: int = 0,
              wk_dtype: torch.dtype = torch.float32) -> dict:
    """One request's compressor rows for positions start .. start+P-1, plus layer weights."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(P, ratio * D, generator=g) * torch.exp(0.5 * torch.randn(ratio * D, generator=g))
    return dict(
        ratio=ratio, D=D, ID=ID, R=R, start=start, rows=rows,
        norm_weight=torch.rand(D, generator=g) + 0.5,
        wk=(torch.randn(ID, D, generator=g) / D ** 0.5).to(wk_dtype),
        k_norm_weight=torch.rand(ID, generator=g) + 0.5,
        inv_freq=_inv_freq(R),
    )


def reference_entries(c: dict, chunks: list[range]) -> tuple[torch.Tensor, torch.Tensor]:
    """Unquantised (z_rot, k_idx) of every entry, from ``Transformer._compress`` fed chunk by chunk.

    A stub Transformer carries just what ``_compress`` reads; identity projections make its
    kv_c / score_c equal the case rows exactly (x @ [I | 0]^T)."""
    r, D, ID, L = c["ratio"], c["D"], c["ID"], 7
    eye = torch.eye(D)
    zero = torch.zeros(D, D)
    weights = {
        "p.attn.compressor.wkv": torch.cat((eye, zero), 1) if r == 2 else eye,
        "p.attn.compressor.wgate": torch.cat((zero, eye), 1),
        "p.attn.compressor.norm.weight": c["norm_weight"],
        "p.attn.indexer.wk.weight": c["wk"].float(),
        "p.attn.indexer.k_norm.weight": c["k_norm_weight"],
    }
    tr = Transformer.__new__(Transformer)
    tr.cfg = SimpleNamespace(head_dim=D, index_head_dim=ID)
    tr.w = weights.__getitem__
    tr.eps = EPS
    tr.opt = Options(cache_quant=False)
    tr._inv_freq = {L: c["inv_freq"]}
    plan = SimpleNamespace(layer_id=L, compress_ratio=r)
    s = Session()
    for ch in chunks:
        pos = torch.arange(c["start"] + ch.start, c["start"] + ch.stop)
        tr._compress(s, "p", plan, c["rows"][ch.start:ch.stop], _Step(pos=pos, swa_floor=0, write_global_from=0))
    n = (c["start"] + c["rows"].shape[0]) // r
    return s.comp[L][:n], s.idxk[L][:n]


def op_args(c: dict, ch: range, comp_slot_of, idx_slot_of, comp_cache, idx_cache, device="cpu") -> tuple:
    """Arguments of one compress_insert call for the chunk ``ch`` (row indices of the case).

    prev[t] is the row of position p-1 (the caller resolves it from the step or from the ring);
    ``*_slot_of(j)`` gives the slot of entry j (or -1)."""
    r, rows = c["ratio"], c["rows"]
    pos = torch.arange(c["start"] + ch.start, c["start"] + ch.stop)
    prev = None
    if r == 2:
        prev = torch.zeros(len(ch), rows.shape[1])
        for i, t in enumerate(ch):
            if t > 0:
                prev[i] = rows[t - 1]
    comp_slots = torch.full((len(ch),), -1, dtype=torch.int64)
    idx_slots = torch.full((len(ch),), -1, dtype=torch.int64)
    for i, p in enumerate(pos.tolist()):
        if (p + 1) % r == 0:
            comp_slots[i] = comp_slot_of(p // r)
            idx_slots[i] = idx_slot_of(p // r)
    dev = lambda t: None if t is None else t.to(device)  # noqa: E731
    return (dev(rows[ch.start:ch.stop]), dev(prev), dev(pos), r, dev(c["norm_weight"]), dev(c["wk"]),
            dev(c["k_norm_weight"]), EPS, dev(c["inv_freq"]), dev(comp_slots), dev(idx_slots), comp_cache, idx_cache)


def empty_caches(c: dict, n_slots: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Caches filled with 0xA5 so untouched records are recognisable."""
    cc = torch.full((n_slots, formats.nvfp4_record_bytes(c["D"])), 0xA5, dtype=torch.uint8, device=device)
    ic = torch.full((n_slots, formats.mxfp4_record_bytes(c["ID"])), 0xA5, dtype=torch.uint8, device=device)
    return cc, ic


# --------------------------------------------------------------------------- CPU: reference


@pytest.mark.parametrize("ratio", [1, 2])
@pytest.mark.parametrize("wk_dtype", [torch.float32, torch.bfloat16], ids=["wk32", "wk16"])
def test_ref_bytes_equal_reference_model(ratio, wk_dtype):
    """Chunked calls (the second chunk's first pair straddles the chunks, its partner comes from the
    'ring') write exactly formats.encode_* of the reference model's z_rot / k_idx."""
    c = make_case(ratio, D=64, ID=32, R=16, P=23, start=40, seed=ratio, wk_dtype=wk_dtype)
    chunks = [range(0, 7), range(7, 8), range(8, 23)]
    z_ref, k_ref = reference_entries(c, chunks)
    n_ent = z_ref.shape[0]
    g = torch.Generator().manual_seed(5)
    cperm, iperm = torch.randperm(n_ent + 9, generator=g), torch.randperm(n_ent + 9, generator=g)
    cc, ic = empty_caches(c, n_ent + 9)
    for ch in chunks:
        torch.ops.dsv41.compress_insert(*op_args(c, ch, lambda j: cperm[j], lambda j: iperm[j], cc, ic))
    first = (c["start"] + ratio) // ratio - 1  # first entry closed inside the case
    js = torch.arange(first, n_ent)
    assert torch.equal(cc[cperm[js]], formats.encode_nvfp4_record(z_ref[js]))
    assert torch.equal(ic[iperm[js]], formats.encode_mxfp4_record(k_ref[js]))
    untouched = torch.ones(n_ent + 9, dtype=torch.bool)
    untouched[cperm[js]] = False
    assert (cc[untouched] == 0xA5).all()


@pytest.mark.parametrize("ratio", [1, 2])
def test_oracle_floats_equal_reference_model(ratio):
    """The test oracle used for far positions is bit-identical to Transformer._compress."""
    c = make_case(ratio, D=64, ID=32, R=16, P=20, start=0, seed=7)
    z_ref, k_ref = reference_entries(c, [range(0, 20)])
    rows_idx = torch.arange(ratio - 1, 20, ratio)
    z, k = oracle_floats(c, rows_idx)
    assert torch.equal(z, z_ref) and torch.equal(k, k_ref)


@pytest.mark.parametrize("ratio", [1, 2])
def test_ref_independent_minus_one_slots(ratio):
    """comp and idx slots are masked independently; non-closing tokens never write."""
    c = make_case(ratio, D=64, ID=32, R=16, P=16, start=3, seed=11)
    z_ref, k_ref = reference_entries(c, [range(16)])
    cc, ic = empty_caches(c, 32)
    cs = lambda j: -1 if j % 3 == 0 else j  # noqa: E731
    ks = lambda j: -1 if j % 3 == 1 else j  # noqa: E731
    args = list(op_args(c, range(16), cs, ks, cc, ic))
    if ratio == 2:  # a valid slot on a non-closing token must be ignored
        pos = args[2]
        args[9] = torch.where((pos + 1) % 2 == 0, args[9], torch.full_like(args[9], 31))
    cp.compress_insert_ref(*args)
    for j in range((c["start"] + ratio - 1) // ratio, (c["start"] + 16) // ratio):
        if cs(j) >= 0:
            assert torch.equal(cc[j], formats.encode_nvfp4_record(z_ref[j]))
        if ks(j) >= 0:
            assert torch.equal(ic[j], formats.encode_mxfp4_record(k_ref[j]))
    assert (cc[31] == 0xA5).all()
    for j in range(32):
        if cs(j) < 0:
            assert (cc[j] == 0xA5).all()
        if ks(j) < 0:
            assert (ic[j] == 0xA5).all()


def test_op_dispatches_to_reference_on_cpu():
    c = make_case(2, D=64, ID=32, R=16, P=10, seed=3)
    a1, a2 = empty_caches(c, 8), empty_caches(c, 8)
    torch.ops.dsv41.compress_insert(*op_args(c, range(10), lambda j: j, lambda j: j, *a1))
    cp.compress_insert_ref(*op_args(c, range(10), lambda j: j, lambda j: j, *a2))
    assert torch.equal(a1[0], a2[0]) and torch.equal(a1[1], a2[1])


def test_opcheck_schema_and_fake():
    c = make_case(2, D=64, ID=32, R=16, P=6, seed=4)
    args = op_args(c, range(6), lambda j: j, lambda j: j, *empty_caches(c, 4))
    torch.library.opcheck(torch.ops.dsv41.compress_insert.default, args,
                          test_utils=("test_schema", "test_faketensor"))


def test_bad_shapes_raise():
    c = make_case(2, D=64, ID=32, R=16, P=4, seed=5)
    args = list(op_args(c, range(4), lambda j: j, lambda j: j, *empty_caches(c, 4)))
    bad = list(args)
    bad[1] = None  # ratio 2 without partner rows
    with pytest.raises(ValueError):
        cp.compress_insert_ref(*bad)
    bad = list(args)
    bad[11] = torch.zeros(4, 35, dtype=torch.uint8)
    with pytest.raises(ValueError):
        cp.compress_insert_ref(*bad)
    bad = list(args)
    bad[3] = 4
    with pytest.raises(ValueError):
        cp.compress_insert_ref(*bad)


# --------------------------------------------------------------------------- Triton (interpreter / CUDA)


def adversarial_rows(W: int, kind: str, n_random: int, seed: int, device="cpu") -> torch.Tensor:
    """Rows that hit every rounding rule of the record encoders: exact E2M1 ties at several scales,
    E4M3-scale ties (normal and subnormal), the 2^-9 clamp, 448 saturation, zeros, -0.0, tiny and
    huge magnitudes; then random rows over a wide exponent range."""
    g = torch.Generator().manual_seed(seed)
    gs = 16 if kind == "nvfp4" else 32
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.0, 7.0])
    rows = []
    scales = [1.0, 0.875, 2.0 ** -7, 2.0 ** -9, 3.0 * 2.0 ** -9, 2.0 ** 5, 448.0, 2.0 ** -120] if kind == "nvfp4" \
        else [1.0, 2.0 ** -3, 2.0 ** 10, 2.0 ** -126, 2.0 ** 100]
    for s in scales:
        v = ties.repeat(W // 16)[:W].clone()
        v[0::gs] = 6.0  # group amax = 6 * s -> scale s (power of two or E4M3-exact)
        sign = torch.where(torch.rand(W, generator=g) < 0.5, -1.0, 1.0)
        rows.append(v * sign * s)
    if kind == "nvfp4":
        # amax/6 = 1.0625, 1.1875, 2.125 (normal ties, down / up / down), 1.5, 2.5, 4.5, 7.5 x 2^-9
        # (subnormal ties), 2^-12 (below the clamp), 500 and 8333 (above 448)
        for amax in (6.375, 7.125, 12.75, 9 * 2.0 ** -9, 15 * 2.0 ** -9, 27 * 2.0 ** -9, 45 * 2.0 ** -9,
                     6 * 2.0 ** -12, 3000.0, 5e4):
            v = torch.randn(W, generator=g).clamp(-1, 1) * amax * 0.9
            v[0::gs] = amax  # amax/6 exactly between two E4M3 values / below the clamp / above 448
            rows.append(v)
    z = torch.zeros(W)
    rows.append(z)
    rows.append(-z)
    tiny = torch.zeros(W)
    tiny[1::3] = -1e-40
    tiny[2::5] = 3e-39
    rows.append(tiny)
    x = torch.stack(rows)
    rnd = torch.randn(n_random, W, generator=g) * torch.exp2(torch.randint(-30, 30, (n_random, W // gs), generator=g)
                                                             .float()).repeat_interleave(gs, 1)
    return torch.cat((x, rnd)).to(device)


def check_encoders(W: int, n_random: int, device="cpu") -> None:
    for kind, enc in (("nvfp4", formats.encode_nvfp4_record), ("mxfp4", formats.encode_mxfp4_record)):
        x = adversarial_rows(W, kind, n_random, seed=W, device=device)
        got = cp._encode_records_triton(x, kind)
        want = enc(x)
        bad = (got != want).any(-1).nonzero().flatten().tolist()
        assert not bad, f"{kind} W={W}: rows {bad[:8]} differ, first: {x[bad[0]].tolist()}"


def run_kernel_case(c: dict, chunks: list[range], cs, ks, n_slots: int, device="cpu", block_t=None) -> dict:
    """Triton and reference over the same chunks; returns caches and the kernel's floats.  ``block_t``: tokens per
    program (None: the launch's own choice, ``cp.block_rows``)."""
    cc_r, ic_r = empty_caches(c, n_slots, device)
    cc_t, ic_t = empty_caches(c, n_slots, device)
    zs, ks_, live = [], [], []
    for ch in chunks:
        args = op_args(c, ch, cs, ks, cc_r, ic_r, device)
        cp.compress_insert_ref(*args)
        z = torch.full((len(ch), c["D"]), float("nan"), device=device)
        k = torch.full((len(ch), c["ID"]), float("nan"), device=device)
        cp._compress_insert_triton(*args[:11], cc_t, ic_t, float_out=(z, k), block_t=block_t)
        zs.append(z)
        ks_.append(k)
        pos = args[2]
        live.append(((pos + 1) % c["ratio"] == 0) & ((args[9] >= 0) | (args[10] >= 0)))
    return dict(cc_r=cc_r, ic_r=ic_r, cc_t=cc_t, ic_t=ic_t, z=torch.cat(zs), k=torch.cat(ks_), live=torch.cat(live))


def oracle_floats(c: dict, rows_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(z_rot, k_idx) of the closing case rows ``rows_idx`` by the reference-model formula (the math of
    ``Transformer._compress``; ``test_oracle_floats_equal_reference_model`` pins the two together).
    The partner of row 0 is a zero row, as in ``op_args``."""
    r, D, rows = c["ratio"], c["D"], c["rows"]
    cur = rows[rows_idx]
    if r == 2:
        prev = torch.where((rows_idx > 0)[:, None], rows[(rows_idx - 1).clamp_min(0)], torch.zeros_like(cur))
        pair = torch.stack((prev, cur), 1)
        pooled = (pair[..., :D] * torch.softmax(pair[..., D:], dim=1)).sum(1)
    else:
        pooled = cur
    z = rms_norm(pooled, c["norm_weight"], EPS)
    ent_pos = ((c["start"] + rows_idx) // r) * r
    z_rot = apply_rope(z, ent_pos, c["inv_freq"])
    k = rms_norm(z @ c["wk"].float().t(), c["k_norm_weight"], EPS)
    return z_rot, apply_rope(k, ent_pos, c["inv_freq"])


def check_kernel_case(name: str, c: dict, chunks: list[range], cs, ks, n_slots: int, device="cpu",
                      min_equal: float = 0.97, block_t=None) -> str:
    """(1) the kernel's bytes are formats.encode_* of the kernel's own floats, exactly;
    (2) its floats match the reference formula; (3) its bytes match the reference op's except for
    rare E2M1 decision-point crossings; (4) nothing else is written."""
    out = run_kernel_case(c, chunks, cs, ks, n_slots, device, block_t)
    r = c["ratio"]
    live = out["live"].cpu()
    rows_idx = live.nonzero().flatten()
    ent = (c["start"] + rows_idx) // r
    z_ref, k_ref = oracle_floats(c, rows_idx)
    wc = torch.tensor([cs(int(j)) >= 0 for j in ent], dtype=torch.bool)
    wi = torch.tensor([ks(int(j)) >= 0 for j in ent], dtype=torch.bool)
    cslot = torch.tensor([cs(int(j)) for j in ent], dtype=torch.int64)[wc]
    islot = torch.tensor([ks(int(j)) for j in ent], dtype=torch.int64)[wi]
    z, k = out["z"].cpu()[live], out["k"].cpu()[live]
    cc_t, ic_t, cc_r, ic_r = (out[n].cpu() for n in ("cc_t", "ic_t", "cc_r", "ic_r"))
    assert torch.equal(cc_t[cslot], formats.encode_nvfp4_record(z[wc])), f"{name}: NVFP4 bytes != encode(kernel z)"
    assert torch.equal(ic_t[islot], formats.encode_mxfp4_record(k[wi])), f"{name}: MXFP4 bytes != encode(kernel k)"
    if rows_idx.numel():
        assert_close(f"{name} z_rot", z_ref, z, ratio=1e-5)
        assert_close(f"{name} k_idx", k_ref, k, ratio=1e-5)
    written_c = torch.zeros(n_slots, dtype=torch.bool)
    written_c[cslot] = True
    written_i = torch.zeros(n_slots, dtype=torch.bool)
    written_i[islot] = True
    assert (cc_t[~written_c] == 0xA5).all() and (ic_t[~written_i] == 0xA5).all(), f"{name}: stray writes"
    eq_c = (cc_t[cslot] == cc_r[cslot]).float().mean().item() if cslot.numel() else 1.0
    eq_i = (ic_t[islot] == ic_r[islot]).float().mean().item() if islot.numel() else 1.0
    assert eq_c >= min_equal and eq_i >= min_equal, f"{name}: bytes equal to the reference {eq_c:.4f} / {eq_i:.4f}"
    D, ID = c["D"], c["ID"]
    if cslot.numel():
        assert_close(f"{name} comp decoded", formats.decode_nvfp4_record(cc_r[cslot], D),
                     formats.decode_nvfp4_record(cc_t[cslot], D), ratio=2e-2)
    if islot.numel():
        assert_close(f"{name} idx decoded", formats.decode_mxfp4_record(ic_r[islot], ID),
                     formats.decode_mxfp4_record(ic_t[islot], ID), ratio=2e-2)
    return f"{len(cslot)}+{len(islot)} records, bytes equal to ref {eq_c:.4f} / {eq_i:.4f}"


def _every(j):
    return j


def _holes(j):  # some entries write neither cache, some only one
    return -1 if j % 5 == 0 else j


def _holes2(j):
    return -1 if j % 5 in (0, 2) else j


# name, case kwargs, chunks, comp slot fn, idx slot fn, slots
_INTERP_CASES = [
    ("r1-odd", dict(ratio=1, D=64, ID=32, R=16, P=21, start=5, seed=1), [range(0, 21)], _every, _every, 40),
    ("r2-chunks", dict(ratio=2, D=64, ID=32, R=16, P=37, start=8, seed=2), [range(0, 5), range(5, 6), range(6, 37)],
     _every, _every, 40),
    ("r2-holes", dict(ratio=2, D=64, ID=32, R=16, P=30, start=1, seed=3), [range(0, 30)], _holes, _holes2, 40),
    ("r1-holes-farpos", dict(ratio=1, D=64, ID=64, R=32, P=19, start=1_000_003, seed=4), [range(0, 19)],
     lambda j: _holes(j - 1_000_003), lambda j: _holes2(j - 1_000_003), 19),
    ("r2-bf16wk-farpos", dict(ratio=2, D=128, ID=32, R=16, P=18, start=4_000_000, seed=5,
                              wk_dtype=torch.bfloat16), [range(0, 18)],
     lambda j: j - 2_000_000, lambda j: j - 2_000_000, 9),
    ("r2-real", dict(ratio=2, D=512, ID=128, R=64, P=6, start=3, seed=6), [range(0, 6)], _every, _every, 8),
]


def _fma_probe(x_ptr, out_ptr):
    x = tl.load(x_ptr)
    tl.store(out_ptr, tl.fma(x, x, -(x * x)))


def interpreter_fma_is_exact() -> bool:
    """Older Triton interpreters evaluate tl.fma as x * y + z in fp32 (two roundings); the kernel's
    exact RoPE angle (hi + lo via fma) then degrades at large positions, which only the GPU has."""
    import triton
    import triton.language

    globals()["tl"] = triton.language
    x, out = torch.tensor([1.0 + 2.0 ** -12]), torch.zeros(1)
    triton.jit(_fma_probe)[(1,)](x, out)
    return out.item() == 2.0 ** -24


def _interpreter_main() -> int:
    """Encoder exactness, then every fused case; one line each; exit status 1 on any failure."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 before Python starts"
    failed = 0
    exact_fma = interpreter_fma_is_exact()
    t0 = time.perf_counter()
    try:
        for W in (64, 512):
            check_encoders(W, n_random=40)
        print(f"  ok encoders ({time.perf_counter() - t0:.1f} s)")
    except AssertionError as e:
        failed += 1
        print(f"FAIL encoders: {e}")
    # every case on the tl.dot route (16 tokens a program) and on the small-row route (products and a sum)
    for (name, kw, chunks, cs, ks, n_slots), block_t in itertools.product(_INTERP_CASES, (16, cp.SMALL_BLOCK_T)):
        if "farpos" in name and not exact_fma:
            print(f"skip {name}: this interpreter's tl.fma rounds twice (the CUDA tests cover far positions)")
            continue
        name = f"{name}/bt{block_t}"
        t0 = time.perf_counter()
        try:
            msg = check_kernel_case(name, make_case(**kw), chunks, cs, ks, n_slots, block_t=block_t)
            print(f"  ok {name}: {msg} ({time.perf_counter() - t0:.1f} s)")
        except AssertionError as e:
            failed += 1
            print(f"FAIL {name}: {e}")
    return 1 if failed else 0


def test_triton_interpreter():
    run_under_interpreter(["-m", "tests.ops.test_compressor", "--interpret"])


def test_tokens_per_program_switch(monkeypatch):
    """Small launches take the small-row route, large ones tl.dot; ``VLLM_DSV41_COMPRESS_SMALL_ROWS`` moves the
    limit (0: tl.dot always) and names itself when misspelt."""
    monkeypatch.delenv(cp.SMALL_ROWS_ENV, raising=False)
    assert [cp.block_rows(T) for T in (1, 64, cp.SMALL_ROWS, cp.SMALL_ROWS + 1)] == [2, 2, 2, 16]
    monkeypatch.setenv(cp.SMALL_ROWS_ENV, "0")
    assert cp.block_rows(1) == 16
    monkeypatch.setenv(cp.SMALL_ROWS_ENV, "lots")
    with pytest.raises(ValueError, match="VLLM_DSV41_COMPRESS_SMALL_ROWS='lots'"):
        cp.block_rows(1)


@pytest.mark.parametrize("block_t", [16, cp.SMALL_BLOCK_T])
@pytest.mark.parametrize("ratio", [1, 2])
def test_kernel_builds_for_sm90_without_spills(block_t, ratio):
    """Both routes of the fused kernel at the real sizes (D 512, ID 128, R 64) compile for Hopper without spills (the
    small-row route's products and sum hold a [2, 128, 64] tile in registers).  Both keep a 32-byte stack frame on
    this Triton (3.9 here, its ptxas), the tl.dot route since it was written; more would be spilled registers."""
    from tests.ops.conftest import sm90_build

    kernel, _ = cp._kernels()
    ptrs = ("kv_ptr", "prev_ptr", "pos_ptr", "cslot_ptr", "islot_ptr", "norm_ptr", "wk_ptr", "knorm_ptr", "freq_ptr",
            "ccache_ptr", "icache_ptr", "zdbg_ptr", "kdbg_ptr")
    types = ("*fp32", "*fp32", "*i64", "*i64", "*i64", "*fp32", "*bf16", "*fp32", "*fp32", "*u8", "*u8", "*fp32",
             "*fp32")
    sig = dict(zip(ptrs, types))
    sig.update({n: "i32" for n in ("T", "stride_kv", "stride_prev", "stride_wk_o", "stride_wk_i", "stride_cc",
                                   "stride_ic")})
    sig["eps"] = "fp32"
    const = dict(RATIO=ratio, D=512, ID=128, R=64, BLOCK_T=block_t, BLOCK_D=64, STORE_FLOATS=False)
    sig.update({k: "constexpr" for k in const})
    got = sm90_build(kernel, sig, const, 8)
    print(f"compress_insert ratio {ratio}, {block_t} tokens a program: {got}")
    assert got["stack"] <= 32


# --------------------------------------------------------------------------- CUDA, real sizes


@requires_cuda
def test_cuda_encoders_exact():
    check_encoders(512, n_random=4096, device="cuda")
    check_encoders(128, n_random=4096, device="cuda")


@requires_cuda
@pytest.mark.parametrize("block_t", [None, 16, 2])
@pytest.mark.parametrize("ratio", [1, 2])
@pytest.mark.parametrize("P", [1, 64, 1000])
def test_cuda_real_sizes(ratio, P, block_t):
    start = 1_000_000 - P  # far positions (the RoPE angle reduction matters); the last token closes
    c = make_case(ratio, D=512, ID=128, R=64, P=P, start=start, seed=P + ratio, wk_dtype=torch.bfloat16)
    chunks = [range(0, P)] if P < 64 else [range(0, P // 2 + 1), range(P // 2 + 1, P)]
    base = start // ratio
    comp_slot = lambda j: -1 if (j - base) % 5 == 3 else j - base  # noqa: E731  (some entries skip the KV write)
    msg = check_kernel_case(f"r{ratio}-P{P}", c, chunks, comp_slot, lambda j: j - base, P // ratio + 2, device="cuda",
                            block_t=block_t)
    print(msg)


@requires_cuda
def test_cuda_op_dispatch():
    c = make_case(2, D=512, ID=128, R=64, P=64, start=10, seed=9, wk_dtype=torch.bfloat16)
    cc, ic = empty_caches(c, 64, "cuda")
    torch.ops.dsv41.compress_insert(*op_args(c, range(64), lambda j: j, lambda j: j, cc, ic, device="cuda"))
    cc_r, ic_r = empty_caches(c, 64, "cuda")
    cp.compress_insert_ref(*op_args(c, range(64), lambda j: j, lambda j: j, cc_r, ic_r, device="cuda"))
    assert (cc == cc_r).float().mean() > 0.97 and (ic == ic_r).float().mean() > 0.97


if __name__ == "__main__":
    if "--interpret" in sys.argv:
        sys.exit(_interpreter_main())
