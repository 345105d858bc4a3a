"""``dsv41::rope`` / ``dsv41::rope_`` - GPT-J RoPE of the last R dims of every head row, one launch.

``rope_(x [T, ..., D], positions [T], inv_freq [R/2])`` rotates x in place: pairs (2i, 2i+1) with
i >= (D - R)/2 turn by ``positions[t] * inv_freq[i - (D - R)/2]``; the NoPE part is not touched.
``rope(x, positions, inv_freq)`` is the same rotation on a copy (a new tensor, x's dtype).  Negative
positions turn backwards (the inverse RoPE on attention outputs).

Why an op: the reference (``reference.model.apply_rope``) is about fifteen launches (angles in float64,
cos, sin, four products, stack, cat) and runs for the queries of every layer and the indexer queries of
the indexer layers; here it is one.  Why in place: the model rotates fresh GEMM outputs (q, the indexer
queries, the attention output), and the copy moved the whole 512-wide row to rotate its last 64 dims;
in place the kernel moves R/D of the bytes (the session-11 prefill profile: 29 ms of a 16k-token step
went to the copying op).  The Triton path reuses the compressor kernel's range-reduced cos/sin
(``ops/compressor.py``), so its angles match the float64 reference to an ulp; one program per token
and block of heads computes them once for all its heads.
"""

from __future__ import annotations

import functools

import torch

from vllm_dsv41.ops import define_op
from vllm_dsv41.ops._triton import gdc_launch_dependents, gdc_wait, pdl, pdl_launch
from vllm_dsv41.reference.model import apply_rope

__all__ = ["rope", "rope_", "rope_ref"]


def _check(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> None:
    if x.dim() < 2 or x.shape[0] != positions.shape[0] or 2 * inv_freq.numel() > x.shape[-1]:
        raise ValueError(f"rope: x {tuple(x.shape)}, positions {tuple(positions.shape)}, "
                         f"{2 * inv_freq.numel()} rotary dims")


def rope_ref(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    _check(x, positions, inv_freq)
    return apply_rope(x, positions, inv_freq).to(x.dtype)  # the rotation runs in fp32 for bf16 x, as the kernel


def rope_inplace_ref(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> None:
    R = 2 * inv_freq.numel()
    x[..., x.shape[-1] - R:] = rope_ref(x, positions, inv_freq)[..., x.shape[-1] - R:]


tl = None  # triton.language, bound by _kernels()


def _rope_kernel(x_ptr, pos_ptr, freq_ptr, HEADS, stride_t, stride_h,
                 D: tl.constexpr, R: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:  # programmatic dependent launch: the previous kernel first
        gdc_wait()
        gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)  # one token, BLOCK_H of its head rows
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    c, s = _cos_sin(tl.load(pos_ptr + t).to(tl.float32), tl.load(freq_ptr + tl.arange(0, R // 2)))  # once a token
    # the rotary slice of each row read and written whole (wide accesses), pairs split in registers
    ptr = x_ptr + t * stride_t + heads[:, None].to(tl.int64) * stride_h + (D - R) + tl.arange(0, R)[None, :]
    m = (heads < HEADS)[:, None]
    a, b = tl.split(tl.reshape(tl.load(ptr, mask=m).to(tl.float32), [BLOCK_H, R // 2, 2]))
    out = tl.join(a * c[None, :] - b * s[None, :], a * s[None, :] + b * c[None, :])
    tl.store(ptr, tl.reshape(out, [BLOCK_H, R]).to(x_ptr.dtype.element_ty), mask=m)


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


def _rope_inplace_triton(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> None:
    _check(x, positions, inv_freq)
    D, R = x.shape[-1], 2 * inv_freq.numel()
    T = x.shape[0]
    x3 = x.view(T, -1, D) if x.is_contiguous() else x  # [T, heads, D]; other layouts: the copy below
    if R & (R - 1) or R < 2 or x3.dim() != 3 or x3.stride(2) != 1:
        rope_inplace_ref(x, positions, inv_freq)  # shapes the kernel does not cover (none in the model)
        return
    heads = x3.shape[1]
    if x.numel() == 0:
        return
    block_h = min(64, 1 << max(0, (heads - 1).bit_length()))
    _kernels()[(T, -(-heads // block_h))](
        x3, positions.contiguous(), inv_freq.float().contiguous(), heads, x3.stride(0), x3.stride(1),
        D=D, R=R, BLOCK_H=block_h, num_warps=4 if block_h * R >= 2048 else 1, **pdl_launch(pdl(x3)))


def _rope_triton(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    out = x.clone(memory_format=torch.contiguous_format)
    _rope_inplace_triton(out, positions, inv_freq)
    return out


rope_ = define_op(
    "rope_",
    "(Tensor(a!) x, Tensor positions, Tensor inv_freq) -> ()",
    rope_inplace_ref,
    _rope_inplace_triton,
    lambda x, positions, inv_freq: None,
)

rope = define_op(
    "rope",
    "(Tensor x, Tensor positions, Tensor inv_freq) -> Tensor",
    rope_ref,
    _rope_triton,
    lambda x, positions, inv_freq: torch.empty_like(x),
)
