"""``dsv41::rope`` - GPT-J RoPE of the last R dims of every head row, one launch.

``rope(x [T, ..., D], positions [T], inv_freq [R/2]) -> x`` rotated (a new tensor, x's dtype): pairs
(2i, 2i+1) with i >= (D - R)/2 turn by ``positions[t] * inv_freq[i - (D - R)/2]``; the NoPE part is
copied.  Why an op: the reference (``reference.model.apply_rope``) is about fifteen launches (angles in
float64, cos, sin, four products, stack, cat) and runs for the queries of every layer and the indexer
queries of the indexer layers; here it is one.  The Triton path reuses the compressor kernel's
range-reduced cos/sin (``ops/compressor.py``), so its angles match the float64 reference to an ulp.
"""

from __future__ import annotations

import functools

import torch

from vllm_dsv41.ops import define_op
from vllm_dsv41.reference.model import apply_rope

__all__ = ["rope", "rope_ref"]


def rope_ref(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    if x.shape[0] != positions.shape[0] or 2 * inv_freq.numel() > x.shape[-1]:
        raise ValueError(f"rope: x {tuple(x.shape)}, positions {tuple(positions.shape)}, "
                         f"{2 * inv_freq.numel()} rotary dims")
    return apply_rope(x, positions, inv_freq).to(x.dtype)  # the rotation runs in fp32 for bf16 x, as the kernel


tl = None  # triton.language, bound by _kernels()


def _rope_kernel(x_ptr, out_ptr, pos_ptr, freq_ptr, rows_per_token, D: tl.constexpr, R: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # one D-wide row (token t = row // rows_per_token)
    half = tl.arange(0, D // 2)
    src = x_ptr + row * D
    a = tl.load(src + 2 * half).to(tl.float32)
    b = tl.load(src + 2 * half + 1).to(tl.float32)
    fi = half - (D - R) // 2
    rot = fi >= 0
    f = tl.load(freq_ptr + tl.where(rot, fi, 0), mask=rot, other=0.0)
    c, s = _cos_sin(tl.load(pos_ptr + row // rows_per_token).to(tl.float32), f)
    a2 = tl.where(rot, a * c - b * s, a)
    b2 = tl.where(rot, a * s + b * c, b)
    dst = out_ptr + row * D
    tl.store(dst + 2 * half, a2.to(out_ptr.dtype.element_ty))
    tl.store(dst + 2 * half + 1, b2.to(out_ptr.dtype.element_ty))


@functools.lru_cache(maxsize=None)
def _kernels():
    import triton
    import triton.language

    from vllm_dsv41.ops import compressor

    compressor._kernels()
    module = globals()
    module["tl"] = triton.language
    module["_cos_sin"] = compressor._cos_sin
    module["_rope_kernel"] = triton.jit(_rope_kernel)
    return module["_rope_kernel"]


def _rope_triton(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    D, R = x.shape[-1], 2 * inv_freq.numel()
    if D & (D - 1) or R > D or x.shape[0] != positions.shape[0]:
        return rope_ref(x, positions, inv_freq)  # shapes the kernel does not cover (none in the model)
    x = x.contiguous()
    out = torch.empty_like(x)
    T = x.shape[0]
    if x.numel() == 0:
        return out
    rows = x.numel() // D
    _kernels()[(rows,)](x, out, positions.contiguous(), inv_freq.float().contiguous(), rows // T, D=D, R=R,
                        num_warps=4 if D >= 256 else 1)
    return out


rope = define_op(
    "rope",
    "(Tensor x, Tensor positions, Tensor inv_freq) -> Tensor",
    rope_ref,
    _rope_triton,
    lambda x, positions, inv_freq: torch.empty_like(x),
)
