"""Bit-exact number formats of DeepSeek-V4.1-Flash (checkpoint and KV cache).

This module owns every low-precision format the plugin reads or writes, as plain
vectorised PyTorch (CPU and CUDA alike, no Triton, no per-element Python loops):

* scalar codecs: UE8M0 exponents (``e8m0_to_float``, ``float_to_e8m0_exponent``,
  the bit views ``as_uint8`` / ``as_e8m0``), FP4 E2M1 codes (``E2M1_VALUES``,
  ``e2m1_encode`` / ``e2m1_decode``) and nibble packing;
* checkpoint formats (architecture.md section 6.2): dense FP8 E4M3 weights with
  one E8M0 scale per 32x32 tile, MXFP4 routed-expert weights (int8 storage, two
  codes per byte, one E8M0 scale per 32 inputs) and Engram FP8 rows (one E8M0
  scale per 32 elements of a row);
* KV-cache records (architecture.md section 4.1), one uint8 record per latent
  vector: NVFP4 (288 B for D=512), MXFP8 (528 B for D=512) and the MXFP4 index-K
  record (68 B for D=128), plus ``fake_quant`` = decode(encode(x)).

Bit layouts
-----------
* E2M1 code = ``sign << 3 | exponent << 1 | mantissa``; codes 0..7 are
  0, 0.5, 1, 1.5, 2, 3, 4, 6 and codes 8..15 their negatives (8 is -0).  Two
  codes per byte, the lower-indexed element in the low nibble.  Table and nibble
  order are those of the OCP Microscaling (MX) v1.0 specification (FP4 E2M1
  element, little-nibble-first packing as used by MXFP4 tensors).
* E8M0 byte e means 2**(e - 127); e == 255 is NaN; there is no zero and no sign.
* E4M3 is torch.float8_e4m3fn (bias 7, max 448, no infinities).

Rounding rules (identical on every device)
------------------------------------------
* All arithmetic is done in float32 (inputs of any float dtype are upcast).
* Power-of-two scales: ``2**ceil(log2(r))`` where r is a float32 ratio such as
  amax/448.  The ceiling is taken from the float32 bit pattern (exponent field,
  +1 if any mantissa bit is set), so it is exact; no ``log2`` call is involved.
  Ratios are floored at 2**-126 (smallest normal float32) unless the format
  names its own floor, so all-zero blocks get a finite scale; the exponent is
  clamped to [-127, 127].  A block whose amax is NaN or inf gets the E8M0 NaN
  byte 255, so the whole block decodes to NaN.
* Division by a power-of-two scale is exact.  Division by an E4M3 (NVFP4) scale
  is one correctly rounded IEEE float32 division.
* E4M3: clamp to [-448, 448], then ``.to(torch.float8_e4m3fn)``, which rounds
  to nearest, ties to even.  NaN stays NaN.
* E2M1: round to the nearest representable magnitude; an exact tie goes to the
  neighbour with an even mantissa bit (i.e. the even code): 0.25 -> 0,
  0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4.  Magnitudes above
  6 saturate to 6.  The sign bit is copied from the input (IEEE signbit), so -0.0
  and small negatives that round to zero give code 8 (-0).  NaN gives code 0.
"""

from __future__ import annotations

import torch

__all__ = [
    "E2M1_VALUES",
    "E4M3_MAX",
    "E2M1_MAX",
    "POW2_RATIO_FLOOR",
    "MXFP8_AMAX_FLOOR",
    "NVFP4_SCALE_MIN",
    "e8m0_to_float",
    "float_to_e8m0_exponent",
    "as_uint8",
    "as_e8m0",
    "e2m1_encode",
    "e2m1_decode",
    "pack_nibbles",
    "unpack_nibbles",
    "quant_fp8_block",
    "dequant_fp8_block",
    "quant_mxfp4",
    "dequant_mxfp4",
    "quant_fp8_rowblock",
    "dequant_fp8_rowblock",
    "nvfp4_record_bytes",
    "encode_nvfp4_record",
    "decode_nvfp4_record",
    "mxfp8_record_bytes",
    "encode_mxfp8_record",
    "decode_mxfp8_record",
    "mxfp4_record_bytes",
    "encode_mxfp4_record",
    "decode_mxfp4_record",
    "fake_quant",
]

