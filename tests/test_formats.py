"""Tests for vllm_dsv41.formats: known bytes, round trips, error bounds, shapes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from vllm_dsv41 import formats as F

E4M3 = torch.float8_e4m3fn
E8M0 = torch.float8_e8m0fnu


def _bytes(t: torch.Tensor) -> list[int]:
    return F.as_uint8(t).flatten().tolist()


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _random_e4m3(shape, gen) -> torch.Tensor:
    """Random finite E4M3 values (NaN bytes 0x7F/0xFF replaced by 0)."""
    b = torch.randint(0, 256, shape, generator=gen, dtype=torch.int32).to(torch.uint8)
    b = torch.where((b & 0x7F) == 0x7F, torch.zeros_like(b), b)
    return b.view(E4M3)


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise-equal float32 tensors (distinguishes -0.0, treats NaN==NaN)."""
    return torch.equal(a.float().view(torch.int32), b.float().view(torch.int32))


# ----------------------------------------------------------------------------
# Scalar codecs
# ----------------------------------------------------------------------------

def test_e2m1_table():
    assert F.E2M1_VALUES.dtype == torch.float32 and F.E2M1_VALUES.shape == (16,)
    expect = [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert F.E2M1_VALUES[:8].tolist() == expect
    assert F.E2M1_VALUES[8:].tolist() == [-v for v in expect]
    assert torch.signbit(F.E2M1_VALUES[8:]).all() and not torch.signbit(F.E2M1_VALUES[:8]).any()


def test_e2m1_encode_known_vector():
    x = torch.tensor([0, 0.25, 0.75, 1.25, 2.5, 5, 7, -3])
    # ties to the even code: 0.25->0, 0.75->1.0 (code 2), 1.25->1.0, 2.5->2.0 (code 4), 5->4 (code 6)
    assert F.e2m1_encode(x).tolist() == [0, 0, 2, 2, 4, 6, 7, 13]
    y = torch.tensor([1.75, 3.5, -0.25, -0.0, 0.1, -0.1, 100.0, -1e30, 0.26, 4.99, 5.01, float("inf")])
    assert F.e2m1_encode(y).tolist() == [4, 6, 8, 8, 0, 8, 7, 15, 1, 6, 7, 7]
    assert F.e2m1_encode(torch.tensor([float("nan")])).tolist() == [0]
    assert F.e2m1_encode(x).dtype == torch.uint8


def test_e2m1_encode_matches_brute_force():
    mags = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=np.float64)
    mids = (mags[1:] + mags[:-1]) / 2
    rng = np.random.default_rng(0)
    a = np.concatenate([mags, mids, np.nextafter(mids, 0), np.nextafter(mids, 10),
                        rng.uniform(0, 8, 4000)]).astype(np.float32)
    x = np.concatenate([a, -a])
    d = np.abs(np.abs(x.astype(np.float64))[:, None] - mags[None, :])
    best = d.min(axis=1, keepdims=True)
    cand = np.where(d == best, np.arange(8)[None, :], 99)
    # among equidistant candidates choose the even code
    even = np.where(cand % 2 == 0, cand, 99).min(axis=1)
    mag_code = np.where(even < 99, even, cand.min(axis=1))
    expect = mag_code + 8 * np.signbit(x)
    got = F.e2m1_encode(torch.from_numpy(x)).numpy()
    np.testing.assert_array_equal(got, expect)


def test_e2m1_round_trip_all_codes():
    codes = torch.arange(16, dtype=torch.uint8)
    vals = F.e2m1_decode(codes)
    assert _same_values(vals, F.E2M1_VALUES)
    assert torch.equal(F.e2m1_encode(vals), codes)
    # only the low nibble is read
    assert _same_values(F.e2m1_decode(codes | 0xF0), F.E2M1_VALUES)


