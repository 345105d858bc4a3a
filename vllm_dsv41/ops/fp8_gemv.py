"""``dsv41::fp8_gemv`` - a W8A8 GEMM for a few rows (batch-1 decode) in one launch: the per-token FP8
quantisation of the activations inside the GEMM, the split-K partials summed by the last program of each tile.

``fp8_gemv(x [M, G*K] bf16, w8 [N, K] E4M3, w_scale [N, 1] fp32, groups) -> [M, N] bf16``, M <= :data:`MAX_M`::

    q[m, g], s[m, g] = quant_fp8_tokens(x[m, gK:(g+1)K])           (scale = max(amax / 448, floor), RNE)
    out[m, g*n + j]  = s[m, g] * w_scale[g*n + j] * sum_k q[m, g, k] * w8[g*n + j, k]       (n = N / G)

For one group this is exactly :func:`linear.w8a8_ref` (vLLM's per-token quantisation and CUTLASS's FP8 GEMM, the
``w8a8`` default); for G > 1 each (token, group) slice has its own scale, as :func:`linear.grouped_w8a8`.

``fp8_gemv_q(q [M, K] E4M3, scale [M, 1] fp32, w8, w_scale) -> [M, N] bf16``: the same GEMM on activations already
quantised (``linear.QuantRows``, from a norm that quantised its rows in its own launch), one group:
``out[m, j] = scale[m] * w_scale[j] * sum_k q[m, k] * w8[j, k]`` (:func:`linear.w8a8_quantised_ref`).

Why an op: a batch-1 decode step spends ~2.2 ms in 208 CUTLASS FP8 GEMMs (~2.4 TB/s on ~5.1 GB of weights) plus
0.6 ms in the 160 quantisation launches before them (docs/benchmarks.md, session 21).  Here:

* one launch per GEMM: each program finds its tokens' amax over their (L2-resident) input slice, quantises its K
  tile of x in registers and feeds the FP8 tensor cores with the weight tile as it lies in memory (no decode of the
  weights, which is what made the earlier W8A16 designs compute-bound: ``fp8_gemm``, ``fp8_rows_gemm``);
* swap AB: the weight rows are the MMA's M side (``BLOCK_N``), the few tokens its N side (padded to 16);
* split K over ``SPLIT_K`` programs for narrow weights, the fp32 partials summed in a fixed order by whichever
  program of the tile arrives last (a counter per tile, reset by that program: graph-safe, no second launch).
"""

from __future__ import annotations

import functools

import torch

from vllm_dsv41 import formats
from vllm_dsv41.ops import define_op, env_flag, fp8_gemm
from vllm_dsv41.ops.l2_prefetch import _prefetch_line
from vllm_dsv41.ops._triton import (
    HAS_TRITON, gdc_launch_dependents, gdc_wait, interpreting, pdl, pdl_launch, sm_count, tl, triton,
)

MAX_M = 16
"""Rows the kernel serves (the token side of one MMA tile); more go through the reference arithmetic."""


def _check(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, groups: int) -> tuple[int, int, int]:
    fp8_gemm._check_rows(x, w8, w_scale, groups, "fp8_gemv")
    return x.shape[0], *w8.shape


def _e4m3_f32(t: torch.Tensor) -> torch.Tensor:
    return formats.as_uint8(t).view(torch.float8_e4m3fn).float()


