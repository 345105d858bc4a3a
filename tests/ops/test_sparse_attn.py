"""torch.ops.dsv41.sparse_attn: the reference against the model's formula (CPU), the Triton kernel
in the interpreter (subprocess, CPU tensors) and on CUDA at the real sizes.

``python -m tests.ops.test_sparse_attn --interpret`` (with TRITON_INTERPRET=1 in the environment)
is the interpreter run; the pytest case below starts it.
"""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch

from tests.ops.conftest import SM90_SHARED_LIMIT, assert_close, requires_cuda, run_under_interpreter, sm90_build
from vllm_dsv41 import formats
from vllm_dsv41.ops import sparse_attn as sa
from vllm_dsv41.reference.model import apply_rope, sparse_attention

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# --------------------------------------------------------------------------- case builders


def _inv_freq(R: int, theta: float = 10000.0) -> torch.Tensor:
    return 1.0 / theta ** (torch.arange(0, R, 2, dtype=torch.float32) / R)


def _latents(n: int, D: int, g: torch.Generator) -> torch.Tensor:
    """Random latents with a per-channel spread, so the per-block scales differ."""
    return torch.randn(n, D, generator=g) * torch.exp(0.7 * torch.randn(D, generator=g))


def random_case(T: int, Hq: int, D: int, R: int, W: int, K: int | None, *, seed: int = 0,
                dtype: torch.dtype = torch.float32, swa_pool: int | None = None, comp_pool: int | None = None,
                holes: float = 0.2, ragged: bool = True, max_pos: int = 1_000_000,
                device: str = "cpu") -> dict:
    """Caches of random records and, per row, distinct random slots with some -1 entries.

    ``K=None`` gives an SWA-only case (comp_cache = comp_slots = None).  With ``ragged`` each
    row's compressed list ends in a random run of -1 (short-context rows).
    """
    g = torch.Generator().manual_seed(seed)
    swa_pool = swa_pool or max(2 * W, 8)
    swa_cache = formats.encode_mxfp8_record(_latents(swa_pool, D, g))
    swa_slots = torch.rand(T, swa_pool, generator=g).argsort(1)[:, :W].to(torch.int32)
    swa_slots[torch.rand(T, W, generator=g) < holes] = -1
    comp_cache = comp_slots = None
    if K is not None:
        comp_pool = comp_pool or max(2 * K, 8)
        comp_cache = formats.encode_nvfp4_record(_latents(comp_pool, D, g))
        comp_slots = torch.rand(T, comp_pool, generator=g).argsort(1)[:, :K].to(torch.int32)
        comp_slots[torch.rand(T, K, generator=g) < holes] = -1
        if ragged:
            n_valid = torch.randint(0, K + 1, (T,), generator=g)
            comp_slots[torch.arange(K)[None, :] >= n_valid[:, None]] = -1
    case = dict(
        q=(2.0 * torch.randn(T, Hq, D, generator=g)).to(dtype),
        swa_cache=swa_cache, swa_slots=swa_slots, comp_cache=comp_cache, comp_slots=comp_slots,
        sink=torch.randn(Hq, generator=g),
        scale=D ** -0.5,
        positions=torch.randint(0, max_pos, (T,), generator=g),
        inv_freq=_inv_freq(R),
    )
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in case.items()}


def odd_case(dtype: torch.dtype = torch.float32, seed: int = 1, empty_row: bool = False) -> dict:
    """T=3, Hq=4, D=64, R=16, W=7, K=5: row 0 has holes in both lists, row 1 no compressed keys,
    row 2 only its own SWA key (``empty_row``: row 1 has no key at all, only the sink)."""
    c = random_case(3, 4, 64, 16, 7, 5, seed=seed, dtype=dtype, holes=0.0, ragged=False)
    c["swa_slots"][0, 2] = -1
    c["comp_slots"][0, [1, 4]] = -1
    c["comp_slots"][1] = -1
    c["swa_slots"][2, 1:] = -1
    c["comp_slots"][2] = -1
    if empty_row:
        c["swa_slots"][1] = -1
    return c


def _args(c: dict) -> tuple:
    return (c["q"], c["swa_cache"], c["swa_slots"], c["comp_cache"], c["comp_slots"], c["sink"], c["scale"],
            c["positions"], c["inv_freq"])