def test_pack_unpack_nibbles():
    codes = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    assert F.pack_nibbles(codes).tolist() == [0x21, 0x43]
    assert F.unpack_nibbles(torch.tensor([0x21, 0x43, 0xF0], dtype=torch.uint8)).tolist() == [1, 2, 3, 4, 0, 15]
    # int8 storage (checkpoint experts) unpacks like its bytes
    assert F.unpack_nibbles(torch.tensor([-1, 0x7A], dtype=torch.int8)).tolist() == [15, 15, 10, 7]
    c = torch.randint(0, 16, (2, 3, 10), generator=_gen(), dtype=torch.int32).to(torch.uint8)
    p = F.pack_nibbles(c)
    assert p.shape == (2, 3, 5) and p.dtype == torch.uint8
    assert torch.equal(F.unpack_nibbles(p), c)
    with pytest.raises(ValueError):
        F.pack_nibbles(torch.zeros(3, dtype=torch.uint8))


def test_e8m0_to_float_known_and_vs_torch():
    e = torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8)
    got = F.e8m0_to_float(e)
    assert got.dtype == torch.float32
    assert got[:6].tolist() == [2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127]
    assert math.isnan(got[6])
    allb = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    a = F.e8m0_to_float(allb)
    b = F.e8m0_to_float(allb.view(E8M0))
    assert _same_values(a, b)
    # torch's own decoder (its NaN payload differs, so compare NaN-aware)
    assert torch.equal(a[:255], allb[:255].view(E8M0).to(torch.float32))
    assert torch.isnan(allb[255:].view(E8M0).to(torch.float32)).all()
    assert _same_values(a[:255], torch.tensor([2.0**(i - 127) for i in range(255)]))


def test_float_to_e8m0_exponent():
    allb = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    assert torch.equal(F.float_to_e8m0_exponent(F.e8m0_to_float(allb)), allb)
    x = torch.tensor([1.0, 0.5, 2.0**-126, 2.0**-127, 2.0**100, 3.0])
    assert F.float_to_e8m0_exponent(x).tolist() == [127, 126, 1, 0, 227, 128]
    assert F.float_to_e8m0_exponent(x).dtype == torch.uint8


def test_bit_views_not_casts():
    u = torch.tensor([1, 127, 200], dtype=torch.uint8)
    e = F.as_e8m0(u)
    assert e.dtype == E8M0
    assert e.to(torch.float32).tolist() == [2.0**-126, 1.0, 2.0**73]
    assert F.as_uint8(e).tolist() == [1, 127, 200]
    assert F.as_uint8(e).data_ptr() == u.data_ptr()  # a view
    assert F.as_e8m0(e) is e and F.as_uint8(u) is u
    # a numeric cast would have given different bytes
    assert _bytes(torch.tensor([1.0, 127.0]).to(E8M0)) != [1, 127]
    assert F.as_uint8(torch.tensor([-1], dtype=torch.int8)).tolist() == [255]
    assert F.as_uint8(torch.tensor([1.0]).to(E4M3)).tolist() == [0x38]
    with pytest.raises(TypeError):
        F.as_e8m0(torch.zeros(2))
    with pytest.raises(TypeError):
        F.as_uint8(torch.zeros(2, dtype=torch.int32))


def test_torch_e4m3_rounding_is_rne():
    x = torch.tensor([1.0625, 1.1875, 2.0**-10, 1.5 * 2.0**-10, -0.0, 448.0, 240.0, 232.0])
    assert _bytes(x.to(E4M3)) == [0x38, 0x3A, 0x00, 0x01, 0x80, 0x7E, 0x77, 0x76]
    assert _bytes(F._to_e4m3(torch.tensor([1000.0, -1e30]))) == [0x7E, 0xFE]


# ----------------------------------------------------------------------------
# Dense FP8 (32x32 tiles)
# ----------------------------------------------------------------------------

def test_quant_fp8_block_known_scales():
    w = torch.zeros(64, 96)
    w[0, 0] = 448.0       # tile (0,0): ratio 1 -> exponent 0 -> byte 127
    w[0, 32] = 449.0      # tile (0,1): just above -> byte 128
    w[32, 0] = -224.0     # tile (1,0): ratio 0.5 -> byte 126
    w[33, 33] = 1.0       # tile (1,1): 1/448 -> ceil(-8.8) = -8 -> byte 119
    q, s = F.quant_fp8_block(w)
    assert q.dtype == E4M3 and q.shape == (64, 96)
    assert s.dtype == E8M0 and s.shape == (2, 3)
    assert F.as_uint8(s).tolist() == [[127, 128, 1], [126, 119, 1]]  # zero tiles -> 2**-126
    assert _bytes(q[0, 0:1]) == [0x7E] and _bytes(q[33, 33:34]) == [0x78]  # 1/2**-8 = 256
    assert _same_values(F.dequant_fp8_block(q, s)[:, :32], w[:, :32])