def _codes_times_rows(q: torch.Tensor, scale: torch.Tensor, wf: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """E4M3 codes q [M, K] under per-token scales [M] or [M, 1] times the fp32 weight rows wf [n, K] under their scales
    ws [n]: fp32 [M, n], the product of ``linear.w8a8_quantised_ref``."""
    return (_e4m3_f32(q) @ wf.t()) * scale.float().reshape(-1, 1) * ws.reshape(1, -1)


def fp8_gemv_ref(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """Plain PyTorch (CPU implementation and test oracle): each (token, group) slice quantised by
    :func:`formats.quant_fp8_tokens`, times its group's E4M3 rows and their scales, fp32; x's dtype out."""
    M, N, K = _check(x, w8, w_scale, groups)
    n = N // groups
    wf, ws = _e4m3_f32(w8), w_scale.float().reshape(N)
    outs = [_codes_times_rows(*formats.quant_fp8_tokens(x[:, g * K:(g + 1) * K]), wf[g * n:(g + 1) * n],
                              ws[g * n:(g + 1) * n]) for g in range(groups)]
    return torch.cat(outs, 1).to(x.dtype)


@triton.jit
def _fence(x):
    """A gpu-scope acquire-release fence in every thread that holds an element of ``x`` (returns x)."""
    return tl.inline_asm_elementwise("fence.acq_rel.gpu;\n\tmov.b32 $0, $1;", "=r,r", [x], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _fp8_gemv_kernel(
    x_ptr,        # [M, G*K] bf16, or (PREQUANT) [M, K] E4M3 codes (float8e4nv; uint8 in the interpreter)
    xs_ptr,       # (PREQUANT) [M] fp32 per-token scales of those codes
    w_ptr,        # [N, K] E4M3 (float8e4nv on the GPU, its uint8 bytes in the interpreter)
    ws_ptr,       # [N] fp32 row scales
    out_ptr,      # [M, N] bf16
    part_ptr,     # [SPLIT_K, BLOCK_M, N] fp32 partials (SPLIT_K > 1)
    lock_ptr,     # [G * n_tiles] int32 arrival counters, zero between launches (SPLIT_K > 1)
    M, N, K, NG, k_per_split, stride_xm, floor,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, AMAX_K: tl.constexpr,
    SPLIT_K: tl.constexpr, THREADS: tl.constexpr, INTERPRET: tl.constexpr, PREQUANT: tl.constexpr,
    PDL: tl.constexpr = False, PREFETCH: tl.constexpr = False,
):
    if PREFETCH:  # this program's weight block asked of L2 before the amax pass (and under PDL before the wait)
        pf_rows = tl.minimum(tl.program_id(2) * NG + tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N), N - 1)
        pf_base = w_ptr + pf_rows.to(tl.int64)[:, None] * K + tl.program_id(1) * k_per_split
        for pf0 in range(0, k_per_split, 1024):
            _prefetch_line(pf_base + tl.minimum(pf0 + tl.arange(0, 8) * 128, k_per_split - 1)[None, :])
    if PDL:  # programmatic dependent launch: the previous kernel first
        gdc_wait()
        gdc_launch_dependents()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_g = tl.program_id(2)
    local = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = local < NG
    rows = pid_g * NG + local                      # weight rows = output columns
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    x_ptr += pid_g * K                             # the group's input slice
    if PREQUANT:
        xs = tl.load(xs_ptr + offs_m, mask=m_ok, other=1.0)
    else:
        # each token's amax over its whole slice (K <= a few thousand bf16: read from L2 by every program)
        amax = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, AMAX_K):
            ka = k0 + tl.arange(0, AMAX_K)
            xa = tl.load(x_ptr + offs_m[:, None] * stride_xm + ka[None, :], mask=m_ok[:, None] & (ka < K)[None, :],
                         other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(xa.to(tl.float32)), axis=1))
        xs = _fp8_token_scale(amax, floor)         # formats.quant_fp8_tokens' scale
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * K
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    k_begin = pid_k * k_per_split
    for k0 in range(k_begin, k_begin + k_per_split, BLOCK_K):
        w = tl.load(w_rows + (k0 + offs_k)[None, :], mask=n_ok[:, None])
        xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + (k0 + offs_k)[:, None], mask=m_ok[None, :], other=0.0)
        if INTERPRET:  # the interpreter: no FP8 dot; the same E4M3 values as fp32 products (exact)
            wf = _e4m3_to_f32(w.to(tl.int32), False)
            if PREQUANT:  # the codes as they are
                acc = tl.dot(wf, _e4m3_to_f32(xt.to(tl.int32), False), acc, input_precision="ieee")
            else:
                # rounded bit by bit: the interpreter's fp8 cast drops the carry into the next binade (126.07 -> 64)
                xq = _e4m3_to_f32(_e4m3_byte(xt.to(tl.float32) / xs[None, :]), False)
                acc = tl.dot(wf, xq, acc, input_precision="ieee")
        elif PREQUANT:
            acc = tl.dot(w, xt, acc)
        else:
            # fp32 division as Triton lowers it (approximate, ~2 ulp; IEEE div_rn measured 2.4x slower a layer on the
            # H200): a code may differ by one E4M3 step from the reference where x / scale lies that close to a
            # rounding boundary
            xq = xt.to(tl.float32) / xs[None, :]
            acc = tl.dot(w, xq.to(tl.float8e4nv, fp_downcast_rounding="rtne"), acc)
    scale = tl.load(ws_ptr + rows, mask=n_ok, other=0.0)[:, None] * xs[None, :]
    out_ptrs = out_ptr + offs_m[None, :] * N + rows[:, None]
    ok = n_ok[:, None] & m_ok[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, (acc * scale).to(out_ptr.dtype.element_ty), mask=ok)
    else:
        part = part_ptr + offs_m[None, :] * N + rows[:, None]
        tl.store(part + pid_k * BLOCK_M * N, acc, mask=ok)
        if not INTERPRET:  # programs run one after another in the interpreter
            _fence(tl.arange(0, THREADS))
            tl.debug_barrier()
        tile = pid_g * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(lock_ptr + tile, 1)
        if arrived == SPLIT_K - 1:  # the last of the tile's programs: sum the partials in split order
            if not INTERPRET:
                _fence(tl.arange(0, THREADS))
            total = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for s in range(SPLIT_K):
                total += tl.load(part + s * BLOCK_M * N, mask=ok, other=0.0, cache_modifier=".cg")
            tl.store(out_ptrs, (total * scale).to(out_ptr.dtype.element_ty), mask=ok)
            tl.atomic_xchg(lock_ptr + tile, 0)