E4M3_MAX: float = 448.0
"""Largest finite float8_e4m3fn magnitude."""
E2M1_MAX: float = 6.0
"""Largest E2M1 magnitude."""
POW2_RATIO_FLOOR: float = 2.0**-126
"""Default floor of amax/max_code before taking the power-of-two ceiling."""
MXFP8_AMAX_FLOOR: float = 1e-4
"""amax floor of the MXFP8 KV record (exponent = ceil(log2(max(amax, 1e-4)/448)))."""
NVFP4_SCALE_MIN: float = 2.0**-9
"""Lower clamp of the NVFP4 record scale (smallest positive E4M3 subnormal)."""

E2M1_VALUES: torch.Tensor = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float32,
)
"""float32 [16]: E2M1 code -> value (bit 3 is the sign; code 8 is -0.0)."""

# Decision points between consecutive E2M1 magnitudes, and whether an exact tie
# rounds up (True when the upper neighbour has the even mantissa bit).
_E2M1_MIDPOINTS: tuple[tuple[float, bool], ...] = (
    (0.25, False),  # 0   | 0.5 -> tie to 0   (code 0 even)
    (0.75, True),   # 0.5 | 1   -> tie to 1   (code 2 even)
    (1.25, False),  # 1   | 1.5 -> tie to 1
    (1.75, True),   # 1.5 | 2   -> tie to 2
    (2.5, False),   # 2   | 3   -> tie to 2
    (3.5, True),    # 3   | 4   -> tie to 4
    (5.0, False),   # 4   | 6   -> tie to 4
)

_ONE_BYTE_DTYPES = (torch.uint8, torch.int8, torch.float8_e8m0fnu, torch.float8_e4m3fn)


# ----------------------------------------------------------------------------
# Bit views and scalar codecs
# ----------------------------------------------------------------------------

def as_uint8(t: torch.Tensor) -> torch.Tensor:
    """Reinterpret a one-byte tensor (uint8, int8, e8m0, e4m3) as uint8 (a view)."""
    if t.dtype == torch.uint8:
        return t
    if t.dtype not in _ONE_BYTE_DTYPES:
        raise TypeError(f"as_uint8 needs a one-byte dtype, got {t.dtype}")
    return t.view(torch.uint8)


def as_e8m0(t: torch.Tensor) -> torch.Tensor:
    """Reinterpret uint8/int8 bytes as torch.float8_e8m0fnu (a view, never a cast)."""
    if t.dtype == torch.float8_e8m0fnu:
        return t
    if t.dtype not in (torch.uint8, torch.int8):
        raise TypeError(f"as_e8m0 needs uint8/int8/e8m0 bytes, got {t.dtype}")
    return t.view(torch.float8_e8m0fnu)


def _as_e4m3(t: torch.Tensor) -> torch.Tensor:
    """Reinterpret uint8/int8 bytes as float8_e4m3fn (view); e4m3 passes through."""
    if t.dtype == torch.float8_e4m3fn:
        return t
    if t.dtype not in (torch.uint8, torch.int8):
        raise TypeError(f"expected float8_e4m3fn or raw bytes, got {t.dtype}")
    return t.view(torch.float8_e4m3fn)


