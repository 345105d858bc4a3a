"""Dense FP8 GEMMs and the MXFP4 MoE at the bench shapes: which Hopper path to use.

The checkpoint's dense weights are E4M3 with one UE8M0 scale per 32x32 tile.  Candidates (vLLM 0.32
on an H200), each timed at the token counts of decode (1..64) and prefill (512..16384):

- ``marlin``:      Marlin W8A16 MXFP8 (tiles -> 1x32 row scales, exact repack), bf16 activations
                   (``VLLM_DSV41_DENSE_GEMM=marlin``);
- ``bf16``:        cuBLAS on the dequantised weights in bf16 (2x the weight bytes; the model's default);
- ``fp8-cutlass``: W8A8 DeepSeek-V3 style: activations quantised per 1x128 group, weights re-blocked to
                   128x128 UE8M0 scales, vLLM's CUTLASS blockwise ``cutlass_scaled_mm`` (the quantise
                   kernel included in the time);
- ``fp8-triton``:  the same operands through vLLM's Triton ``w8a8_triton_block_scaled_mm``.

Re-blocking 32x32 power-of-two scales to 128x128 keeps every weight whose tile scale equals the block's
largest; the others shift by a power of two (exact unless they underflow E4M3).  The error column is
the relative Frobenius error against the fp32 product of the bf16-rounded input and the checkpoint's
dequantised weights.  Then the grouped ``wo_a`` (per-group Marlin GEMMs, one all-rows GEMM + diagonal,
bf16 batched GEMM) and the routed experts (E 32, top-6, MXFP4) through vLLM's ``fused_marlin_moe`` (the
default) and our experimental ``dsv41::moe_mxfp4`` (``VLLM_DSV41_MOE=triton``).

    PYTHONPATH=/tmp/site python3 benchmarks/ops/bench_gemm.py [--tokens 1 16 64 512 4096 16384]
"""

from __future__ import annotations

import argparse

import torch

from _common import HBM_BYTES_PER_S, open_gpu
from vllm_dsv41 import formats
from vllm_dsv41.model_executor.linear import Expert, QuantLinear, marlin_expert_stack, marlin_moe, mxfp4_expert_stack

# (name, N, K) of the bench config's dense GEMMs (hidden 5120, q_lora 1280, 64 x 512 heads, o_lora 1024)
SHAPES = [("wq_a+wkv", 1280 + 512, 5120), ("wq_b", 64 * 512, 1280), ("wo_a group", 1024, 8 * 512),
          ("wo_b", 5120, 8 * 1024), ("shared w1+w3", 2 * 2304, 5120), ("shared w2", 5120, 2304)]
E, TOPK, H, I = 32, 6, 5120, 2304


def time_us(fn) -> float:
    """Median µs of ``fn()`` by ``triton.testing.do_bench``: L2 flushed before every call (a layer's weights
    are not in L2 when it runs) and the host's launch work overlapped with that flush.  (Until 2026-11-30
    this timed one call between two CUDA events on an idle GPU, which added the host's launch time: at
    decode sizes that was most of what it measured.)"""
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref).norm() / ref.norm()).item()


