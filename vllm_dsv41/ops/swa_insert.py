"""``dsv41::swa_insert`` - one layer's sliding-window KV write: RMSNorm, RoPE, MXFP8 record, scatter.

For every step token t with ``slots[t] >= 0``:

    z   = rms_norm(kv[t], norm_weight, eps)            (fp32 statistics)
    z   = GPT-J RoPE of the last R dims at positions[t]  (R = 2 * len(inv_freq))
    cache[slots[t]] = encode_mxfp8_record(z)          (D E4M3 bytes + D/32 UE8M0 bytes, formats.py)

Why an op: unfused this is the reference's RMSNorm (5 launches), RoPE (~15), the record encoder (~20)
and a masked scatter (~7) per layer and step - about fifty tiny launches per layer for a few KB of
data, most of a decode step's kernel count.  The Triton kernel does it in one launch, a program per
row; padded and non-writing rows (slot -1) return at once.

Shapes: kv [T, D] (fp32 or bf16, rows contiguous), norm_weight [D], positions int64 [T], inv_freq fp32
[R/2], slots int64 [T] (rows of ``cache``, -1 = no write), cache uint8 [rows, D + D/32] (written in
place).  The reference is the CPU implementation and the test oracle; the Triton path reuses the
compressor kernel's exact E4M3 rounding and its range-reduced cos/sin (``ops/compressor.py``).
"""

from __future__ import annotations

import functools

import torch

from vllm_dsv41 import formats
from vllm_dsv41.ops import define_op
from vllm_dsv41.ops._triton import gdc_launch_dependents, gdc_wait, pdl, pdl_launch
from vllm_dsv41.reference.model import apply_rope, rms_norm

__all__ = ["swa_insert", "swa_insert_ref"]


def _check(kv: torch.Tensor, norm_weight: torch.Tensor, inv_freq: torch.Tensor, slots: torch.Tensor,
           cache: torch.Tensor) -> None:
    D = norm_weight.numel()
    if kv.dim() != 2 or kv.shape[1] != D:
        raise ValueError(f"swa_insert: kv must be [T, {D}], got {tuple(kv.shape)}")
    if slots.shape != (kv.shape[0],):
        raise ValueError(f"swa_insert: slots must be [T={kv.shape[0]}], got {tuple(slots.shape)}")
    if cache.dtype != torch.uint8 or cache.dim() != 2 or cache.shape[1] != formats.mxfp8_record_bytes(D):
        raise ValueError(f"swa_insert: cache must be uint8 [rows, {formats.mxfp8_record_bytes(D)}], got "
                         f"{cache.dtype} {tuple(cache.shape)}")
    if 2 * inv_freq.numel() > D:
        raise ValueError(f"swa_insert: {2 * inv_freq.numel()} rotary dims exceed D={D}")


def swa_insert_ref(kv: torch.Tensor, norm_weight: torch.Tensor, eps: float, positions: torch.Tensor,
                   inv_freq: torch.Tensor, slots: torch.Tensor, cache: torch.Tensor) -> None:
    """Plain PyTorch: the model's norm -> RoPE -> ``encode_mxfp8_record`` -> write, in fp32."""
    _check(kv, norm_weight, inv_freq, slots, cache)
    z = apply_rope(rms_norm(kv.float(), norm_weight.float(), eps), positions, inv_freq)
    keep = slots >= 0
    cache[slots[keep]] = formats.encode_mxfp8_record(z[keep])


# --------------------------------------------------------------------------- Triton kernel

tl = None  # triton.language, bound by _kernels()