def e8m0_to_float(e: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes (uint8 or float8_e8m0fnu) -> float32 ``2**(e-127)``; 255 -> NaN.

    Built from the float32 bit pattern, so it is exact on every device
    (e == 0 gives the subnormal 2**-127).
    """
    ei = as_uint8(e).to(torch.int32)
    bits = torch.where(ei == 0, torch.full_like(ei, 1 << 22), ei << 23)
    out = bits.view(torch.float32)
    return torch.where(ei == 255, torch.full_like(out, float("nan")), out)


def float_to_e8m0_exponent(scale_pow2: torch.Tensor) -> torch.Tensor:
    """float32 power of two -> uint8 biased exponent (inverse of ``e8m0_to_float``).

    Reads the float32 exponent field, so a non-power-of-two input gives
    floor(log2|x|) + 127; 2**-127 maps to 0; NaN/inf map to 255; the sign is ignored.
    """
    x = scale_pow2.to(torch.float32)
    field = (x.view(torch.int32) >> 23) & 0xFF  # 2**-127 (subnormal) has field 0
    return field.to(torch.uint8)


def _pow2_ceil_exponent_byte(ratio: torch.Tensor, floor: float = POW2_RATIO_FLOOR) -> torch.Tensor:
    """uint8 E8M0 byte of ``2**ceil(log2(max(ratio, floor)))`` (exact, bit based).

    ``ratio`` is float32 and non-negative.  NaN/inf ratios give byte 255.
    ``floor`` must be a normal float32 (>= 2**-126).
    """
    r = ratio.to(torch.float32).clamp_min(floor)
    bits = r.view(torch.int32)
    field = (bits >> 23) & 0xFF
    k = field - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    byte = (k + 127).clamp(0, 254)
    byte = torch.where(torch.isfinite(r), byte, torch.full_like(byte, 255))
    return byte.to(torch.uint8)


def _to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """float32 -> float8_e4m3fn with saturation to +-448 and round-to-nearest-even."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Float tensor -> uint8 E2M1 codes 0..15 (same shape).

    Round to nearest, ties to the even code (even mantissa bit), saturate at
    +-6, sign bit copied from the input (so -0.0 -> 8), NaN -> 0.
    """
    xf = x.to(torch.float32)
    a = xf.abs()
    mag = torch.zeros(a.shape, dtype=torch.uint8, device=a.device)
    for mid, tie_up in _E2M1_MIDPOINTS:  # 7 whole-tensor comparisons
        step = (a >= mid) if tie_up else (a > mid)
        mag += step.to(torch.uint8)
    neg = torch.signbit(xf) & ~torch.isnan(xf)
    return mag | (neg.to(torch.uint8) << 3)


_E2M1_ON: dict[torch.device, torch.Tensor] = {}


def _e2m1_table(device: torch.device) -> torch.Tensor:
    """:data:`E2M1_VALUES` on ``device``, copied there once.  A copy per call would come from pageable host
    memory, and such a copy makes the host wait until the device has run everything queued before it (on a GPU:
    one stream sync per decode, which kept the host from running ahead of prefill steps)."""
    t = _E2M1_ON.get(device)
    if t is None:
        t = _E2M1_ON[device] = E2M1_VALUES.to(device)
    return t


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 codes (only the low 4 bits are read) -> float32 values."""
    idx = (as_uint8(codes) & 0x0F).long()
    return _e2m1_table(idx.device)[idx]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., 2n] -> uint8 [..., n]; element 2i low nibble, 2i+1 high nibble."""
    c = as_uint8(codes)
    if c.shape[-1] % 2:
        raise ValueError(f"pack_nibbles needs an even last dim, got {tuple(c.shape)}")
    lo = c[..., 0::2] & 0x0F
    hi = c[..., 1::2] & 0x0F
    return lo | (hi << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8/int8 [..., n] -> uint8 codes [..., 2n] (low nibble first)."""
    p = as_uint8(packed)
    lo = p & 0x0F
    hi = p >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


# ----------------------------------------------------------------------------
# Checkpoint formats
# ----------------------------------------------------------------------------

def _check_2d(w: torch.Tensor, name: str) -> None:
    if w.dim() != 2:
        raise ValueError(f"{name} expects a 2-D [out, in] tensor, got {tuple(w.shape)}")


def _expand_tiles(s: torch.Tensor, block: int, rows: int, cols: int) -> torch.Tensor:
    """Per-tile values [ceil(rows/b), ceil(cols/b)] -> per-element [rows, cols]."""
    full = s.repeat_interleave(block, dim=0).repeat_interleave(block, dim=1)
    return full[:rows, :cols]


