"""ops/sparse_attn_gathered: the gather plan, the workspace and the whole path (with the CPU stand-in of
FlashMLA's kernel) against ``sparse_attn_ref``, on caches laid out as the engine's packed pools are."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

from tests.ops.conftest import requires_cuda, run_under_interpreter, sm90_build
from tests.ops.test_sparse_attn import _args, random_case
from vllm_dsv41 import formats
from vllm_dsv41.ops import sparse_attn as sa
from vllm_dsv41.ops import sparse_attn_gathered as sag


def packed_pool(records: torch.Tensor, rows_per_block: int, pad_bytes: int, g: torch.Generator):
    """Records [S, rec] placed in blocks of ``rows_per_block`` rows whose stride carries ``pad_bytes`` more
    (a shared pool's packed block), viewed as ``CacheLayer.flat_rows`` does.  Returns (flat view, bstep, rstep,
    engine slot -> flat row map)."""
    S, rec = records.shape
    nb = -(-S // rows_per_block) + 1  # block 0 stays vLLM's null block
    bstride = rows_per_block * rec + pad_bytes
    pool = torch.randint(0, 256, (nb * bstride,), dtype=torch.uint8, generator=g)
    kv = pool.as_strided((nb, 1, rows_per_block, rec), (bstride, bstride, rec, 1))
    gcd = math.gcd(bstride, rec)
    bstep, rstep = bstride // gcd, rec // gcd
    n = (nb - 1) * bstep + (rows_per_block - 1) * rstep + 1
    flat = pool.as_strided((n, rec), (gcd, 1))
    slot = torch.arange(S) + rows_per_block  # engine slots, past the null block
    kv[slot // rows_per_block, 0, slot % rows_per_block] = records

    def to_flat(s: torch.Tensor) -> torch.Tensor:
        s = s.long()
        e = torch.where(s >= 0, s + rows_per_block, 0)
        return torch.where(s >= 0, (e // rows_per_block) * bstep + (e % rows_per_block) * rstep, -1)

    return flat, bstep, rstep, to_flat


def test_gather_plan_lands_every_slot_on_its_record():
    g = torch.Generator().manual_seed(0)
    records = torch.randint(0, 256, (300, 24), dtype=torch.uint8, generator=g)
    flat, bstep, rstep, to_flat = packed_pool(records, 32, 40, g)
    assert bstep != 32 * rstep  # the packed geometry, not the identity map
    slots = torch.randint(-1, 300, (7, 50), generator=g)
    slots[:, :5] = -1
    plan = sag.gather_plan(to_flat(slots), bstep, rstep, 32, flat.shape[0])
    f = plan.blocks[:, None] * bstep + torch.arange(32)[None, :] * rstep
    ws = flat[f.flatten()]
    assert torch.equal(plan.rows < 0, slots < 0)
    ok = slots >= 0
    assert torch.equal(ws[plan.rows[ok].long()], records[slots[ok]])
    # only touched blocks are gathered
    touched = torch.unique((to_flat(slots[ok]) // bstep))
    assert torch.equal(plan.blocks, touched)


@pytest.mark.parametrize("slack", [0, 5])
def test_bounded_plan_equals_the_read_back_one(slack):
    """With a host-side bound the plan needs no host read: the same workspace rows, the touched blocks first (in the
    same order), then block 0 up to the bound (or the pool's block count)."""
    g = torch.Generator().manual_seed(2)
    records = torch.randint(0, 256, (300, 24), dtype=torch.uint8, generator=g)
    flat, bstep, rstep, to_flat = packed_pool(records, 32, 40, g)
    slots = to_flat(torch.randint(-1, 300, (7, 50), generator=g))
    read = sag.gather_plan(slots, bstep, rstep, 32, flat.shape[0])
    n = read.blocks.numel()
    bounded = sag.gather_plan(slots, bstep, rstep, 32, flat.shape[0], max_blocks=n + slack)
    assert torch.equal(bounded.rows, read.rows)
    pool_blocks = (flat.shape[0] - 1) // bstep + 1  # the list never outgrows the pool
    assert torch.equal(bounded.blocks[:n], read.blocks) and bounded.blocks.numel() == min(n + slack, pool_blocks)
    assert (bounded.blocks[n:] == 0).all()
    dec = lambda r: r.float()  # noqa: E731
    assert torch.equal(sag.gather_keys(flat, bounded, bstep, rstep, dec)[: n * 32],
                       sag.gather_keys(flat, read, bstep, rstep, dec))


def test_block_bounds_cover_every_list():
    """The host-side bounds against the blocks that every possible SWA list / compressed selection of random
    requests reaches through random block tables (the bound counts a request's blocks; shared blocks only lower
    the truth)."""
    g = torch.Generator().manual_seed(4)
    for _ in range(50):
        R, e, W, r = int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(1, 9, (1,), generator=g)), 16, 2
        first = torch.randint(0, 200, (R,), generator=g)
        last = first + torch.randint(0, 40, (R,), generator=g)
        table = torch.randperm(10_000, generator=g)[: R * 256].view(R, 256)  # distinct blocks per request
        swa, comp = set(), set()
        for i in range(R):
            for p in range(int(first[i]), int(last[i]) + 1):
                for k in range(max(p - W + 1, 0), p + 1):
                    swa.add(int(table[i, k // e]))
            for j in range((int(last[i]) + 1) // r):
                comp.add(int(table[i, j // e]))
        assert len(swa) == sag.swa_block_bound(first, last, W, e)  # distinct tables: the bound is exact
        assert len(comp) == sag.entry_block_bound(last, r, e)
    # a request without rows in the step counts nothing
    assert sag.swa_block_bound(torch.tensor([0]), torch.tensor([-1]), W, 4) == 0
    assert sag.entry_block_bound(torch.tensor([-1]), 2, 4) == 0


def test_plan_readback_switch(monkeypatch):
    monkeypatch.delenv(sag.READBACK_ENV, raising=False)
    assert not sag.read_back()  # default: bounded plans, no host read
    monkeypatch.setenv(sag.READBACK_ENV, "1")
    assert sag.read_back()


def test_combined_indices_shift_and_pad():
    swa = sag.GatherPlan(torch.zeros(1, dtype=torch.int64), torch.tensor([[0, 1, -1]], dtype=torch.int32), 4)
    comp = sag.GatherPlan(torch.zeros(1, dtype=torch.int64), torch.tensor([[2, -1]], dtype=torch.int32), 4)
    idx = sag.combined_indices(swa, comp, 4)
    assert idx.shape == (1, 1, sag.INDEX_ALIGN) and idx.dtype == torch.int32
    assert idx[0, 0, :5].tolist() == [0, 1, -1, 6, -1] and (idx[0, 0, 5:] == -1).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("swa_only", [False, True], ids=["both", "swa-only"])
def test_gathered_path_equals_sparse_attn_ref(dtype, swa_only):
    """With the float64 stand-in as the kernel the path computes what ``sparse_attn_ref`` computes: the same bits
    with fp32 q; with bf16 q the output is rounded before the inverse RoPE (the kernel's bf16 output), so within a
    bf16 rounding of the reference."""
    g = torch.Generator().manual_seed(3)
    c = random_case(9, 8, 64, 16, 20, None if swa_only else 30, seed=5, dtype=dtype, swa_pool=200, comp_pool=150)
    ref = sa.sparse_attn_ref(*_args(c))
    swa_flat, sb, sr, swa_map = packed_pool(c["swa_cache"], 32, 16, g)
    swa_plan = sag.gather_plan(swa_map(c["swa_slots"]), sb, sr, 32, swa_flat.shape[0])
    comp_flat = comp_plan = comp_steps = None
    if not swa_only:
        comp_flat, cb, cr, comp_map = packed_pool(c["comp_cache"], 16, 0, g)
        comp_steps = (cb, cr)
        comp_plan = sag.gather_plan(comp_map(c["comp_slots"]), cb, cr, 16, comp_flat.shape[0])
    got = sag.sparse_attn_gathered(c["q"], swa_flat, swa_plan, (sb, sr), comp_flat, comp_plan, comp_steps, c["sink"],
                                   c["scale"], c["positions"], c["inv_freq"], kernel=sag.sparse_fwd_ref)
    _assert_as_ref(got, ref)


def _assert_as_ref(got: torch.Tensor, ref: torch.Tensor) -> None:
    """A path with the float64 stand-in kernel against ``sparse_attn_ref``: the same bits with fp32 q, within the
    output's bf16 rounding before the inverse RoPE with bf16 q."""
    assert got.dtype == ref.dtype and got.shape == ref.shape
    if ref.dtype == torch.float32:
        assert torch.equal(got, ref)
    else:
        torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_gathered_keys_are_the_records_exactly():
    """bf16 holds every decoded record element exactly (at most 8 significant bits)."""
    g = torch.Generator().manual_seed(1)
    lat = torch.randn(64, 512, generator=g) * torch.exp(2 * torch.randn(512, generator=g))
    for enc, dec in ((formats.encode_mxfp8_record, formats.decode_mxfp8_record),
                     (formats.encode_nvfp4_record, formats.decode_nvfp4_record)):
        rec = enc(lat)
        flat, bstep, rstep, to_flat = packed_pool(rec, 32, 0, g)
        plan = sag.gather_plan(to_flat(torch.arange(64)[None, :]), bstep, rstep, 32, flat.shape[0])
        keys = sag.gather_keys(flat, plan, bstep, rstep, lambda r: dec(r, 512))
        assert keys.dtype == torch.bfloat16
        assert torch.equal(keys[plan.rows[0].long()].float(), dec(rec, 512))


def test_applies_by_default_on_a_gpu_unless_switched_off(monkeypatch):
    q = torch.zeros(512, 64, 512, dtype=torch.bfloat16)
    monkeypatch.delenv(sag.ENV, raising=False)
    assert not sag.applies(q, 512)  # a CPU tensor: no FlashMLA here
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert not sag.applies(q, 512) or sag.flashmla_sparse_fwd() is not None  # not importable on the CPU wheel
    monkeypatch.setattr(sag, "flashmla_sparse_fwd", lambda: sag.sparse_fwd_ref)
    assert sag.applies(q, 512)                                        # the default (auto)
    for value in ("flashmla", "auto", "AUTO "):
        monkeypatch.setenv(sag.ENV, value)
        assert sag.applies(q, 512), value
    assert not sag.applies(q, sag.MIN_ROWS - 1)                       # decode-sized steps
    assert not sag.applies(q.float(), 512)                            # the kernel takes bf16 q
    assert not sag.applies(torch.zeros(512, 16, 512, dtype=torch.bfloat16), 512)  # 16 heads (TP 4)
    monkeypatch.setenv(sag.ENV, "sparse_attn")
    assert not sag.applies(q, 512)                                    # switched off
    monkeypatch.setenv(sag.ENV, "flash_mla")
    with pytest.raises(ValueError, match="VLLM_DSV41_PREFILL_ATTN='flash_mla'"):
        sag.applies(q, 512)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("T", [256, 2048])
def test_cuda_flashmla_kernel_real_sizes(T):
    """The path with vLLM's FlashMLA kernel at the production sizes (64 heads, D 512, W 128, K 512, bf16 q)
    against the reference; skipped where FlashMLA does not import."""
    if sag.flashmla_sparse_fwd() is None:
        pytest.skip("vLLM's FlashMLA is not importable here")
    g = torch.Generator().manual_seed(T)
    c = random_case(T, 64, 512, 64, 128, 512, seed=T, dtype=torch.bfloat16, swa_pool=4096, comp_pool=8192,
                    holes=0.02)
    ref = sa.sparse_attn_ref(*_args(c)).float()
    swa_flat, sb, sr, swa_map = packed_pool(c["swa_cache"], 32, 0, g)
    comp_flat, cb, cr, comp_map = packed_pool(c["comp_cache"], 32, 0, g)
    dev = lambda t: t.cuda()  # noqa: E731
    swa_plan = sag.gather_plan(dev(swa_map(c["swa_slots"])), sb, sr, 32, swa_flat.shape[0])
    comp_plan = sag.gather_plan(dev(comp_map(c["comp_slots"])), cb, cr, 32, comp_flat.shape[0])
    got = sag.sparse_attn_gathered(dev(c["q"]), dev(swa_flat), swa_plan, (sb, sr), dev(comp_flat), comp_plan,
                                   (cb, cr), dev(c["sink"]), c["scale"], dev(c["positions"]), dev(c["inv_freq"]))
    err = ((got.float().cpu() - ref).norm() / ref.norm()).item()
    print(f"flashmla gathered T={T}: rel err {err:.2e}")
    assert err < 1e-2


# --------------------------------------------------------------------------- decode rows: each row's own keys


def _row_case(T, W, K, seed, dtype=torch.float32):
    c = random_case(T, 8, 64, 16, W, K, seed=seed, dtype=dtype, swa_pool=300, comp_pool=200, holes=0.1)
    return c


@pytest.mark.parametrize("K", [30, None], ids=["both", "swa-only"])
def test_row_keys_ref_lands_every_listed_record(K):
    """Row t's listed records sit decoded at rows t * N + j of the workspace, its index list points at them, a slot
    of -1 (and the padding to INDEX_ALIGN) at nothing."""
    c = _row_case(5, 20, K, seed=2)
    keys, idx = sag.row_keys_ref(c["swa_cache"], c["swa_slots"], c["comp_cache"], c["comp_slots"], 64)
    T, W = c["swa_slots"].shape
    N = sag.INDEX_ALIGN
    assert keys.shape == (T * N, 1, 64) and keys.dtype == torch.bfloat16
    assert idx.shape == (T, 1, N) and idx.dtype == torch.int32
    lists = [(c["swa_slots"], c["swa_cache"], 0, formats.decode_mxfp8_record)]
    if K:
        lists.append((c["comp_slots"], c["comp_cache"], W, formats.decode_nvfp4_record))
    for slots, cache, c0, dec in lists:
        for t in range(T):
            for j, slot in enumerate(slots[t].tolist()):
                row = idx[t, 0, c0 + j].item()
                if slot < 0:
                    assert row == -1
                else:
                    assert row == t * N + c0 + j
                    assert torch.equal(keys[row, 0].float(), dec(cache[slot:slot + 1], 64)[0])
    used = W + (K or 0)
    assert (idx[:, 0, used:] == -1).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rows_path_equals_sparse_attn_ref(dtype):
    """The decode-rows route with the float64 stand-in kernel computes ``sparse_attn_ref``'s result (fp32 q: the same
    bits; bf16 q: within the output's bf16 rounding before the inverse RoPE)."""
    c = _row_case(7, 20, 30, seed=4, dtype=dtype)
    ref = sa.sparse_attn_ref(*_args(c))
    got = sag.sparse_attn_rows(*_args(c), kernel=sag.sparse_fwd_ref)
    assert got.dtype == dtype
    _assert_as_ref(got, ref)


def test_applies_rows_by_default_unless_switched_off(monkeypatch):
    """The decode-rows route is the default since session 19 (docs/benchmarks.md); ``sparse_attn`` switches it off."""
    q = torch.zeros(64, 64, 512, dtype=torch.bfloat16)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(sag, "flashmla_sparse_fwd", lambda: sag.sparse_fwd_ref)
    monkeypatch.delenv(sag.DECODE_ENV, raising=False)
    assert sag.applies_rows(q, 64)                                    # on by default
    monkeypatch.setenv(sag.DECODE_ENV, "sparse_attn")
    assert not sag.applies_rows(q, 64)
    monkeypatch.setenv(sag.DECODE_ENV, "flashmla")
    assert sag.applies_rows(q, 64) and sag.applies_rows(q, sag.DECODE_MIN_ROWS)
    assert not sag.applies_rows(q, sag.DECODE_MIN_ROWS - 1)           # too few rows for the SMs
    assert not sag.applies_rows(q, sag.MIN_ROWS)                      # prefill: the block plans' route
    assert not sag.applies_rows(q.float(), 64)
    monkeypatch.setenv(sag.DECODE_ENV, "FlashMLA ")
    assert sag.applies_rows(q, 64)
    monkeypatch.setenv(sag.DECODE_ENV, "flash")
    with pytest.raises(ValueError, match="VLLM_DSV41_DECODE_ATTN='flash'"):
        sag.applies_rows(q, 64)


def _row_keys_interpreter_case() -> None:
    """The Triton kernel (interpreter) against the reference, byte for byte on the listed rows, both kinds, ragged
    tiles, int32 and int64 slot lists."""
    for T, W, K, seed in ((3, 20, 30, 7), (2, 17, None, 8)):
        c = _row_case(T, W, K, seed=seed)
        if seed == 8:
            c["swa_slots"] = c["swa_slots"].long()
        want_k, want_i = sag.row_keys_ref(c["swa_cache"], c["swa_slots"], c["comp_cache"], c["comp_slots"], 64)
        got_k, got_i = sag._row_keys_triton(c["swa_cache"], c["swa_slots"], c["comp_cache"], c["comp_slots"], 64,
                                            hw_fp8=False)
        assert torch.equal(got_i, want_i), "indices differ"
        rows = want_i.flatten()
        rows = rows[rows >= 0].long()
        assert torch.equal(got_k[rows], want_k[rows]), "decoded keys differ"


def test_row_keys_kernel_builds_for_sm90_without_spills():
    """Without a GPU: the gather kernel at the production width (D 512, 16 keys a program, 4 warps) compiles for sm_90
    with no spilled registers, for both record kinds (measured: 70 and 88 registers)."""
    k = sa._row_keys_kernel
    for kind in (0, 1):
        consts = {"KIND": kind, "D": 512, "BLOCK_N": sag.ROW_KEYS_BLOCK, "HW_FP8": True, "ALIGNED": True}
        ptrs = {"rec8_ptr": "*u8", "rec16_ptr": "*i16" if kind == 0 else "*u8", "slot_ptr": "*i32",
                "out_ptr": "*bf16", "idx_ptr": "*i32"}
        sig = {n: ptrs.get(n, "constexpr" if n in consts else "i32") for n in k.arg_names}
        got = sm90_build(k, sig, consts, 4, 1)
        assert got["stack"] == 0, (kind, got)


def test_row_keys_triton_interpreter():
    run_under_interpreter(["-m", "tests.ops.test_sparse_attn_gathered", "--interpret"])


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("T", [16, 64])
def test_cuda_rows_path_real_sizes(T):
    """The decode-rows route with vLLM's FlashMLA kernel at the production sizes against the reference (skipped where
    FlashMLA does not import), and its gather kernel byte for byte against ``row_keys_ref``."""
    c = random_case(T, 64, 512, 64, 128, 512, seed=T, dtype=torch.bfloat16, swa_pool=4096, comp_pool=8192,
                    holes=0.02, device="cuda")
    want_k, want_i = sag.row_keys_ref(c["swa_cache"], c["swa_slots"], c["comp_cache"], c["comp_slots"], 512)
    got_k, got_i = sag.row_keys(c["swa_cache"], c["swa_slots"], c["comp_cache"], c["comp_slots"], 512)
    rows = want_i.flatten()
    rows = rows[rows >= 0].long()
    assert torch.equal(got_i, want_i) and torch.equal(got_k[rows], want_k[rows])
    if sag.flashmla_sparse_fwd() is None:
        pytest.skip("vLLM's FlashMLA is not importable here")
    ref = sa.sparse_attn_ref(*_args(c)).float()
    got = sag.sparse_attn_rows(*_args(c))
    err = ((got.float() - ref).norm() / ref.norm()).item()
    print(f"flashmla decode rows T={T}: rel err {err:.2e}")
    assert err < 1e-2


if __name__ == "__main__" and "--interpret" in sys.argv:
    assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 before Python starts"
    _row_keys_interpreter_case()
    print("  ok row_keys kernel (interpreter) equals row_keys_ref")
    sys.exit(0)