def reblock_128(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [N, K] -> (E4M3 [N, K], fp32 [N/128, K/128]) with power-of-two block scales."""
    N, K = w.shape
    blocks = w.view(N // 128, 128, K // 128, 128)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-30)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
    q = (blocks / scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(N, K)
    return q, scale


def random_fp8_linear(N: int, K: int, groups: int = 1) -> QuantLinear:
    """A CUDA QuantLinear holding random FP8 weights with their 32x32 UE8M0 tiles (not yet finalized)."""
    lin = QuantLinear(N, K, quant=True, groups=groups).cuda()
    w8, s = formats.quant_fp8_block(torch.randn(N, K, device="cuda") * 0.05, 32)
    lin.weight.data.copy_(w8)
    lin.scale.data.copy_(formats.as_uint8(s))
    return lin


def random_experts() -> torch.nn.ModuleList:
    """E routed experts (H x I) holding random MXFP4 weights, on CUDA."""
    experts = torch.nn.ModuleList(Expert(H, I, quant=True) for _ in range(E)).cuda()
    for ex in experts:
        for name, shape in (("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I))):
            packed, scale = formats.quant_mxfp4(torch.randn(*shape, device="cuda") * 0.05)
            getattr(ex, name).weight.data.copy_(packed.view(torch.int8))
            getattr(ex, name).scale.data.copy_(formats.as_uint8(scale))
    return experts


def dense_rows(M: int, N: int, K: int) -> list[tuple[str, float, float]]:
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.quantization.utils.fp8_utils import (per_token_group_quant_fp8,
                                                                         w8a8_triton_block_scaled_mm)

    lin = random_fp8_linear(N, K)
    w = lin.dequantized().float()
    lin.finalize()
    x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
    ref = x.float() @ w.t()
    wb = w.to(torch.bfloat16)
    wq, ws = reblock_128(w)
    wq_t, ws_t = wq.t(), ws.t()  # CUTLASS takes B and its block scales column-major ([K, N] views)

    def cutlass():
        q, sa = per_token_group_quant_fp8(x, 128, column_major_scales=True, use_ue8m0=True)
        return ops.cutlass_scaled_mm(q, wq_t, sa, ws_t, torch.bfloat16)

    def triton_fp8():
        q, sa = per_token_group_quant_fp8(x, 128, use_ue8m0=True)
        return w8a8_triton_block_scaled_mm(q, wq, sa, ws, [128, 128], torch.bfloat16)

    rows = []
    for name, fn in (("marlin", lambda: lin(x)), ("bf16", lambda: torch.nn.functional.linear(x, wb)),
                     ("fp8-cutlass", cutlass), ("fp8-triton", triton_fp8)):
        try:
            rows.append((name, time_us(fn), rel_err(fn(), ref)))
        except Exception as e:  # a path this build lacks: say so, keep the others
            print(f"    {name}: unavailable ({type(e).__name__}: {str(e)[:120]})")
    return rows


def grouped_rows(T: int, G: int = 8, O: int = 1024, K: int = 4096) -> list[tuple[str, float, float]]:
    """The grouped wo_a: one Marlin GEMM per group, one over all rows + diagonal (``grouped_by_all_pairs``),
    and a bf16 batched GEMM on dequantised weights."""
    lin = random_fp8_linear(G * O, K, groups=G)
    w = lin.dequantized().float().view(G, O, K)
    lin.finalize()
    x = torch.randn(T, G, K, device="cuda").to(torch.bfloat16)
    ref = torch.einsum("tgk,gok->tgo", x.float(), w)
    wb = w.to(torch.bfloat16)

    def with_limit(rows: int):
        def run():
            lin.ALL_PAIRS_MAX_ROWS = rows
            return lin(x).flatten(1)  # the caller's flatten (a copy for the all-pairs view)
        return run

    rows = []
    for name, fn in (("per-group", with_limit(0)), ("all-pairs", with_limit(1 << 30)),
                     ("bf16-bmm", lambda: torch.einsum("tgk,gok->tgo", x, wb).flatten(1))):
        rows.append((name, time_us(fn), rel_err(fn().view(T, G, O), ref)))
    return rows


def moe_rows(T: int, marlin_stack, mx_stack, limit: float) -> tuple[list[tuple[str, float, float]], int]:
    """(path, µs, rel err vs the op's reference) for vLLM's Marlin MoE and our ``dsv41::moe_mxfp4`` (Triton),
    and the number of experts the routing hits."""
    from vllm_dsv41.ops.moe_mxfp4 import _moe_mxfp4_triton, moe_mxfp4_ref

    x = (torch.randn(T, H, device="cuda") * 0.5).to(torch.bfloat16)
    logits = torch.randn(T, E, device="cuda")
    wts, idx = torch.softmax(logits, -1).topk(TOPK, -1)
    ref = moe_mxfp4_ref(x[:64], *mx_stack, idx[:64], wts[:64], limit).float()  # the first rows (the reference is slow)
    rows = []
    for name, fn in (("marlin", lambda: marlin_moe(x, marlin_stack, idx, wts, limit)),
                     ("triton", lambda: _moe_mxfp4_triton(x, *mx_stack, idx, wts, limit))):
        rows.append((name, time_us(fn), rel_err(fn()[:64], ref)))
    return rows, idx.unique().numel()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="*", default=[1, 16, 64, 512, 4096, 16384])
    ap.add_argument("--no-moe", action="store_true")
    args = ap.parse_args()
    if open_gpu("bench_gemm") is None:
        return 0
    print(f"{'GEMM':>13} {'N x K':>12} {'M':>6} {'path':>12} {'µs':>9} {'TFLOP/s':>8} {'weight GB/s':>11} "
          f"{'% 4.8TB/s':>9} {'rel err':>8}")
    for label, N, K in SHAPES:
        for M in args.tokens:
            for name, us, err in dense_rows(M, N, K):
                wbytes = N * K * (2 if name == "bf16" else 1)
                print(f"{label:>13} {f'{N}x{K}':>12} {M:>6} {name:>12} {us:9.1f} {2 * M * N * K / us / 1e6:8.1f} "
                      f"{wbytes / us / 1e3:11.0f} {100 * wbytes / us / 1e-6 / HBM_BYTES_PER_S:8.1f}% {err:8.1e}")
    print("\ngrouped wo_a: 8 groups of 1024 x 4096")
    print(f"{'T':>6} {'path':>10} {'µs':>9} {'rel err':>8}")
    for T in args.tokens:
        for name, us, err in grouped_rows(T):
            print(f"{T:>6} {name:>10} {us:9.1f} {err:8.1e}")
    if args.no_moe:
        return 0
    experts = random_experts()
    marlin_stack, mx_stack = marlin_expert_stack(experts), mxfp4_expert_stack(experts)
    del experts
    per_expert = 3 * H * I // 2  # MXFP4 bytes (scales aside)
    print(f"\nrouted experts: vLLM's fused_marlin_moe and dsv41::moe_mxfp4 (Triton), E={E} top-{TOPK} H={H} I={I} "
          "MXFP4 (rel err: the first 64 rows against the op's reference)")
    print(f"{'T':>6} {'experts hit':>11} {'path':>7} {'µs':>9} {'weight GB/s':>11} {'% 4.8TB/s':>9} {'TFLOP/s':>8} "
          f"{'rel err':>8}")
    for T in args.tokens:
        rows, hit = moe_rows(T, marlin_stack, mx_stack, 10.0)
        wbytes = hit * per_expert
        for name, us, err in rows:
            print(f"{T:>6} {hit:>11} {name:>7} {us:9.1f} {wbytes / us / 1e3:11.0f} "
                  f"{100 * wbytes / us / 1e-6 / HBM_BYTES_PER_S:8.1f}% {2 * T * TOPK * 3 * H * I / us / 1e6:8.1f} "
                  f"{err:8.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