def quant_fp8_block(w: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense weight [out, in] -> (float8_e4m3fn [out, in], float8_e8m0fnu [ceil(out/b), ceil(in/b)]).

    Per block x block tile: scale = 2**ceil(log2(max(amax/448, 2**-126))),
    value = e4m3(clamp(w / scale, +-448)).  Partial edge tiles use their own amax.
    """
    _check_2d(w, "quant_fp8_block")
    rows, cols = w.shape
    tr, tc = -(-rows // block), -(-cols // block)
    wf = w.to(torch.float32)
    padded = torch.nn.functional.pad(wf.abs(), (0, tc * block - cols, 0, tr * block - rows))
    amax = padded.view(tr, block, tc, block).amax(dim=(1, 3))
    byte = _pow2_ceil_exponent_byte(amax / E4M3_MAX)
    scale = _expand_tiles(e8m0_to_float(byte), block, rows, cols)
    return _to_e4m3(wf / scale), as_e8m0(byte)


def dequant_fp8_block(
    w_fp8: torch.Tensor,
    scale: torch.Tensor,
    block: int = 32,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of ``quant_fp8_block``: w = fp8 * 2**(e-127) tile-wise, as ``dtype``.

    ``w_fp8`` may be float8_e4m3fn or its raw bytes; ``scale`` uint8 or e8m0, shape
    [ceil(out/block), ceil(in/block)] (the last tile of each axis may be partial).
    """
    _check_2d(w_fp8, "dequant_fp8_block")
    rows, cols = w_fp8.shape
    want = (-(-rows // block), -(-cols // block))
    if tuple(scale.shape) != want:
        raise ValueError(f"scale shape {tuple(scale.shape)} != {want} for weight {(rows, cols)}")
    s = _expand_tiles(e8m0_to_float(scale), block, rows, cols)
    return (_as_e4m3(w_fp8).to(torch.float32) * s).to(dtype)


def fp8_block_to_rows(w_fp8: torch.Tensor, scale: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 under block x block UE8M0 tiles -> (float8_e4m3fn [out, in], float32 [out, 1]): one power-of-two scale per
    row, the largest tile scale of that row, for GEMMs that take per-row weight scales.  A value only moves down in
    exponent, so it is exact unless it falls below E4M3's normal range (2**-6 x the row scale: rounded there, RNE)."""
    rows = w_fp8.shape[0]
    row_byte = as_uint8(scale).amax(dim=1).repeat_interleave(block)[:rows]
    row_scale = e8m0_to_float(row_byte)[:, None]
    return _to_e4m3(dequant_fp8_block(w_fp8, scale, block) / row_scale), row_scale


FP8_TOKEN_SCALE_FLOOR = 1.0 / (E4M3_MAX * 512)
"""The smallest per-token scale :func:`quant_fp8_tokens` gives (vLLM's dynamic FP8 quantisation uses the same), so an
all-zero row quantises to zeros instead of dividing by zero."""


def quant_fp8_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [M, K] -> (float8_e4m3fn [M, K], float32 [M, 1]): dynamic per-row (per-token) scaling,
    scale = max(amax / 448, :data:`FP8_TOKEN_SCALE_FLOOR`), value = e4m3(x / scale) (RNE)."""
    xf = x.to(torch.float32)
    scale = (xf.abs().amax(dim=-1, keepdim=True) / E4M3_MAX).clamp_min(FP8_TOKEN_SCALE_FLOOR)
    return _to_e4m3(xf / scale), scale


def _split_blocks(x: torch.Tensor, block: int, name: str) -> torch.Tensor:
    """float32 [..., D] -> [..., D/block, block] (D must be a multiple of block)."""
    d = x.shape[-1] if x.dim() else 0
    if x.dim() == 0 or d % block:
        raise ValueError(f"{name}: last dim must be a multiple of {block}, got {tuple(x.shape)}")
    return x.to(torch.float32).reshape(*x.shape[:-1], d // block, block)


def quant_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight [..., out, in] -> (int8 [..., out, in/2], float8_e8m0fnu [..., out, in/32]).

    Per 32 consecutive inputs: scale = 2**ceil(log2(max(amax/6, 2**-126))),
    code = e2m1_encode(w / scale); packed low nibble first, stored as int8.
    """
    g = _split_blocks(w, 32, "quant_mxfp4")
    byte = _pow2_ceil_exponent_byte(g.abs().amax(dim=-1) / E2M1_MAX)
    codes = e2m1_encode(g / e8m0_to_float(byte).unsqueeze(-1)).flatten(-2)
    return pack_nibbles(codes).view(torch.int8), as_e8m0(byte)


def dequant_mxfp4(
    packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """(int8/uint8 [..., out, in/2], e8m0/uint8 [..., out, in/32]) -> [..., out, in] as ``dtype``."""
    vals = e2m1_decode(unpack_nibbles(packed))
    n = vals.shape[-1]
    if n % 32 or tuple(scale.shape) != tuple(vals.shape[:-1]) + (n // 32,):
        raise ValueError(f"mxfp4 packed {tuple(packed.shape)} does not match scale {tuple(scale.shape)}")
    g = vals.reshape(*vals.shape[:-1], n // 32, 32) * e8m0_to_float(scale).unsqueeze(-1)
    return g.reshape(vals.shape).to(dtype)


MXFP4_FP8_HEADROOM = 6
"""Binades an MXFP4 row gains when it becomes FP8 under one per-row scale (:func:`mxfp4_to_fp8_rows`): the row's
largest E2M1 value (6 x its largest block scale) lands on 6 x 2**6 = 384 <= 448, so values of blocks up to
6 + 8 binades below the row's largest block stay exact (E4M3's subnormals reach 2**-9)."""


def mxfp4_row_exponents(scale: torch.Tensor) -> torch.Tensor:
    """UE8M0 block scales [..., out, in/32] -> int32 [..., out]: each row's largest scale byte."""
    return as_uint8(scale).amax(dim=-1).to(torch.int32)


def mxfp4_fp8_row_scale(row_exp: torch.Tensor) -> torch.Tensor:
    """Row exponents (:func:`mxfp4_row_exponents`) -> float32 per-row scales 2**(e - 127 - headroom)."""
    return torch.exp2(row_exp.to(torch.float64) - 127 - MXFP4_FP8_HEADROOM).to(torch.float32)


def mxfp4_to_fp8_rows(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 (packed E2M1 [..., out, in/2], UE8M0 [..., out, in/32]) -> (float8_e4m3fn [..., out, in], float32
    [..., out]) with value = fp8 x row scale: one power of two per row (:data:`MXFP4_FP8_HEADROOM`), for FP8 GEMMs
    that take per-row weight scales.  Exact except for values of blocks more than 14 binades below the row's
    largest (rounded, RNE)."""
    row_scale = mxfp4_fp8_row_scale(mxfp4_row_exponents(scale))
    return _to_e4m3(dequant_mxfp4(packed, scale) / row_scale.unsqueeze(-1)), row_scale


def quant_fp8_rowblock(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [..., D] -> (float8_e4m3fn [..., D], float8_e8m0fnu [..., D/block]) (Engram tables).

    Per ``block`` elements of a row: scale = 2**ceil(log2(max(amax/448, 2**-126))),
    value = e4m3(clamp(x / scale, +-448)).
    """
    g = _split_blocks(x, block, "quant_fp8_rowblock")
    byte = _pow2_ceil_exponent_byte(g.abs().amax(dim=-1) / E4M3_MAX)
    q = _to_e4m3(g / e8m0_to_float(byte).unsqueeze(-1)).flatten(-2)
    return q, as_e8m0(byte)


def dequant_fp8_rowblock(
    x_fp8: torch.Tensor,
    scale: torch.Tensor,
    block: int = 32,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of ``quant_fp8_rowblock``: [..., D] e4m3 * per-block 2**(e-127) -> ``dtype``."""
    v = _split_blocks(_as_e4m3(x_fp8).to(torch.float32), block, "dequant_fp8_rowblock")
    if tuple(scale.shape) != tuple(v.shape[:-1]):
        raise ValueError(f"scale shape {tuple(scale.shape)} != {tuple(v.shape[:-1])}")
    return (v * e8m0_to_float(scale).unsqueeze(-1)).flatten(-2).to(dtype)


# ----------------------------------------------------------------------------
# KV-cache records (one uint8 record per latent vector, values then scales)
# ----------------------------------------------------------------------------

def _check_width(D: int, multiple: int, name: str) -> None:
    if D <= 0 or D % multiple:
        raise ValueError(f"{name}: D must be a positive multiple of {multiple}, got {D}")


def _check_record(rec: torch.Tensor, nbytes: int, name: str) -> torch.Tensor:
    r = as_uint8(rec)
    if r.dim() == 0 or r.shape[-1] != nbytes:
        raise ValueError(f"{name}: expected last dim {nbytes}, got {tuple(r.shape)}")
    return r


def nvfp4_record_bytes(D: int) -> int:
    """Bytes of one NVFP4 record: D/2 packed E2M1 + D/16 E4M3 scales (288 for D=512)."""
    _check_width(D, 16, "nvfp4_record_bytes")
    return D // 2 + D // 16


def encode_nvfp4_record(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> uint8 [..., D/2 + D/16]: packed E2M1 codes, then one E4M3 scale per 16.

    scale = e4m3(clamp(amax/6, 2**-9, 448)); code = e2m1_encode(x / scale_as_stored)
    (one float32 division, then E2M1 round-to-nearest-even with saturation).
    """
    D = x.shape[-1] if x.dim() else 0
    _check_width(D, 16, "encode_nvfp4_record")
    g = _split_blocks(x, 16, "encode_nvfp4_record")
    s = (g.abs().amax(dim=-1) / E2M1_MAX).clamp(NVFP4_SCALE_MIN, E4M3_MAX).to(torch.float8_e4m3fn)
    codes = e2m1_encode(g / s.to(torch.float32).unsqueeze(-1)).flatten(-2)
    return torch.cat((pack_nibbles(codes), s.view(torch.uint8)), dim=-1)


def decode_nvfp4_record(rec: torch.Tensor, D: int) -> torch.Tensor:
    """uint8 [..., D/2 + D/16] -> float32 [..., D]."""
    r = _check_record(rec, nvfp4_record_bytes(D), "decode_nvfp4_record")
    vals = e2m1_decode(unpack_nibbles(r[..., : D // 2]))
    s = r[..., D // 2 :].view(torch.float8_e4m3fn).to(torch.float32)
    g = vals.reshape(*vals.shape[:-1], D // 16, 16) * s.unsqueeze(-1)
    return g.flatten(-2)


def mxfp8_record_bytes(D: int) -> int:
    """Bytes of one MXFP8 record: D E4M3 + D/32 UE8M0 (528 for D=512)."""
    _check_width(D, 32, "mxfp8_record_bytes")
    return D + D // 32


def encode_mxfp8_record(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> uint8 [..., D + D/32]: E4M3 values, then one UE8M0 byte per 32.

    exponent = ceil(log2(max(amax, 1e-4) / 448)), stored +127;
    value = e4m3(clamp(x / 2**exponent, +-448)).
    """
    g = _split_blocks(x, 32, "encode_mxfp8_record")
    amax = g.abs().amax(dim=-1)
    byte = _pow2_ceil_exponent_byte(amax.clamp_min(MXFP8_AMAX_FLOOR) / E4M3_MAX)
    q = _to_e4m3(g / e8m0_to_float(byte).unsqueeze(-1)).flatten(-2)
    return torch.cat((q.view(torch.uint8), byte), dim=-1)


def decode_mxfp8_record(rec: torch.Tensor, D: int) -> torch.Tensor:
    """uint8 [..., D + D/32] -> float32 [..., D]."""
    r = _check_record(rec, mxfp8_record_bytes(D), "decode_mxfp8_record")
    v = r[..., :D].view(torch.float8_e4m3fn).to(torch.float32)
    g = v.reshape(*v.shape[:-1], D // 32, 32) * e8m0_to_float(r[..., D:]).unsqueeze(-1)
    return g.flatten(-2)


def mxfp4_record_bytes(D: int) -> int:
    """Bytes of one MXFP4 record: D/2 packed E2M1 + D/32 UE8M0 (68 for D=128)."""
    _check_width(D, 32, "mxfp4_record_bytes")
    return D // 2 + D // 32


def encode_mxfp4_record(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> uint8 [..., D/2 + D/32]: packed E2M1 codes, then one UE8M0 byte per 32.

    exponent = ceil(log2(max(amax/6, 2**-126))) (i.e. tiny = 6 * 2**-126), stored +127;
    code = e2m1_encode(x / 2**exponent).
    """
    g = _split_blocks(x, 32, "encode_mxfp4_record")
    byte = _pow2_ceil_exponent_byte(g.abs().amax(dim=-1) / E2M1_MAX)
    codes = e2m1_encode(g / e8m0_to_float(byte).unsqueeze(-1)).flatten(-2)
    return torch.cat((pack_nibbles(codes), byte), dim=-1)


def decode_mxfp4_record(rec: torch.Tensor, D: int) -> torch.Tensor:
    """uint8 [..., D/2 + D/32] -> float32 [..., D]."""
    r = _check_record(rec, mxfp4_record_bytes(D), "decode_mxfp4_record")
    vals = e2m1_decode(unpack_nibbles(r[..., : D // 2]))
    g = vals.reshape(*vals.shape[:-1], D // 32, 32) * e8m0_to_float(r[..., D // 2 :]).unsqueeze(-1)
    return g.flatten(-2)


_RECORD_CODECS = {
    "nvfp4": (encode_nvfp4_record, decode_nvfp4_record),
    "mxfp8": (encode_mxfp8_record, decode_mxfp8_record),
    "mxfp4": (encode_mxfp4_record, decode_mxfp4_record),
}


def fake_quant(x: torch.Tensor, kind: str) -> torch.Tensor:
    """Cache-record quantisation round trip: decode(encode(x)) along the last dim.

    ``kind`` is "nvfp4", "mxfp8", "mxfp4" or "none" (returns ``x`` itself).
    The result has x's shape and dtype (the float32 decode is cast back).
    """
    if kind == "none":
        return x
    try:
        enc, dec = _RECORD_CODECS[kind]
    except KeyError:
        raise ValueError(f"unknown cache-record kind {kind!r}") from None
    return dec(enc(x), x.shape[-1]).to(x.dtype)