def test_fp8_block_partial_tiles():
    gen = _gen(1)
    rows, cols = 40, 70  # 2 x 3 tiles, last row/column tile partial
    q = _random_e4m3((rows, cols), gen)
    s = torch.randint(100, 140, (2, 3), generator=gen, dtype=torch.int32).to(torch.uint8)
    out = F.dequant_fp8_block(q, s)
    ref = torch.empty(rows, cols)
    for i in range(rows):
        for j in range(cols):
            ref[i, j] = float(q[i, j].float()) * 2.0 ** (int(s[i // 32, j // 32]) - 127)
    assert _same_values(out, ref)
    assert _same_values(F.dequant_fp8_block(q, F.as_e8m0(s)), out)
    assert _same_values(F.dequant_fp8_block(q.view(torch.uint8), s), out)
    assert F.dequant_fp8_block(q, s, dtype=torch.bfloat16).dtype == torch.bfloat16
    # quant of partial tiles: edge tiles use only their own elements
    w = torch.full((40, 70), 0.001)
    w[0, 0] = 100.0
    w[39, 69] = 3.0
    _, sq = F.quant_fp8_block(w)
    assert F.as_uint8(sq).tolist() == [[125, 109, 109], [109, 109, 120]]
    with pytest.raises(ValueError):
        F.dequant_fp8_block(q, torch.zeros(2, 2, dtype=torch.uint8))
    with pytest.raises(ValueError):
        F.quant_fp8_block(torch.zeros(2, 32, 32))


def test_fp8_block_error_bound_and_idempotence():
    gen = _gen(2)
    w = torch.randn(96, 80, generator=gen) * torch.logspace(-3, 3, 80)
    q, s = F.quant_fp8_block(w)
    dq = F.dequant_fp8_block(q, s)
    sc = F._expand_tiles(F.e8m0_to_float(s), 32, 96, 80)
    assert ((w - dq).abs() <= torch.maximum(w.abs() * 2.0**-4, sc * 2.0**-10)).all()
    q2, s2 = F.quant_fp8_block(dq)
    assert _same_values(F.dequant_fp8_block(q2, s2), dq)


def test_fp8_block_exact_when_representable():
    gen = _gen(3)
    q = _random_e4m3((64, 64), gen)
    q[::32, ::32] = torch.tensor(448.0).to(E4M3)  # every tile's amax is 448 * scale
    s = torch.randint(110, 140, (2, 2), generator=gen, dtype=torch.int32).to(torch.uint8)
    w = F.dequant_fp8_block(q, s)
    q2, s2 = F.quant_fp8_block(w)
    assert _bytes(q2) == _bytes(q) and _bytes(s2) == _bytes(s)


# ----------------------------------------------------------------------------
# MXFP4 routed experts
# ----------------------------------------------------------------------------

def test_quant_mxfp4_known():
    w = torch.zeros(2, 64)
    w[0, :4] = torch.tensor([6.0, -0.5, 1.0, 2.5])  # amax 6 -> exponent byte 127
    w[0, 32] = 3.0                                  # amax 3 -> 2**-1, byte 126
    w[1, 0] = 6.0001                                # just above 6 -> byte 128
    p, s = F.quant_mxfp4(w)
    assert p.dtype == torch.int8 and p.shape == (2, 32)
    assert s.dtype == E8M0 and s.shape == (2, 2)
    assert F.as_uint8(s).tolist() == [[127, 126], [128, 1]]  # zero block -> 2**-126
    assert _bytes(p[0, :2]) == [0x97, 0x42]  # codes 7 | 9<<4, 2 | 4<<4 (2.5 ties to 2)
    assert _bytes(p[0, 16:17]) == [0x07]     # 3 / 0.5 = 6
    d = F.dequant_mxfp4(p, s)
    assert d[0, :4].tolist() == [6.0, -0.5, 1.0, 2.0] and d[1, 0].item() == 6.0


def test_mxfp4_exact_error_bound_batch():
    gen = _gen(4)
    codes = torch.randint(0, 16, (3, 8, 64), generator=gen, dtype=torch.int32).to(torch.uint8)
    codes[..., ::32] = 15  # -6 in every block -> scale reproduced
    s = torch.randint(100, 150, (3, 8, 2), generator=gen, dtype=torch.int32).to(torch.uint8)
    p = F.pack_nibbles(codes).view(torch.int8)
    w = F.dequant_mxfp4(p, F.as_e8m0(s))
    assert w.shape == (3, 8, 64) and w.dtype == torch.float32
    p2, s2 = F.quant_mxfp4(w)
    assert _bytes(p2) == _bytes(p) and _bytes(s2) == _bytes(s)
    # error bound: |err| <= max(|x|, scale) / 4
    x = torch.randn(16, 128, generator=gen) * torch.logspace(-2, 2, 128)
    p, s = F.quant_mxfp4(x)
    dq = F.dequant_mxfp4(p, s, dtype=torch.float32)
    sc = F.e8m0_to_float(s).repeat_interleave(32, dim=-1)
    assert ((x - dq).abs() <= torch.maximum(x.abs(), sc) / 4).all()
    assert F.dequant_mxfp4(p, s, dtype=torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError):
        F.quant_mxfp4(torch.zeros(4, 48))
    with pytest.raises(ValueError):
        F.dequant_mxfp4(p, s[:, :1])


# ----------------------------------------------------------------------------
# Engram FP8 rows
# ----------------------------------------------------------------------------

def test_fp8_rowblock():
    x = torch.zeros(3, 64)
    x[0, 0] = 448.0
    x[0, 40] = -1.0
    x[2, 5] = 0.75
    q, s = F.quant_fp8_rowblock(x)
    assert q.dtype == E4M3 and q.shape == (3, 64) and s.dtype == E8M0 and s.shape == (3, 2)
    assert F.as_uint8(s).tolist() == [[127, 119], [1, 1], [118, 1]]
    assert _same_values(F.dequant_fp8_rowblock(q, s), x)
    gen = _gen(5)
    y = torch.randn(4, 5, 256, generator=gen).to(torch.bfloat16)
    q, s = F.quant_fp8_rowblock(y)
    assert q.shape == (4, 5, 256) and s.shape == (4, 5, 8)
    d = F.dequant_fp8_rowblock(q, F.as_uint8(s), dtype=torch.bfloat16)
    assert d.dtype == torch.bfloat16 and d.shape == y.shape
    sc = F.e8m0_to_float(s).repeat_interleave(32, dim=-1)
    yf = y.float()
    assert ((yf - d.float()).abs() <= torch.maximum(yf.abs() * 2.0**-4, sc * 2.0**-10)).all()
    q16, s16 = F.quant_fp8_rowblock(y, block=16)
    assert s16.shape == (4, 5, 16)
    assert F.dequant_fp8_rowblock(q16, s16, block=16).shape == (4, 5, 256)


# ----------------------------------------------------------------------------
# KV-cache records
# ----------------------------------------------------------------------------

def test_record_sizes():
    assert F.nvfp4_record_bytes(512) == 288
    assert F.mxfp8_record_bytes(512) == 528
    assert F.mxfp4_record_bytes(128) == 68
    for fn in (F.mxfp8_record_bytes, F.mxfp4_record_bytes):
        with pytest.raises(ValueError):
            fn(48)
    with pytest.raises(ValueError):
        F.nvfp4_record_bytes(40)


def test_nvfp4_record_layout():
    x = torch.zeros(32)
    x[0], x[1], x[2] = 1.0, -0.5, 6.0   # group 0: amax 6 -> scale 1.0 (E4M3 0x38)
    x[16], x[17] = 3.0, -0.75           # group 1: amax 3 -> scale 0.5 (E4M3 0x30)
    rec = F.encode_nvfp4_record(x)
    assert rec.dtype == torch.uint8 and rec.shape == (18,)
    b = rec.tolist()
    assert b[0] == 0x92            # element 0 code 2 (low), element 1 code 9 (high)
    assert b[1] == 0x07            # 6.0 -> code 7, then 0
    assert b[2:8] == [0] * 6
    assert b[8] == 0xB7            # 3/0.5 = 6 -> 7 ; -0.75/0.5 = -1.5 -> 11
    assert b[9:16] == [0] * 7
    assert b[16:] == [0x38, 0x30]  # scales start at offset D/2
    d = F.decode_nvfp4_record(rec, 32)
    assert d.tolist()[:3] == [1.0, -0.5, 6.0] and d[16].item() == 3.0 and d[17].item() == -0.75


def test_nvfp4_scale_clamps():
    x = torch.zeros(2, 16)
    x[0, 0] = 1e-6           # amax/6 below 2**-9 -> scale 2**-9 (byte 0x01)
    x[1, 0] = 1e5            # amax/6 above 448 -> scale 448 (0x7E), value saturates to 6*448
    rec = F.encode_nvfp4_record(x)
    assert rec[:, 8].tolist() == [0x01, 0x7E]
    d = F.decode_nvfp4_record(rec, 16)
    assert d[0, 0].item() == 0.0 and d[1, 0].item() == 6 * 448.0


def test_nvfp4_exact_bytes_and_error_bound():
    gen = _gen(6)
    D = 512
    codes = torch.randint(0, 16, (5, D), generator=gen, dtype=torch.int32).to(torch.uint8)
    codes[:, ::16] = 7  # +6 in every group
    # normal E4M3 scales in [2**-6, 448]
    sb = torch.randint(0x08, 0x7F, (5, D // 16), generator=gen, dtype=torch.int32).to(torch.uint8)
    rec = torch.cat((F.pack_nibbles(codes), sb), dim=-1)
    x = F.decode_nvfp4_record(rec, D)
    assert torch.signbit(x[codes == 8]).all()
    assert torch.equal(F.encode_nvfp4_record(x), rec)  # exact, incl. -0 codes
    # error bound on random data whose group scales are normal E4M3
    y = torch.randn(64, D, generator=gen) * torch.logspace(-0.5, 1.5, 64)[:, None]
    r = F.encode_nvfp4_record(y)
    d = F.decode_nvfp4_record(r, D)
    sc = r[:, D // 2:].view(E4M3).float()
    assert (sc >= 2.0**-6).all()
    sc = sc.repeat_interleave(16, dim=-1)
    assert ((y - d).abs() <= torch.maximum(y.abs(), sc) / 4 * (1 + 1e-6)).all()
    assert torch.equal(F.encode_nvfp4_record(d), r)  # byte idempotent in the normal range


def test_mxfp8_record_layout():
    x = torch.zeros(64)
    x[0], x[1], x[2] = 448.0, 1.0, -2.0  # block 0: amax 448 -> exponent 0 (byte 127)
    rec = F.encode_mxfp8_record(x)
    assert rec.dtype == torch.uint8 and rec.shape == (66,)
    assert rec[:3].tolist() == [0x7E, 0x38, 0xC0]
    assert rec[64:].tolist() == [127, 105]  # zero block: ceil(log2(1e-4/448)) = -22
    assert F.decode_mxfp8_record(rec, 64)[:3].tolist() == [448.0, 1.0, -2.0]
    y = torch.zeros(32)
    y[3] = 1.0  # amax 1 -> exponent -8 (byte 119), 1 * 2**8 = 256 -> 0x78
    r = F.encode_mxfp8_record(y)
    assert r[3].item() == 0x78 and r[32].item() == 119


def test_mxfp8_exponent_matches_float64_formula_and_bound():
    gen = _gen(7)
    D = 512
    x = torch.randn(64, D, generator=gen) * torch.logspace(-6, 4, 64)[:, None]
    rec = F.encode_mxfp8_record(x)
    amax = x.reshape(64, 16, 32).abs().amax(-1).double()
    expect = torch.ceil(torch.log2(amax.clamp_min(1e-4) / 448)) + 127
    assert rec[:, D:].long().tolist() == expect.long().tolist()
    d = F.decode_mxfp8_record(rec, D)
    sc = F.e8m0_to_float(rec[:, D:]).repeat_interleave(32, dim=-1)
    err = (x - d).abs()
    assert (err <= torch.maximum(x.abs() * 2.0**-4, sc * 2.0**-10)).all()
    assert (err.reshape(64, 16, 32).amax(-1) <= amax.float() * 2.0**-4).all()


def test_mxfp8_exact_bytes():
    gen = _gen(8)
    q = _random_e4m3((4, 128), gen)
    q[:, ::32] = torch.tensor(-240.0).to(E4M3)  # block amax in (224, 448] * scale
    sb = torch.randint(110, 160, (4, 4), generator=gen, dtype=torch.int32).to(torch.uint8)
    rec = torch.cat((q.view(torch.uint8), sb), dim=-1)
    x = F.decode_mxfp8_record(rec, 128)
    assert torch.equal(F.encode_mxfp8_record(x), rec)


def test_mxfp4_record_layout_and_bound():
    x = torch.zeros(128)
    x[0], x[1] = 6.0, -1.0   # amax 6 -> exponent 0, byte 127
    x[32] = 0.75             # amax .75 -> .125 -> 2**-3, byte 124; .75/.125 = 6
    rec = F.encode_mxfp4_record(x)
    assert rec.shape == (68,) and rec.dtype == torch.uint8
    assert rec[0].item() == 0xA7 and rec[16].item() == 0x07
    assert rec[64:].tolist() == [127, 124, 1, 1]
    assert F.decode_mxfp4_record(rec, 128)[[0, 1, 32]].tolist() == [6.0, -1.0, 0.75]
    gen = _gen(9)
    y = torch.randn(32, 128, generator=gen) * torch.logspace(-3, 3, 32)[:, None]
    r = F.encode_mxfp4_record(y)
    amax = y.reshape(32, 4, 32).abs().amax(-1).double()
    assert r[:, 64:].long().tolist() == (torch.ceil(torch.log2(amax / 6)) + 127).long().tolist()
    d = F.decode_mxfp4_record(r, 128)
    sc = F.e8m0_to_float(r[:, 64:]).repeat_interleave(32, dim=-1)
    assert ((y - d).abs() <= torch.maximum(y.abs(), sc) / 4).all()
    # records agree with the checkpoint MXFP4 codec
    p, s = F.quant_mxfp4(y)
    assert torch.equal(torch.cat((F.as_uint8(p), F.as_uint8(s)), -1), r)


@pytest.mark.parametrize("kind", ["nvfp4", "mxfp8", "mxfp4"])
def test_value_idempotence(kind):
    gen = _gen(10)
    x = torch.randn(8, 256, generator=gen) * torch.logspace(-1, 2, 8)[:, None]
    y = F.fake_quant(x, kind)
    assert _same_values(F.fake_quant(y, kind), y)


def test_byte_idempotence_caveat_for_pow2_scales():
    """Values are a fixed point, bytes may move by one exponent step for MX formats."""
    x = torch.zeros(32)
    x[0] = 230.0  # MXFP8: exponent 0, 230 -> 224; re-encoding 224 picks exponent -1
    r1 = F.encode_mxfp8_record(x)
    r2 = F.encode_mxfp8_record(F.decode_mxfp8_record(r1, 32))
    assert r1[32].item() == 127 and r2[32].item() == 126
    assert _same_values(F.decode_mxfp8_record(r1, 32), F.decode_mxfp8_record(r2, 32))
    x[0] = 3.1    # MXFP4: exponent 0, 3.1 -> 3; re-encoding 3 picks exponent -1
    r1 = F.encode_mxfp4_record(x)
    r2 = F.encode_mxfp4_record(F.decode_mxfp4_record(r1, 32))
    assert r1[16].item() == 127 and r2[16].item() == 126
    assert _same_values(F.decode_mxfp4_record(r1, 32), F.decode_mxfp4_record(r2, 32))


@pytest.mark.parametrize("kind,D", [("nvfp4", 512), ("mxfp8", 512), ("mxfp4", 128)])
def test_records_zeros_negative_zeros_and_nan(kind, D):
    enc = getattr(F, f"encode_{kind}_record")
    dec = getattr(F, f"decode_{kind}_record")
    nbytes = getattr(F, f"{kind}_record_bytes")(D)
    z = torch.zeros(2, D)
    z[1] = -0.0
    rec = enc(z)
    assert rec.shape == (2, nbytes)
    d = dec(rec, D)
    assert (d == 0).all()
    assert not torch.signbit(d[0]).any() and torch.signbit(d[1]).all()
    floor_byte = {"nvfp4": 0x01, "mxfp8": 105, "mxfp4": 1}[kind]
    nvals = {"nvfp4": D // 2, "mxfp8": D, "mxfp4": D // 2}[kind]
    assert (rec[:, nvals:] == floor_byte).all()
    # NaN poisons its own scale group only
    n = torch.ones(D)
    n[0] = float("nan")
    dn = dec(enc(n), D)
    group = 16 if kind == "nvfp4" else 32
    assert torch.isnan(dn[:group]).all() and not torch.isnan(dn[group:]).any()


@pytest.mark.parametrize("kind,D", [("nvfp4", 512), ("mxfp8", 512), ("mxfp4", 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_record_shapes_and_fake_quant(kind, D, dtype):
    enc = getattr(F, f"encode_{kind}_record")
    dec = getattr(F, f"decode_{kind}_record")
    nbytes = getattr(F, f"{kind}_record_bytes")(D)
    x = torch.randn(2, 3, D, generator=_gen(11)).to(dtype)
    rec = enc(x)
    assert rec.shape == (2, 3, nbytes) and rec.dtype == torch.uint8
    d = dec(rec, D)
    assert d.shape == (2, 3, D) and d.dtype == torch.float32
    fq = F.fake_quant(x, kind)
    assert fq.shape == x.shape and fq.dtype == dtype
    assert torch.equal(fq, d.to(dtype))
    assert enc(torch.zeros(0, D)).shape == (0, nbytes)
    with pytest.raises(ValueError):
        dec(rec[..., :-1], D)
    with pytest.raises(ValueError):
        enc(torch.zeros(3, D + 8))


def test_fake_quant_none_and_unknown():
    x = torch.randn(4, 64)
    assert F.fake_quant(x, "none") is x
    with pytest.raises(ValueError):
        F.fake_quant(x, "fp8")


# ----------------------------------------------------------------------------
# Storage and devices
# ----------------------------------------------------------------------------

def test_safetensors_round_trip(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    gen = _gen(12)
    w = torch.randn(64, 96, generator=gen)
    q, s = F.quant_fp8_block(w)
    p, ms = F.quant_mxfp4(torch.randn(8, 64, generator=gen))
    eq, es = F.quant_fp8_rowblock(torch.randn(5, 256, generator=gen))
    tensors = {"w.weight": q, "w.scale": s, "e.weight": p, "e.scale": ms,
               "engram.weight": eq, "engram.scale": es}
    path = tmp_path / "x.safetensors"
    st.save_file(tensors, str(path))
    back = st.load_file(str(path))
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape, k
        assert torch.equal(F.as_uint8(back[k]), F.as_uint8(v)), k
    assert _same_values(F.dequant_fp8_block(back["w.weight"], back["w.scale"]), F.dequant_fp8_block(q, s))
    assert _same_values(F.dequant_mxfp4(back["e.weight"], back["e.scale"]), F.dequant_mxfp4(p, ms))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    gen = _gen(13)
    x = torch.randn(16, 512, generator=gen) * torch.logspace(-4, 4, 16)[:, None]
    for kind, D in (("nvfp4", 512), ("mxfp8", 512), ("mxfp4", 512)):
        enc = getattr(F, f"encode_{kind}_record")
        dec = getattr(F, f"decode_{kind}_record")
        rc, rg = enc(x), enc(x.cuda())
        assert torch.equal(rg.cpu(), rc), kind
        assert _same_values(dec(rg, D).cpu(), dec(rc, D)), kind
    w = torch.randn(40, 70, generator=gen)
    (qc, sc), (qg, sg) = F.quant_fp8_block(w), F.quant_fp8_block(w.cuda())
    assert _bytes(qg.cpu()) == _bytes(qc) and _bytes(sg.cpu()) == _bytes(sc)
    pc, mc = F.quant_mxfp4(x)
    pg, mg = F.quant_mxfp4(x.cuda())
    assert _bytes(pg.cpu()) == _bytes(pc) and _bytes(mg.cpu()) == _bytes(mc)
    assert _same_values(F.dequant_mxfp4(pg, mg).cpu(), F.dequant_mxfp4(pc, mc))


def test_e2m1_decode_copies_its_table_to_a_device_once():
    """Decoding on a device must not copy the code table from host memory on every call: on a GPU such a copy
    (pageable memory) waits for the whole stream, i.e. a sync per decode.  The meta device stands in for it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class HostCopies(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            src = args[0] if args and isinstance(args[0], torch.Tensor) else None
            dst = kwargs.get("device")
            if func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default) and src is not None:
                if func is torch.ops.aten.copy_.default:
                    src, dst = args[1], args[0].device
                if src.device.type == "cpu" and dst is not None and torch.device(dst).type != "cpu":
                    HostCopies.n += 1
            return func(*args, **kwargs)

    codes = torch.arange(16, dtype=torch.uint8, device="meta")
    F.e2m1_decode(codes)  # the first call may copy the table
    with HostCopies():
        for _ in range(3):
            out = F.e2m1_decode(codes)
    assert HostCopies.n == 0, f"{HostCopies.n} host-to-device copies in 3 decodes"
    assert out.device.type == "meta" and out.dtype == torch.float32 and out.shape == (16,)
    assert torch.equal(F.e2m1_decode(torch.arange(16, dtype=torch.uint8)), F.E2M1_VALUES)


def test_fp8_block_to_rows_moves_exponents_only():
    """32x32 tiles whose scales differ within a row (by 2^3, and by 2^12): one scale per row (the largest tile's);
    every value that stays in E4M3's normal range at that scale is exactly the tiled one, the rest round to the
    nearest subnormal step (2^-9 x the row scale); most values of the tile 2^12 below are such."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(64, 128, generator=g)
    w[:32, 32:64] *= 0.125
    w[32:, 96:] *= 2.0 ** -12
    q, s = F.quant_fp8_block(w, 32)
    exact = F.dequant_fp8_block(q, s, 32)
    q_rows, scale = F.fp8_block_to_rows(q, s, 32)
    assert q_rows.dtype == torch.float8_e4m3fn and scale.shape == (64, 1)
    assert torch.equal(scale, F.e8m0_to_float(s).amax(dim=1).repeat_interleave(32)[:, None])
    got = q_rows.float() * scale
    normal = exact.abs() >= 2.0 ** -6 * scale
    assert torch.equal(got[normal], exact[normal])
    assert ((got - exact).abs() <= 2.0 ** -10 * scale).all()
    assert normal[:32, 32:64].float().mean() > 0.9 and normal[32:, 96:].float().mean() < 0.5
    assert not torch.equal(got, exact)


def test_quant_fp8_tokens_per_row_scale():
    x = torch.tensor([[1.0, -2.0, 0.5, 448.0], [0.0, 0.0, 0.0, 0.0], [3e-3, -7e-3, 1e-3, 0.0]])
    q, s = F.quant_fp8_tokens(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 1)
    assert s[0, 0] == 1.0 and s[1, 0] == F.FP8_TOKEN_SCALE_FLOOR and torch.equal(q[1].float(), torch.zeros(4))
    assert q[0].float().tolist() == [1.0, -2.0, 0.5, 448.0]
    assert s[2, 0] == pytest.approx(7e-3 / 448, rel=1e-6) and q[2, 1].float() == -448.0
    back = q.float() * s
    assert ((back - x).abs() <= x.abs() * 2.0 ** -4 + 1e-12).all()  # E4M3: 3 mantissa bits, RNE
