"""``dsv41::moe_mxfp4`` - the routed experts on MXFP4 weights: two grouped GEMMs with in-kernel FP4 decode.

``moe_mxfp4(x [T, H], w13 [E, 2I, H/2], s13 [E, 2I, H/32], w2 [E, H, I/2], s2 [E, H, I/32], idx [T, k],
wts [T, k], limit) -> [T, H]`` (x's dtype)::

    y[t] = sum_j wts[t, j] * W2[e] @ (silu(min(a, L)) * clamp(b, -L, L)),   [a; b] = W13[e] @ x[t],  e = idx[t, j]

with W = the MXFP4 weights as stored by the checkpoint (``formats.dequant_mxfp4``: E2M1 codes two per byte,
low nibble first, a UE8M0 scale per 32 inputs) and ``w13`` = [w1; w3] stacked per expert.

Why an op of our own: the MoE is the largest kernel cost of a decode step and vLLM 0.32's only MXFP4 MoE
for SM90 is Marlin's (the built-in V4.1 runs it too), so a faster one is what a lead at batch 64 needs
(docs/benchmarks.md).  **Experimental**: the model uses it only with ``VLLM_DSV41_MOE=triton``; Marlin stays
the default until ``benchmarks/ops/bench_gemm.py`` measures this kernel faster on the H200.

Two kernels share the plan below.  ``swapab`` (the default since session 9) is built like ``dsv41::fp8_gemm``:
the expert's weight rows are the MMA's M side (``BLOCK_N`` = 128 per program) and the block's tokens its N side,
so the decoded weights feed the MMA straight from registers; K goes in 32-input steps (16 bytes of each weight
row, one UE8M0 scale), each E2M1 code becomes an E4M3 byte (value x 2^-6, the hardware conversion, as
``sparse_attn``'s NVFP4 keys) and the step's fp32 partial takes the power-of-two scale (times 64), so nothing is
rounded and no scale is broadcast over the tile; the activations are read in a pair-split order (each 32-input
chunk's even inputs, then its odd ones: :func:`pair_split`) so the even and odd nibbles meet contiguous rows.
Built for sm_90 without a GPU: no spills.  On the H200 it takes ~3x Marlin's time (933 against 304 µs at 64 tokens,
docs/benchmarks.md session 10), half the ``blocked`` kernel's.  ``blocked`` (the previous kernel,
kept for comparison) is described next.

Kernel design (``blocked``): the (token, slot) pairs are sorted by expert and padded to BLOCK_M rows per expert
(:func:`align_by_expert`, sync-free, a static size so a decode step can be captured); a program owns one
such block and BLOCK_N output columns and walks K in BLOCK_K steps: it gathers its rows of A, loads the
packed bytes and scales of its expert's BLOCK_N rows once, decodes the low and high nibbles (even and odd
inputs) and multiplies them against A's even and odd columns (two dots, no interleave).  Blocks are 16 rows at
decode and 64 once the pairs per expert reach 32
(prefill).  The first GEMM
writes [T*k, 2I] rows in (token, slot) order, the clamped SwiGLU runs in torch, the second GEMM scales its
rows by the routing weights, and the k rows of a token are summed.  Checked without a GPU
(``test_kernel_builds_for_sm90_without_spills``): the kernel builds for sm_90 with Triton's ptxas and keeps
everything in registers at every launch config :func:`launch_config` returns (under Triton 3.9: 16-row
blocks, 128-input K steps, 8 warps: 172 registers; 64-row blocks, 64-input steps, 8 warps: 183; with 4
warps either would spill).
"""

from __future__ import annotations

import functools

import torch

from vllm_dsv41 import formats
from vllm_dsv41.ops import define_op
from vllm_dsv41.ops._triton import hw_fp8, interpreting, jit_with_e2m1
from vllm_dsv41.reference.model import clamped_swiglu_act

__all__ = ["moe_mxfp4", "moe_mxfp4_ref", "align_by_expert"]

SMALL_BLOCK_M, LARGE_BLOCK_M = 16, 64  # rows per expert block: decode (the smallest tl.dot M) / prefill
LARGE_FROM = 32  # (token, slot) pairs per expert from which the 64-row blocks are used