def per_row_oracle(c: dict) -> torch.Tensor:
    """Each row on its own: its listed keys (in list order), the reference softmax and inverse RoPE."""
    q, D = c["q"], c["q"].shape[-1]
    rows = []
    for t in range(q.shape[0]):
        s = c["swa_slots"][t]
        keys = formats.decode_mxfp8_record(c["swa_cache"][s[s >= 0].long()], D)
        if c["comp_cache"] is not None:
            cs = c["comp_slots"][t]
            keys = torch.cat((keys, formats.decode_nvfp4_record(c["comp_cache"][cs[cs >= 0].long()], D)))
        if keys.shape[0] == 0:
            rows.append(torch.zeros(1, *q.shape[1:], device=q.device))
            continue
        mask = torch.ones(1, keys.shape[0], dtype=torch.bool, device=q.device)
        rows.append(sparse_attention(q[t:t + 1].float(), keys, mask, c["sink"].float(), c["scale"]))
    out = apply_rope(torch.cat(rows), c["positions"], c["inv_freq"], inverse=True)
    return out.to(q.dtype)


# --------------------------------------------------------------------------- CPU: the reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_ref_equals_model_formula_exactly(dtype):
    """One request as ``Attention.forward`` sees it: paged SWA window + short-context compressed
    selection (every visible entry); the op's reference must be bit-equal to the model's formula."""
    g = torch.Generator().manual_seed(3)
    D, R, Hq, W, r, blk = 64, 16, 4, 8, 2, 4
    pos = torch.arange(9, 15)  # 6 query rows of one request
    T, end = pos.numel(), int(pos[-1]) + 1
    # SWA: positions -> slots through an ascending block table (4-token blocks)
    swa_table = torch.tensor([2, 3, 5, 8, 9, 11])
    swa_slot_of = lambda p: swa_table[p // blk] * blk + p % blk  # noqa: E731
    swa_cache = torch.zeros(64, formats.mxfp8_record_bytes(D), dtype=torch.uint8)
    kv = _latents(end, D, g)
    swa_cache[swa_slot_of(torch.arange(end))] = formats.encode_mxfp8_record(kv)
    # compressed entries j = 0..N-1 (ratio 2), 4 entries per block
    n_vis = (pos + 1) // r
    N = int(n_vis.max())
    comp_table = torch.tensor([1, 4, 6])
    comp_slot_of = lambda j: comp_table[j // blk] * blk + j % blk  # noqa: E731
    comp_cache = torch.zeros(32, formats.nvfp4_record_bytes(D), dtype=torch.uint8)
    comp_cache[comp_slot_of(torch.arange(N))] = formats.encode_nvfp4_record(_latents(N, D, g))
    K = 8
    # per-row lists: window [p-W+1, p] and the first n_vis(p) entries, -1 padded
    kp = torch.arange(end)
    win = (kp[None, :] <= pos[:, None]) & (kp[None, :] > pos[:, None] - W)
    swa_slots = torch.full((T, W), -1, dtype=torch.int32)
    comp_slots = torch.full((T, K), -1, dtype=torch.int32)
    for t in range(T):
        ps = kp[win[t]]
        swa_slots[t, : ps.numel()] = swa_slot_of(ps).int()
        comp_slots[t, : int(n_vis[t])] = comp_slot_of(torch.arange(int(n_vis[t]))).int()
    q = (2.0 * torch.randn(T, Hq, D, generator=g)).to(dtype)
    sink, inv_freq, scale = torch.randn(Hq, generator=g), _inv_freq(R), D ** -0.5

    got = sa.sparse_attn_ref(q, swa_cache, swa_slots, comp_cache, comp_slots, sink, scale, pos, inv_freq)

    # the model's formula (model_executor/model.py, Attention.forward)
    lo = int(pos.min()) - W + 1
    kpos = torch.arange(lo, end)
    keys = formats.decode_mxfp8_record(swa_cache[swa_slot_of(kpos)], D)
    mask = (kpos[None, :] <= pos[:, None]) & (kpos[None, :] > pos[:, None] - W)
    comp = formats.decode_nvfp4_record(comp_cache[comp_slot_of(torch.arange(N))], D)
    sel = torch.arange(N)[None, :] < n_vis[:, None]
    o = sparse_attention(q.float(), torch.cat((keys, comp)), torch.cat((mask, sel), 1), sink, scale)
    want = apply_rope(o, pos, inv_freq, inverse=True).to(dtype)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_ref_odd_shapes_match_per_row_oracle(dtype):
    c = odd_case(dtype)
    got = sa.sparse_attn_ref(*_args(c))
    want = per_row_oracle(c)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-3)
    torch.testing.assert_close(got, want, **tol)
    # the row with only its own key: out = k * e^l / (e^l + e^sink), rotated back
    D = 64
    k = formats.decode_mxfp8_record(c["swa_cache"][c["swa_slots"][2, 0].long()], D)
    logit = (c["q"][2].float() @ k) * c["scale"]
    w = torch.exp(logit) / (torch.exp(logit) + torch.exp(c["sink"]))
    row = apply_rope((w[:, None] * k[None, :])[None], c["positions"][2:3], c["inv_freq"], inverse=True)[0]
    torch.testing.assert_close(got[2].float(), row, **tol)


def test_ref_random_ragged_rows():
    c = random_case(7, 6, 64, 16, 13, 11, seed=5)
    torch.testing.assert_close(sa.sparse_attn_ref(*_args(c)), per_row_oracle(c), rtol=1e-5, atol=1e-6)


def test_ref_row_chunks_and_swa_only(monkeypatch):
    c = random_case(9, 4, 64, 16, 6, None, seed=7)
    want = per_row_oracle(c)
    torch.testing.assert_close(sa.sparse_attn_ref(*_args(c)), want, rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(sa, "_REF_ROW_CHUNK", 4)
    torch.testing.assert_close(sa.sparse_attn_ref(*_args(c)), want, rtol=1e-5, atol=1e-6)


def test_ref_row_without_keys_is_zero():
    c = odd_case(empty_row=True)
    out = sa.sparse_attn_ref(*_args(c))
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    torch.testing.assert_close(out, per_row_oracle(c), rtol=1e-5, atol=1e-6)
    c["swa_slots"][:] = -1  # no key in the whole batch
    c["comp_cache"] = c["comp_slots"] = None
    assert torch.equal(sa.sparse_attn_ref(*_args(c)), torch.zeros(3, 4, 64))


def test_op_dispatches_to_reference_on_cpu():
    c = odd_case(torch.bfloat16)
    assert torch.equal(torch.ops.dsv41.sparse_attn(*_args(c)), sa.sparse_attn_ref(*_args(c)))
    c["comp_cache"] = c["comp_slots"] = None
    got = torch.ops.dsv41.sparse_attn(*_args(c))
    assert got.shape == c["q"].shape and got.dtype == torch.bfloat16
    assert sa.register() is torch.ops.dsv41.sparse_attn


def test_op_fake_shapes():
    c = {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in odd_case().items()}
    out = torch.ops.dsv41.sparse_attn(*_args(c))
    assert out.device.type == "meta" and out.shape == (3, 4, 64) and out.dtype == torch.float32


def test_bad_shapes_raise():
    c = odd_case()
    c["swa_cache"] = c["swa_cache"][:, :-1]
    with pytest.raises(ValueError, match="swa_cache"):
        sa.sparse_attn_ref(*_args(c))


# --------------------------------------------------------------------------- Triton interpreter

# (name, case kwargs, config, num_splits, hw_fp8)
_INTERP_CASES = [
    ("odd-fp32-s1", dict(odd=True), dict(BLOCK_H=16, BLOCK_N=16), 1, False),
    ("odd-fp32-s2-hwfp8", dict(odd=True), dict(BLOCK_H=16, BLOCK_N=16), 2, True),
    ("odd-bf16-s1", dict(odd=True, dtype=torch.bfloat16), dict(BLOCK_H=16, BLOCK_N=16), 1, True),
    ("empty-row-s1", dict(odd=True, empty_row=True), dict(BLOCK_H=16, BLOCK_N=16), 1, False),
    ("empty-row-s2", dict(odd=True, empty_row=True), dict(BLOCK_H=16, BLOCK_N=16), 2, True),
    ("mixed-split-s2", dict(T=3, Hq=4, D=64, R=16, W=40, K=70, seed=15), dict(BLOCK_H=16, BLOCK_N=32), 2, False),
    ("ragged-H20-s1", dict(T=5, Hq=20, D=64, R=16, W=40, K=70, seed=11), dict(BLOCK_H=16, BLOCK_N=32), 1, False),
    ("ragged-H20-s3", dict(T=5, Hq=20, D=64, R=16, W=40, K=70, seed=11), dict(BLOCK_H=16, BLOCK_N=16), 3, True),
    ("swa-only-s2", dict(T=4, Hq=8, D=64, R=16, W=100, K=None, seed=12), dict(BLOCK_H=16, BLOCK_N=64), 2, False),
    ("D512-s1", dict(T=2, Hq=16, D=512, R=64, W=128, K=96, seed=13), dict(BLOCK_H=16, BLOCK_N=32), 1, True),
    ("D512-s4", dict(T=2, Hq=16, D=512, R=64, W=128, K=96, seed=13), dict(BLOCK_H=16, BLOCK_N=64), 4, False),
    ("D512-bf16-s2", dict(T=2, Hq=16, D=512, R=64, W=128, K=96, seed=14, dtype=torch.bfloat16),
     dict(BLOCK_H=16, BLOCK_N=32), 2, True),
    ("bf16-strided-q", dict(T=3, Hq=6, D=64, R=16, W=9, K=17, seed=17, dtype=torch.bfloat16, strided=True),
     dict(BLOCK_H=16, BLOCK_N=16), 1, False),
    # skip_empty (asked for at prefill sizes) on small cases: rows whose lists hold whole tiles of -1
    ("skip-empty-row-s1", dict(odd=True, empty_row=True, skip=True), dict(BLOCK_H=16, BLOCK_N=16), 1, False),
    ("skip-mixed-s2", dict(T=3, Hq=4, D=64, R=16, W=40, K=70, seed=15, skip=True), dict(BLOCK_H=16, BLOCK_N=16), 2,
     True),
    # V_SPLIT = 2: each program owns half the value pairs (logits over all of them), with and without split-KV
    ("vsplit-s1", dict(T=3, Hq=4, D=64, R=16, W=40, K=70, seed=19), dict(BLOCK_H=16, BLOCK_N=16, V_SPLIT=2), 1, False),
    ("vsplit-s3-hwfp8", dict(T=5, Hq=20, D=64, R=16, W=40, K=70, seed=20), dict(BLOCK_H=16, BLOCK_N=32, V_SPLIT=2),
     3, True),
    ("vsplit-swa-only-s2", dict(T=4, Hq=8, D=64, R=16, W=100, K=None, seed=21),
     dict(BLOCK_H=16, BLOCK_N=64, V_SPLIT=2), 2, False),
    ("vsplit-D512-bf16-s2", dict(T=2, Hq=16, D=512, R=64, W=128, K=96, seed=22, dtype=torch.bfloat16),
     dict(BLOCK_H=16, BLOCK_N=32, V_SPLIT=2), 2, True),
    # the combine merging several splits a step (VLLM_DSV41_COMBINE_CHUNK): a partial last chunk, a chunk wider than
    # the splits, an even fit
    ("combine-chunk2-H20-s3", dict(T=5, Hq=20, D=64, R=16, W=40, K=70, seed=11, chunk=2), dict(BLOCK_H=16, BLOCK_N=16),
     3, True),
    ("combine-chunk8-s5", dict(T=3, Hq=4, D=64, R=16, W=100, K=170, seed=23, chunk=8), dict(BLOCK_H=16, BLOCK_N=16), 5,
     False),
    ("combine-chunk4-D512-bf16-s4", dict(T=2, Hq=16, D=512, R=64, W=128, K=96, seed=14, dtype=torch.bfloat16, chunk=4),
     dict(BLOCK_H=16, BLOCK_N=32), 4, True),
    ("real-T1-fp32-auto", dict(T=1, Hq=64, D=512, R=64, W=128, K=512, seed=18, swa_pool=512, comp_pool=2048,
                               holes=0.02), dict(BLOCK_H=64, BLOCK_N=32), None, True),
]


def _key_decode_check() -> None:
    """Both key decoders against ``formats`` on every byte: NVFP4 records holding all 256 E2M1 pairs (both
    the hardware-E4M3 path and the bit-by-bit one) and MXFP8 records holding all 256 E4M3 codes, under
    scales from tiny to large; the halves must equal the reference's even / odd elements bit for bit."""
    import triton
    import triton.language as tl

    @triton.jit
    def decode(comp_ptr, swa8_ptr, swa16_ptr, ce_ptr, co_ptr, se_ptr, so_ptr, row_c, row_s8, row_s16,
               D: tl.constexpr, N: tl.constexpr, HW_FP8: tl.constexpr):
        n = tl.arange(0, N)
        j = tl.arange(0, D // 2)
        valid = n >= 0
        k_e, k_o = sa._nvfp4_part(comp_ptr, row_c, n.to(tl.int64), valid, 0, D // 2, D, N, HW_FP8, False)
        tl.store(ce_ptr + n[:, None] * (D // 2) + j[None, :], k_e)
        tl.store(co_ptr + n[:, None] * (D // 2) + j[None, :], k_o)
        k_e, k_o = sa._mxfp8_part(swa8_ptr, swa16_ptr, row_s8, row_s16, n.to(tl.int64), valid, 0, D // 2, D, N,
                                   HW_FP8, False)
        tl.store(se_ptr + n[:, None] * (D // 2) + j[None, :], k_e)
        tl.store(so_ptr + n[:, None] * (D // 2) + j[None, :], k_o)

    D, N = 512, 16
    comp = torch.zeros(N, formats.nvfp4_record_bytes(D), dtype=torch.uint8)
    comp[:, :D // 2] = torch.arange(256, dtype=torch.uint8).repeat(N, 1)       # every (even, odd) code pair
    comp[:, D // 2:] = torch.randint(0, 127, (N, D // 16), dtype=torch.uint8)  # positive E4M3 scales (0x7f: NaN)
    comp[:, D // 2] = torch.arange(N, dtype=torch.uint8)                       # subnormal scales too
    swa = torch.zeros(N, formats.mxfp8_record_bytes(D), dtype=torch.uint8)
    codes = torch.arange(256, dtype=torch.int32)
    codes = codes[(codes & 127) != 127]                                          # E4M3 NaN codes are never written
    swa[:, :D] = codes.repeat(3)[:D].to(torch.uint8).repeat(N, 1).roll(7, 1)
    swa[:, D:] = torch.randint(100, 150, (N, D // 32), dtype=torch.uint8)
    want_c = formats.decode_nvfp4_record(comp, D)
    want_s = formats.decode_mxfp8_record(swa, D)
    for hw in (True, False):
        out = [torch.empty(N, D // 2) for _ in range(4)]
        decode[(1,)](comp, swa, swa.view(torch.int16), *out, comp.stride(0), swa.stride(0), swa.stride(0) // 2,
                     D=D, N=N, HW_FP8=hw)
        for got, want, what in ((out[0], want_c[:, 0::2], "nvfp4 even"), (out[1], want_c[:, 1::2], "nvfp4 odd"),
                                (out[2], want_s[:, 0::2], "mxfp8 even"), (out[3], want_s[:, 1::2], "mxfp8 odd")):
            assert torch.equal(got, want), f"{what} keys (hw_fp8={hw}) differ from formats' decode"


def _interpreter_main() -> int:
    """Run every interpreter case; one line each; exit status 1 on any failure."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 before Python starts"
    failed = 0
    try:
        _key_decode_check()
        print("  ok key decode (every NVFP4 pair and E4M3 code, both paths)")
    except AssertionError as e:
        failed += 1
        print(f"FAIL key decode: {e}")
    for name, kw, cfg, splits, hw in _INTERP_CASES:
        kw = dict(kw)
        strided = kw.pop("strided", False)
        skip = kw.pop("skip", False)
        os.environ[sa.COMBINE_CHUNK_ENV] = str(kw.pop("chunk", 1))
        c = odd_case(kw.get("dtype", torch.float32), empty_row=kw.get("empty_row", False)) \
            if kw.pop("odd", False) else random_case(**kw)
        if strided:  # q as a view with odd strides (no paired 32-bit access)
            T, H, D = c["q"].shape
            c["q"] = torch.cat((c["q"], c["q"][..., :1]), -1)[..., :D]
            assert c["q"].stride(1) % 2
        t0 = time.perf_counter()
        got = sa._sparse_attn_triton(*_args(c), skip, num_splits=splits, config=dict(cfg, num_warps=4), hw_fp8=hw)
        dt = time.perf_counter() - t0
        ref = sa.sparse_attn_ref(*_args(c))
        fp32 = c["q"].dtype == torch.float32
        try:
            if skip:  # a skipped tile of -1 would have added exact zeros: the same bits as the full walk
                full = sa._sparse_attn_triton(*_args(c), False, num_splits=splits, config=dict(cfg, num_warps=4),
                                              hw_fp8=hw)
                assert torch.equal(got, full), "skip_empty changed the result"
            assert got.dtype == ref.dtype and got.shape == ref.shape
            assert_close(name, ref, got, ratio=2e-6 if fp32 else 1e-2)
            if fp32:
                torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
            print(f"  ok {name} ({dt:.1f} s)")
        except AssertionError as e:
            failed += 1
            print(f"FAIL {name}: {e}")
    return 1 if failed else 0


def test_triton_interpreter():
    run_under_interpreter(["-m", "tests.ops.test_sparse_attn", "--interpret"])


# --------------------------------------------------------------------------- CUDA, real sizes

REAL = dict(Hq=64, D=512, R=64, W=128, K=512)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8, 64, 512])
def test_cuda_real_sizes_bf16(T):
    c = random_case(T, **REAL, seed=100 + T, dtype=torch.bfloat16, swa_pool=4096, comp_pool=16384,
                    holes=0.02, device="cuda")
    got = torch.ops.dsv41.sparse_attn(*_args(c))
    ref = sa.sparse_attn_ref(*_args(c))
    assert_close(f"T={T} bf16", ref, got, ratio=1e-2)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("T", [16, 64])
def test_cuda_real_sizes_fp32_default_config(T):
    """fp32 q through the op's default config: the 64-head, 64-key, 2-stage tile needs 313 KB of shared
    memory in fp32 under Triton 3.7 (the H200 has 227 KB), so ``launch_fitting`` must step down."""
    c = random_case(T, **REAL, seed=200 + T, dtype=torch.float32, swa_pool=4096, comp_pool=16384,
                    holes=0.02, device="cuda")
    got = torch.ops.dsv41.sparse_attn(*_args(c))
    assert_close(f"T={T} fp32", sa.sparse_attn_ref(*_args(c)), got, ratio=1e-4)


_GPU_CFGS = {
    "h64n32s1": dict(BLOCK_H=64, BLOCK_N=32, num_warps=8, num_stages=1),   # warp-group MMA
    "h32n32s2": dict(BLOCK_H=32, BLOCK_N=32, num_warps=8, num_stages=2),   # mma.sync
    "h16n32s2": dict(BLOCK_H=16, BLOCK_N=32, num_warps=4, num_stages=2),
    "h64n32s2v2": dict(BLOCK_H=64, BLOCK_N=32, num_warps=8, num_stages=2, V_SPLIT=2),   # half the values a program
    "h64n64s2v2": dict(BLOCK_H=64, BLOCK_N=64, num_warps=8, num_stages=2, V_SPLIT=2),
    "h16n64s2v2": dict(BLOCK_H=16, BLOCK_N=64, num_warps=8, num_stages=2, V_SPLIT=2),
}


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("chunk", ["1", "8"])
@pytest.mark.parametrize("T,splits", [(1, None), (1, 10), (8, 3)])
def test_cuda_combine_chunk(T, splits, chunk, monkeypatch):
    """The combine merging 8 splits a step gives the reference's output as the one-a-step form does (fp32, tight)."""
    monkeypatch.setenv(sa.COMBINE_CHUNK_ENV, chunk)
    c = random_case(T, **REAL, seed=8, dtype=torch.float32, swa_pool=2048, comp_pool=4096, device="cuda")
    got = sa._sparse_attn_triton(*_args(c), num_splits=splits)
    assert_close(f"fp32 T={T} splits={splits} chunk={chunk}", sa.sparse_attn_ref(*_args(c)), got, ratio=1e-5)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 3, 10])
@pytest.mark.parametrize("cfg", list(_GPU_CFGS))
def test_cuda_bf16_configs_and_splits(cfg, splits):
    c = random_case(8, **REAL, seed=6, dtype=torch.bfloat16, swa_pool=2048, comp_pool=4096, device="cuda")
    got = sa._sparse_attn_triton(*_args(c), num_splits=splits, config=_GPU_CFGS[cfg])
    assert_close(f"bf16 {cfg} splits={splits}", sa.sparse_attn_ref(*_args(c)), got, ratio=1e-2)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("cfg", [dict(BLOCK_H=16, BLOCK_N=16, num_warps=4), dict(BLOCK_H=16, BLOCK_N=32, num_warps=8)],
                         ids=["h16n16", "h16n32"])
def test_cuda_fp32_tight(cfg, splits):
    """fp32 q: every dot in fp32 ("ieee"), so the kernel must match the reference to rounding."""
    c = random_case(8, **REAL, seed=7, dtype=torch.float32, swa_pool=2048, comp_pool=4096, device="cuda")
    got = sa._sparse_attn_triton(*_args(c), num_splits=splits, config=cfg)
    ref = sa.sparse_attn_ref(*_args(c))
    assert_close(f"fp32 splits={splits}", ref, got, ratio=1e-5)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("hw_fp8", [True, False], ids=["cvt", "bits"])
def test_cuda_tp8_heads_and_swa_only(hw_fp8):
    c = random_case(16, Hq=8, D=512, R=64, W=128, K=None, seed=9, dtype=torch.bfloat16, device="cuda")
    got = sa._sparse_attn_triton(*_args(c), hw_fp8=hw_fp8)
    assert_close("Hq=8 SWA-only", sa.sparse_attn_ref(*_args(c)), got, ratio=1e-2)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_tiny_model_shapes(dtype):
    """The tiny preset (D=64, R=16): unaligned 66/36-byte records, few heads, odd lists."""
    c = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in odd_case(dtype).items()}
    got = torch.ops.dsv41.sparse_attn(*_args(c))
    ref = sa.sparse_attn_ref(*_args(c))
    assert_close(f"tiny {dtype}", ref, got, ratio=1e-5 if dtype == torch.float32 else 1e-2)
    c = random_case(37, 4, 64, 16, 33, 70, seed=21, dtype=dtype, device="cuda")
    assert_close(f"tiny ragged {dtype}", sa.sparse_attn_ref(*_args(c)), torch.ops.dsv41.sparse_attn(*_args(c)),
                 ratio=1e-5 if dtype == torch.float32 else 1e-2)


if __name__ == "__main__" and "--interpret" in sys.argv:
    sys.exit(_interpreter_main())


class OutOfResources(Exception):
    """Stands in for ``triton.runtime.errors.OutOfResources`` (``launch_fitting`` matches it by name)."""


def test_launch_fitting_steps_down_and_remembers(caplog):
    """A config over the GPU's shared memory is skipped for the next smaller one (with a warning), the
    winner is reused for the same key without retrying, other errors pass through, and when nothing fits
    the error names the op and every config tried."""
    from vllm_dsv41.ops import _triton
    from vllm_dsv41.ops.sparse_attn import default_config, smaller_configs

    wanted = default_config(64, 64)
    configs = smaller_configs(wanted)
    assert configs[0] == wanted and len(configs) == len({tuple(sorted(c.items())) for c in configs}) >= 3
    assert all(c["num_stages"] == 1 for c in configs[1:-1]) and configs[-1]["BLOCK_H"] == 16

    tried = []

    def launch(cfg):  # only 32-key tiles and smaller "fit"
        tried.append(cfg)
        if cfg["BLOCK_N"] > 32:
            raise OutOfResources("shared memory, Required: 313088, Hardware limit: 232448")

    key = ("test", len(tried))
    _triton._FITTED.pop(("sparse_attn", key), None)
    _triton.launch_fitting("sparse_attn", launch, configs, key)
    assert [c["BLOCK_N"] for c in tried] == [64, 64, 32] and "does not fit" in caplog.text
    tried.clear()
    _triton.launch_fitting("sparse_attn", launch, configs, key)
    assert [c["BLOCK_N"] for c in tried] == [32]

    def broken(cfg):
        raise ValueError("not a resource problem")

    with pytest.raises(ValueError, match="not a resource problem"):
        _triton.launch_fitting("sparse_attn", broken, configs, ("test", "broken"))

    def never(cfg):
        raise OutOfResources("shared memory")

    with pytest.raises(RuntimeError, match="sparse_attn: no launch config fits"):
        _triton.launch_fitting("sparse_attn", never, configs, ("test", "never"))


def _sm90_sparse_attn(dtype: torch.dtype, cfg: dict) -> dict:
    """``_sparse_attn_kernel`` at the production shape (D 512, R 64, both key sources, aligned records) built for
    sm_90 with ``cfg`` = {BLOCK_H, BLOCK_N, num_warps, num_stages}."""
    from vllm_dsv41.ops import sparse_attn as sa

    qt = "*bf16" if dtype == torch.bfloat16 else "*fp32"
    ptrs = {"q_ptr": qt, "swa8_ptr": "*u8", "swa16_ptr": "*i16", "swa_slot_ptr": "*i64", "comp8_ptr": "*u8",
            "comp_slot_ptr": "*i64", "sink_ptr": "*fp32", "pos_ptr": "*i64", "inv_freq_ptr": "*fp32", "out_ptr": qt,
            "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "qk_scale": "fp32"}
    consts = {"D": 512, "R": 64, "BLOCK_H": cfg["BLOCK_H"], "BLOCK_N": cfg["BLOCK_N"], "HAS_COMP": True, "HW_FP8": True,
              "DOT_PREC": "tf32" if dtype == torch.bfloat16 else "ieee", "P_BF16": dtype == torch.bfloat16,
              "DOT_F32": dtype == torch.float32, "SWA_ALIGNED": True, "COMP_ALIGNED": True,
              "PAIR_IO": dtype == torch.bfloat16, "SKIP_EMPTY": False, "V_SPLIT": cfg.get("V_SPLIT", 1)}
    kernel = sa._sparse_attn_kernel
    sig = {name: ptrs.get(name, "constexpr" if name in consts else "i32") for name in kernel.arg_names}
    return sm90_build(kernel, sig, consts, cfg["num_warps"], cfg["num_stages"])


@pytest.mark.parametrize("T", [1, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_default_config_fits_sm90_shared_memory(T, dtype):
    """Without a GPU: the pinned launch config (bf16 queries, the fast path) fits an H200's shared memory as it is;
    with fp32 queries one of the step-downs ``launch_fitting`` tries does (the first run on an H200 failed every
    request with fp32 queries on the 64-head tile: 313,088 bytes needed, 232,448 available)."""
    from vllm_dsv41.ops import sparse_attn as sa

    tried = []
    for cfg in sa.smaller_configs(sa.default_config(T, 64)):
        got = _sm90_sparse_attn(dtype, cfg)
        tried.append((cfg, got))
        if got["shared"] <= SM90_SHARED_LIMIT:
            break
    for cfg, got in tried:
        print(f"sparse_attn {dtype} T={T} {cfg}: {got}")
    fits = [cfg for cfg, got in tried if got["shared"] <= SM90_SHARED_LIMIT]
    assert fits, "no config of the step-down list fits"
    if dtype == torch.bfloat16:
        assert len(tried) == 1, "the pinned bf16 config itself must fit"


@pytest.mark.parametrize("bh,chunk", [(2, 1), (2, 4), (4, 2), (1, 8)])
def test_combine_builds_for_sm90_without_spills(bh, chunk):
    """The split-KV combine at the batch-1 tile (2 heads a program) merging one split a step or 4 at once
    (``VLLM_DSV41_COMBINE_CHUNK``), and the other (heads, chunk) pairs the launcher's cap of 8 allows, compiles for
    Hopper with no spill (2 x 8 spills 32 bytes a thread)."""
    from vllm_dsv41.ops import sparse_attn as sa

    sig = {"part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "sink_ptr": "*fp32", "pos_ptr": "*i64",
           "inv_freq_ptr": "*fp32", "out_ptr": "*bf16", "Hq": "i32", "NUM_SPLITS": "i32", "stride_ot": "i32",
           "stride_oh": "i32", **{n: "constexpr" for n in ("D", "R", "BLOCK_H", "PAIR_IO", "S_CHUNK")}}
    got = sm90_build(sa._sparse_attn_combine_kernel, sig,
                     {"D": 512, "R": 64, "BLOCK_H": bh, "PAIR_IO": True, "S_CHUNK": chunk}, 4, 3)
    print(f"combine BLOCK_H={bh} S_CHUNK={chunk}: {got}")
    assert got["stack"] == 0 and got["regs"] <= 255


def test_combine_chunk_switch():
    """``VLLM_DSV41_COMBINE_CHUNK``: 1 by default, powers of two to 16, anything else named."""
    from vllm_dsv41.ops import sparse_attn as sa

    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(sa.COMBINE_CHUNK_ENV, raising=False)
        assert sa.combine_chunk() == 1
        mp.setenv(sa.COMBINE_CHUNK_ENV, "8")
        assert sa.combine_chunk() == 8
        mp.setenv(sa.COMBINE_CHUNK_ENV, "3")
        with pytest.raises(ValueError, match="VLLM_DSV41_COMBINE_CHUNK"):
            sa.combine_chunk()


def test_skip_empty_pays_only_for_short_prefills():
    """The hint is asked for from SKIP_EMPTY_MIN_ROWS rows while the largest position stays below twice the
    context at which the top-k lists fill (the bench config: 2 x 2 x 512); never for decode-sized steps."""
    from vllm_dsv41.config import parse_config
    from vllm_dsv41.presets import BENCH, QUANTIZATION_CONFIG

    text = dict(BENCH, vocab_size=129280, engram_layer_ids=[])
    fill = parse_config({"text_config": text, "quantization_config": QUANTIZATION_CONFIG}).topk_fill_context
    assert fill == 1024
    rows = sa.SKIP_EMPTY_MIN_ROWS
    assert sa.skip_empty_pays(rows, 2 * fill - 1, fill)
    assert not sa.skip_empty_pays(rows, 2 * fill, fill)
    assert not sa.skip_empty_pays(rows - 1, 0, fill)
    assert not sa.skip_empty_pays(rows, -1, fill)  # an empty step