if HAS_TRITON:  # the E4M3 decoder of sparse_attn (interpreter only)
    from vllm_dsv41.ops.sparse_attn import _e4m3_to_f32


@functools.lru_cache(maxsize=None)
def _bind() -> None:
    """The kernel's helpers shared with the other quantising kernels: compressor's per-token scale rule and E4M3
    rounding, JIT functions once compressor's kernels are built."""
    from vllm_dsv41.ops import compressor

    compressor._kernels()
    globals().update(_e4m3_byte=compressor._e4m3_byte, _fp8_token_scale=compressor._fp8_token_scale)


def plan(M: int, N: int, K: int, sms: int, groups: int = 1) -> dict:
    """Launch parameters: 64 weight rows a program, the tokens padded to 16, 128-wide K steps (64 or 32 where K is not
    a multiple), K split in whole steps until about two programs an SM (each split at least 512 inputs)."""
    n = N // groups
    block_n = 64
    block_k = next(b for b in (128, 64, 32) if K % b == 0)
    tiles = groups * -(-n // block_n)
    steps = K // block_k
    split = max(1, min(16, -(-2 * sms // tiles), K // 512))
    while steps % split:
        split -= 1
    return dict(BLOCK_N=block_n, BLOCK_M=16, BLOCK_K=block_k, SPLIT_K=split, k_per_split=K // split, num_warps=4,
                num_stages=4)


PREFETCH_ENV = "VLLM_DSV41_PDL_PREFETCH"


def prefetch_setting() -> bool:
    """``VLLM_DSV41_PDL_PREFETCH``: ``1`` lets a GEMV ask L2 for its weight block first: before it waits for the kernel
    before it when launched with PDL (the weights never depend on that kernel), and before its pass over the input
    row for the token amax in any case, so the first weight tiles come from L2; ``0`` (default, until a GPU measures
    it) not."""
    return env_flag(PREFETCH_ENV, "0")


_LOCKS: dict[tuple, torch.Tensor] = {}


def _locks(device: torch.device, n: int) -> torch.Tensor:
    """Arrival counters of the current stream on ``device`` (zero between launches: the last program of a tile resets
    its own).  One buffer per stream: launches on one stream never overlap, launches on two streams may (the model
    runs the shared expert and the indexer's ``wq_b`` on a side stream beside the main stream's GEMMs)."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device.type, device.index, stream)
    buf = _LOCKS.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        _LOCKS[key] = buf
    return buf


def reserve(device: torch.device, streams: tuple = ()) -> None:
    """Allocate the counters of ``device``'s current stream and of ``streams`` now (the model calls this at load, so
    that no graph capture allocates them)."""
    if device.type != "cuda":
        return
    _locks(device, 4096)
    for s in streams:
        with torch.cuda.stream(s):
            _locks(device, 4096)


def _launch(x: torch.Tensor, xs: torch.Tensor | None, w8: torch.Tensor, w_scale: torch.Tensor, groups: int,
            config: dict | None) -> torch.Tensor:
    """One launch on bf16 rows x (``xs`` None) or on E4M3 codes x under per-token scales ``xs``; [M, N] bf16."""
    M, K = x.shape[0], x.shape[1] // groups
    N = w8.shape[0]
    out = torch.empty(M, N, dtype=torch.bfloat16, device=x.device)
    if M == 0:
        return out
    x = x.contiguous()
    w = formats.as_uint8(w8).contiguous()
    if xs is not None:
        x = formats.as_uint8(x)
    if not interpreting():
        w = w.view(torch.float8_e4m3fn)
        x = x.view(torch.float8_e4m3fn) if xs is not None else x
    s = w_scale.float().reshape(N).contiguous()
    _bind()
    p = {**plan(M, N, K, sm_count(x.device), groups), **(config or {})}
    split = p["SPLIT_K"]
    tiles = -(-(N // groups) // p["BLOCK_N"])
    part = torch.empty(split, p["BLOCK_M"], N, dtype=torch.float32, device=x.device) if split > 1 else out
    locks = _locks(x.device, groups * tiles) if split > 1 else out
    launch = pdl_launch(pdl(x))
    launch["PREFETCH"] = not interpreting() and bool(p.get("PREFETCH", prefetch_setting()))
    _fp8_gemv_kernel[(tiles, split, groups)](
        x, s if xs is None else xs.float().reshape(M).contiguous(), w, s, out, part, locks, M, N, K, N // groups,
        p["k_per_split"], x.stride(0), formats.FP8_TOKEN_SCALE_FLOOR,
        BLOCK_N=p["BLOCK_N"], BLOCK_M=p["BLOCK_M"], BLOCK_K=p["BLOCK_K"], AMAX_K=min(8192, triton.next_power_of_2(K)),
        SPLIT_K=split, THREADS=32 * p["num_warps"], INTERPRET=interpreting(), PREQUANT=xs is not None,
        num_warps=p["num_warps"], num_stages=p["num_stages"], **launch)
    return out


def _fp8_gemv_triton(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, groups: int = 1,
                     config: dict | None = None) -> torch.Tensor:
    """Launch the kernel (``config`` overrides :func:`plan`, for sweeps); more than ``MAX_M`` rows, a non-bf16 x or K
    not a multiple of 32 go through the reference arithmetic."""
    M, N, K = _check(x, w8, w_scale, groups)
    if M > MAX_M or x.dtype != torch.bfloat16 or K % 32:
        return fp8_gemv_ref(x, w8, w_scale, groups)
    return _launch(x, None, w8, w_scale, groups, config)


def _fp8_gemv_fake(x, w8, w_scale, groups=1):
    return x.new_empty(x.shape[0], w8.shape[0])


fp8_gemv = define_op("fp8_gemv", "(Tensor x, Tensor w8, Tensor w_scale, int groups=1) -> Tensor",
                     fp8_gemv_ref, _fp8_gemv_triton if HAS_TRITON else None, _fp8_gemv_fake)


def _check_q(q: torch.Tensor, scale: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor) -> None:
    fp8_gemm._check_rows(q, w8, w_scale, 1, "fp8_gemv_q")
    if scale.numel() != q.shape[0]:
        raise ValueError(f"fp8_gemv_q: scale must hold one scale per row of q ({q.shape[0]}), got {tuple(scale.shape)}")


def fp8_gemv_q_ref(q: torch.Tensor, scale: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch: the E4M3 codes q under their per-token scales times the E4M3 rows and their scales, fp32 (the
    arithmetic of ``linear.w8a8_quantised_ref``); bf16 out."""
    _check_q(q, scale, w8, w_scale)
    return _codes_times_rows(q, scale, _e4m3_f32(w8), w_scale.float().reshape(-1)).bfloat16()


def _fp8_gemv_q_triton(q: torch.Tensor, scale: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor,
                       config: dict | None = None) -> torch.Tensor:
    _check_q(q, scale, w8, w_scale)
    if q.shape[0] > MAX_M or q.shape[1] % 32:
        return fp8_gemv_q_ref(q, scale, w8, w_scale)
    return _launch(q, scale, w8, w_scale, 1, config)


def _fp8_gemv_q_fake(q, scale, w8, w_scale):
    return torch.empty(q.shape[0], w8.shape[0], dtype=torch.bfloat16, device=q.device)


fp8_gemv_q = define_op("fp8_gemv_q", "(Tensor q, Tensor scale, Tensor w8, Tensor w_scale) -> Tensor",
                       fp8_gemv_q_ref, _fp8_gemv_q_triton if HAS_TRITON else None, _fp8_gemv_q_fake)

__all__ = ["fp8_gemv", "fp8_gemv_ref", "fp8_gemv_q", "fp8_gemv_q_ref", "plan", "reserve", "MAX_M"]