def _check(x, w13, s13, w2, s2, idx, wts) -> tuple[int, int, int, int, int]:
    T, H = x.shape
    E, N1, _ = w13.shape
    I = N1 // 2
    k = idx.shape[1] if idx.dim() == 2 else -1
    want = {"w13": (E, 2 * I, H // 2), "s13": (E, 2 * I, H // 32), "w2": (E, H, I // 2), "s2": (E, H, I // 32),
            "idx": (T, k), "wts": (T, k)}
    for name, t in (("w13", w13), ("s13", s13), ("w2", w2), ("s2", s2), ("idx", idx), ("wts", wts)):
        if tuple(t.shape) != want[name] or H % 32 or I % 32:
            raise ValueError(f"moe_mxfp4: {name} {tuple(t.shape)}, expected {want[name]} (x {tuple(x.shape)}, "
                             f"w13 {tuple(w13.shape)}; H and I multiples of 32)")
    return T, H, E, I, k


def moe_mxfp4_ref(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
                  idx: torch.Tensor, wts: torch.Tensor, limit: float) -> torch.Tensor:
    """Expert by expert over the dequantised weights, in fp32 (x's dtype out).  Every expert runs on every row,
    weighted by that row's routing weight for it (0 when not chosen): nothing is read on the host, so the CPU
    op also serves inside static decode steps, and each row sums the products of ``linear.loop_moe`` in the
    same expert order (plus exact zeros)."""
    T, H, E, I, k = _check(x, w13, s13, w2, s2, idx, wts)
    xf = x.float()
    y = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    for e in range(E):
        ab = xf @ formats.dequant_mxfp4(w13[e], s13[e].view(torch.uint8)).t()
        h = clamped_swiglu_act(ab[:, :I], ab[:, I:], limit)
        g = (wts.float() * (idx == e)).sum(1, keepdim=True)
        y += (h @ formats.dequant_mxfp4(w2[e], s2[e].view(torch.uint8)).t()) * g
    return y.to(x.dtype)


def align_by_expert(idx: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing [T, k] -> (ids [P] int32: flat (token, slot) indices t*k + j grouped by expert, each expert's
    run padded to a multiple of ``block_m`` with the sentinel T*k; experts [P / block_m] int32: the expert of
    each block, -1 past the last).  P = the largest padded size, T*k + E*(block_m - 1) rounded up to
    ``block_m``: static, so nothing is read on the host."""
    n = idx.numel()
    dev = idx.device
    flat = idx.reshape(-1).long()
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    sorted_e = flat[order]
    rank = torch.arange(n, device=dev) - (torch.cumsum(counts, 0) - counts)[sorted_e]
    P = -(-(n + num_experts * (block_m - 1)) // block_m) * block_m
    ids = torch.full((P,), n, dtype=torch.int32, device=dev)
    ids[(ends - padded)[sorted_e] + rank] = order.to(torch.int32)
    starts = torch.arange(0, P, block_m, device=dev)
    experts = torch.searchsorted(ends, starts, right=True)
    experts = torch.where(starts < ends[-1], experts, -1).to(torch.int32)
    return ids, experts


tl = None  # triton.language, bound by _kernels()


def _moe_gemm_kernel(a_ptr, w_ptr, s_ptr, c_ptr, ids_ptr, experts_ptr, wts_ptr,
                     N, K, a_row_div, n_valid,
                     stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_cm,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     MUL_W: tl.constexpr, BF16_DOT: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(experts_ptr + pid_m)
    if e >= 0:
        HALF: tl.constexpr = BLOCK_K // 2
        G: tl.constexpr = BLOCK_K // 32
        flat = tl.load(ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = flat < n_valid
        arow = (tl.where(valid, flat, 0) // a_row_div).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        half = tl.arange(0, HALF)
        w_rows = w_ptr + e.to(tl.int64) * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
        s_rows = s_ptr + e.to(tl.int64) * stride_se + offs_n.to(tl.int64)[:, None] * stride_sn
        a_rows = a_ptr + arow[:, None] * stride_am
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a_e = tl.load(a_rows + (k0 + 2 * half)[None, :], mask=valid[:, None], other=0.0)
            a_o = tl.load(a_rows + (k0 + 2 * half + 1)[None, :], mask=valid[:, None], other=0.0)
            b = tl.load(w_rows + (k0 // 2 + half)[None, :], mask=mask_n[:, None], other=0).to(tl.int32) & 255
            sc = tl.load(s_rows + (k0 // 32 + tl.arange(0, G))[None, :], mask=mask_n[:, None], other=127)
            # 2^(s - 127) / 2: the decoder returns every E2M1 value doubled (exact small integers)
            scale = tl.exp2((sc.to(tl.int32) - 128).to(tl.float32))  # [BLOCK_N, G]
            w_e = tl.reshape(tl.reshape(_e2m1_twice(b & 15), (BLOCK_N, G, 16)) * scale[:, :, None], (BLOCK_N, HALF))
            w_o = tl.reshape(tl.reshape(_e2m1_twice(b >> 4), (BLOCK_N, G, 16)) * scale[:, :, None], (BLOCK_N, HALF))
            if BF16_DOT:
                acc = tl.dot(a_e.to(tl.bfloat16), tl.trans(w_e.to(tl.bfloat16)), acc)
                acc = tl.dot(a_o.to(tl.bfloat16), tl.trans(w_o.to(tl.bfloat16)), acc)
            else:  # the interpreter: its dot takes no bf16 (and its bf16 cast truncates), so fp32 products
                acc = tl.dot(a_e.to(tl.float32), tl.trans(w_e), acc, input_precision="ieee")
                acc = tl.dot(a_o.to(tl.float32), tl.trans(w_o), acc, input_precision="ieee")
        if MUL_W:
            acc = acc * tl.load(wts_ptr + flat, mask=valid, other=0.0).to(tl.float32)[:, None]
        tl.store(c_ptr + flat.to(tl.int64)[:, None] * stride_cm + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
                 mask=valid[:, None] & mask_n[None, :])


def _moe_gemm_swapab_kernel(a_ptr, w_ptr, s_ptr, c_ptr, ids_ptr, experts_ptr, wts_ptr,
                            N, K, a_row_div, n_valid,
                            stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_cm,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MUL_W: tl.constexpr,
                            BF16_DOT: tl.constexpr, HW_FP8: tl.constexpr):
    # a: the pair-split activations (pair_split); c[flat, n] = sum_k a[flat // a_row_div, k] * W[e, n, k]
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(experts_ptr + pid_m)
    if e >= 0:
        flat = tl.load(ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = flat < n_valid
        arow = (tl.where(valid, flat, 0) // a_row_div).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        j = tl.arange(0, 16)
        w_rows = w_ptr + e.to(tl.int64) * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn   # [BLOCK_N, 1]
        s_rows = s_ptr + e.to(tl.int64) * stride_se + offs_n.to(tl.int64) * stride_sn             # [BLOCK_N]
        a_cols = a_ptr + arow[None, :] * stride_am                                                # [1, BLOCK_M]
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, 32):
            b = tl.load(w_rows + (k0 // 2 + j)[None, :], mask=mask_n[:, None], other=0).to(tl.int32) & 255
            a_e = tl.load(a_cols + (k0 + j)[:, None], mask=valid[None, :], other=0.0)       # even inputs [16, M]
            a_o = tl.load(a_cols + (k0 + 16 + j)[:, None], mask=valid[None, :], other=0.0)  # odd inputs
            # E2M1 (s, e1, e0, m) as the E4M3 byte (s, 0, 0, e1, e0, m, 0, 0): value x 2^-6, exactly
            w_e = _e4m3_to_f32(((b & 7) << 2) | ((b & 8) << 4), HW_FP8)
            w_o = _e4m3_to_f32(((b >> 2) & 28) | (b & 128), HW_FP8)
            if BF16_DOT:
                part = tl.dot(w_e.to(tl.bfloat16), a_e.to(tl.bfloat16))
                part = tl.dot(w_o.to(tl.bfloat16), a_o.to(tl.bfloat16), part)
            else:  # the interpreter: fp32 products of the same values
                part = tl.dot(w_e, a_e.to(tl.float32), input_precision="ieee")
                part = tl.dot(w_o, a_o.to(tl.float32), part, input_precision="ieee")
            sc = tl.load(s_rows + k0 // 32, mask=mask_n, other=127).to(tl.int32)
            acc += part * (_e8m0_to_f32(sc) * 64.0)[:, None]  # 64 undoes the 2^-6 of the E4M3 read
        if MUL_W:
            acc = acc * tl.load(wts_ptr + flat, mask=valid, other=0.0).to(tl.float32)[None, :]
        tl.store(c_ptr + flat.to(tl.int64)[None, :] * stride_cm + offs_n[:, None], acc.to(c_ptr.dtype.element_ty),
                 mask=valid[None, :] & mask_n[:, None])


@functools.lru_cache(maxsize=None)
def _kernels():
    return jit_with_e2m1(globals(), "_moe_gemm_kernel")


@functools.lru_cache(maxsize=None)
def _swapab_kernel():
    import triton

    from vllm_dsv41.ops import sparse_attn

    _kernels()  # binds tl
    globals()["_e4m3_to_f32"] = sparse_attn._e4m3_to_f32
    globals()["_e8m0_to_f32"] = sparse_attn._e8m0_to_f32
    return triton.jit(_moe_gemm_swapab_kernel)


def pair_split(a: torch.Tensor) -> torch.Tensor:
    """[M, K] -> the same values with each 32-column chunk reordered as its 16 even columns, then its 16 odd
    ones (the order in which ``swapab`` pairs them with the weight bytes' low and high nibbles)."""
    M, K = a.shape
    return a.view(M, K // 32, 16, 2).transpose(2, 3).reshape(M, K)


SWAPAB_BLOCK_N = 128
SWAPAB_STAGES = 6


def launch_config(block_m: int, K: int) -> dict:
    """BLOCK_K and warps for blocks of ``block_m`` rows over K inputs (a multiple of 32: one scale per 32): the
    widest K step that divides K, up to 128 inputs (64 bytes of each weight row per load) for 16-row blocks
    and 64 for 64-row blocks; 8 warps where 4 would spill (checked for sm_90 by the op's tests)."""
    block_k = next(b for b in (128, 64, 32) if b <= (128 if block_m == SMALL_BLOCK_M else 64) and K % b == 0)
    return {"BLOCK_M": block_m, "BLOCK_N": 64, "BLOCK_K": block_k,
            "num_warps": 8 if block_m == LARGE_BLOCK_M or block_k == 128 else 4}


def _grouped_gemm(a: torch.Tensor, w: torch.Tensor, s: torch.Tensor, ids: torch.Tensor, experts: torch.Tensor,
                  block_m: int, a_row_div: int, n_rows: int, wts: torch.Tensor | None,
                  kernel: str = "swapab") -> torch.Tensor:
    """Rows ``ids`` (flat indices < n_rows) of A[flat // a_row_div] @ W[expert]^T, times ``wts[flat]`` if given;
    ``kernel`` ``swapab`` (default) or ``blocked`` (the previous kernel)."""
    E, N, K2 = w.shape
    c = torch.empty(n_rows, N, dtype=a.dtype, device=a.device)
    if kernel == "swapab":
        a = pair_split(a.contiguous())
        grid = (experts.numel(), -(-N // SWAPAB_BLOCK_N))
        _swapab_kernel()[grid](a, w, s, c, ids, experts, wts if wts is not None else c, N, 2 * K2, a_row_div,
                               n_rows, a.stride(0), w.stride(0), w.stride(1), s.stride(0), s.stride(1), c.stride(0),
                               BLOCK_M=block_m, BLOCK_N=SWAPAB_BLOCK_N, MUL_W=wts is not None,
                               BF16_DOT=not interpreting(), HW_FP8=hw_fp8(a), num_warps=8, num_stages=SWAPAB_STAGES)
        return c
    cfg = launch_config(block_m, 2 * K2)
    a = a.contiguous()
    grid = (experts.numel(), -(-N // cfg["BLOCK_N"]))
    _kernels()[grid](a, w, s, c, ids, experts, wts if wts is not None else c, N, 2 * K2, a_row_div, n_rows,
                     a.stride(0), w.stride(0), w.stride(1), s.stride(0), s.stride(1), c.stride(0),
                     MUL_W=wts is not None, BF16_DOT=not interpreting(), **cfg)
    return c


def _moe_mxfp4_triton(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
                      idx: torch.Tensor, wts: torch.Tensor, limit: float, kernel: str = "swapab") -> torch.Tensor:
    T, H, E, I, k = _check(x, w13, s13, w2, s2, idx, wts)
    block_m = LARGE_BLOCK_M if T * k >= LARGE_FROM * E else SMALL_BLOCK_M
    ids, experts = align_by_expert(idx, E, block_m)
    w13, s13, w2, s2 = (t.contiguous().view(torch.uint8) for t in (w13, s13, w2, s2))
    ab = _grouped_gemm(x, w13, s13, ids, experts, block_m, k, T * k, None, kernel)
    h = clamped_swiglu_act(ab[:, :I].float(), ab[:, I:].float(), limit).to(x.dtype)
    y = _grouped_gemm(h, w2, s2, ids, experts, block_m, 1, T * k, wts.reshape(-1).float().contiguous(), kernel)
    return y.view(T, k, H).sum(1)


moe_mxfp4 = define_op(
    "moe_mxfp4",
    "(Tensor x, Tensor w13, Tensor s13, Tensor w2, Tensor s2, Tensor idx, Tensor wts, float limit) -> Tensor",
    moe_mxfp4_ref,
    _moe_mxfp4_triton,
    lambda x, w13, s13, w2, s2, idx, wts, limit: torch.empty_like(x),
)