def _swa_insert_kernel(kv_ptr, w_ptr, pos_ptr, slot_ptr, freq_ptr, cache_ptr, eps, stride_kv, stride_c,
                       D: tl.constexpr, R: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:  # programmatic dependent launch: the previous kernel first
        gdc_wait()
        gdc_launch_dependents()
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        half = tl.arange(0, D // 2)  # pair index: dims 2i, 2i+1
        row = kv_ptr + t.to(tl.int64) * stride_kv
        a = tl.load(row + 2 * half).to(tl.float32)
        b = tl.load(row + 2 * half + 1).to(tl.float32)
        ms = (tl.sum(a * a, axis=0) + tl.sum(b * b, axis=0)) / D
        rstd = 1.0 / tl.sqrt_rn(ms + eps)
        a = a * rstd * tl.load(w_ptr + 2 * half).to(tl.float32)
        b = b * rstd * tl.load(w_ptr + 2 * half + 1).to(tl.float32)
        fi = half - (D - R) // 2
        rot = fi >= 0
        f = tl.load(freq_ptr + tl.where(rot, fi, 0), mask=rot, other=0.0)
        c, s = _cos_sin(tl.load(pos_ptr + t).to(tl.float32), f)
        a, b = tl.where(rot, a * c - b * s, a), tl.where(rot, a * s + b * c, b)
        # MXFP8: 32 dims = 16 pairs per UE8M0 scale
        A = tl.reshape(a, [D // 32, 16])
        B = tl.reshape(b, [D // 32, 16])
        amax = tl.max(tl.maximum(tl.abs(A), tl.abs(B)), axis=1)
        r = tl.math.div_rn(tl.maximum(amax, 1e-4), tl.full(amax.shape, 448.0, tl.float32))
        r = tl.maximum(r, 1.1754943508222875e-38)
        bits = r.to(tl.int32, bitcast=True)
        field = (bits >> 23) & 255
        e = field - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)  # exact ceil(log2 r)
        byte = tl.minimum(tl.maximum(e + 127, 0), 254)
        byte = tl.where(field == 255, 255, byte)
        scale = tl.where(byte == 0, (1 << 22), byte << 23).to(tl.float32, bitcast=True)
        sa = tl.math.div_rn(A, tl.broadcast_to(scale[:, None], A.shape))
        sb = tl.math.div_rn(B, tl.broadcast_to(scale[:, None], B.shape))
        qa = _e4m3_byte(sa)
        qb = _e4m3_byte(sb)
        crow = cache_ptr + slot * stride_c
        g = tl.arange(0, D // 32)
        j = tl.arange(0, 16)
        even = g[:, None] * 32 + 2 * j[None, :]
        tl.store(crow + even, qa.to(tl.uint8))
        tl.store(crow + even + 1, qb.to(tl.uint8))
        tl.store(crow + D + g, byte.to(tl.uint8))


@functools.lru_cache(maxsize=None)
def _kernels():
    import triton
    import triton.language

    from vllm_dsv41.ops import compressor

    compressor._kernels()  # its _e4m3_byte / _cos_sin become JIT functions
    module = globals()
    module["tl"] = triton.language
    module["_e4m3_byte"] = compressor._e4m3_byte
    module["_cos_sin"] = compressor._cos_sin
    module["_swa_insert_kernel"] = triton.jit(_swa_insert_kernel)
    return module["_swa_insert_kernel"]


def _swa_insert_triton(kv: torch.Tensor, norm_weight: torch.Tensor, eps: float, positions: torch.Tensor,
                       inv_freq: torch.Tensor, slots: torch.Tensor, cache: torch.Tensor) -> None:
    _check(kv, norm_weight, inv_freq, slots, cache)
    D, R = norm_weight.numel(), 2 * inv_freq.numel()
    if D < 32 or D & (D - 1):
        raise ValueError(f"swa_insert (Triton): D={D} must be a power of two >= 32")
    if kv.stride(1) != 1 or cache.stride(1) != 1:
        raise ValueError("swa_insert (Triton): kv rows and cache records must be contiguous")
    T = kv.shape[0]
    if T == 0:
        return
    _kernels()[(T,)](kv, norm_weight.contiguous(), positions.contiguous(), slots.to(torch.int64).contiguous(),
                     inv_freq.float().contiguous(), cache, float(eps), kv.stride(0), cache.stride(0),
                     D=D, R=R, num_warps=4, **pdl_launch(pdl(kv)))


def _swa_insert_fake(kv, norm_weight, eps, positions, inv_freq, slots, cache) -> None:
    return None


swa_insert = define_op(
    "swa_insert",
    "(Tensor kv, Tensor norm_weight, float eps, Tensor positions, Tensor inv_freq, Tensor slots, "
    "Tensor(a!) cache) -> ()",
    swa_insert_ref,
    _swa_insert_triton,
    _swa_insert_fake,
)
