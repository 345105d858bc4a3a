"""Device time per call of the hot ops, kernel by kernel, from the CUDA profiler (no launch overhead).

    python benchmarks/ops/kernel_times.py                       # every section at decode and prefill sizes
    python benchmarks/ops/kernel_times.py --only moe sparse_attn --tokens 1 64

``do_bench`` times of sub-50 µs ops measure the host's launch work (docs/benchmarks.md, session 7); a
captured decode step does not pay it.  Here each op runs ``--iters`` times eagerly under
``torch.profiler`` and every kernel's CUPTI duration is summed and divided by the call count: the GPU time a
graph replay of the op would take, minus the gaps between kernels.  One line per (op, size, variant), with the
kernels named and the bytes an ideal kernel moves.  Sections: ``moe`` (``dsv41::moe_mxfp4``, Triton, E 32,
top-6, H 5120, I 2304, launch-config variants), ``dense`` (Marlin W8A16, bf16 cuBLAS and our ``dsv41::fp8_gemm``
at the bench shapes, and vLLM's Marlin MXFP4 MoE; needs vLLM), ``moe_ogs`` (``triton_kernels``' ``matmul_ogs``
MoE vs Marlin on the same experts, at ``--tokens`` and 512, 4096, with their errors; needs vLLM's CUDA wheel),
``ogs_flags`` (that MoE under triton_kernels' opt-flag constraints at ``--tokens`` and ``--prefill``),
``moe_bf16`` (the prefill MoE, ``linear.bf16_moe``, under a sweep of vLLM fused-MoE tiles at the ``--prefill`` sizes),
``moe_fp8`` (the FP8 prefill MoE, ``linear.fp8_moe``, the same way; both against ``matmul_ogs``), ``moe_cutlass`` (``matmul_ogs``, ``fp8_moe`` on Triton and on CUTLASS at the ``--tokens`` and
``--prefill`` sizes), ``dequant``
(its MXFP4 -> FP8 conversion under a tile sweep), ``w8a8`` / ``w8a8_grouped`` (FP8 dense GEMM paths against bf16,
every dense shape or the grouped ``wo_a`` only), ``norm_quant`` (the q norm + ``wq_b`` with and without the fused
norm-quantisation, ``VLLM_DSV41_FUSED_QUANT``), ``fused_quant`` (the collapses' and the shared expert activation's
quantisation in their own launch against the op + vLLM's quantisation),
``sparse_attn`` (decode and prefill cases of bench_sparse_attn.py, launch configs), ``router`` (fp32 x, E 32 and
384, tile variants), ``mhc`` (``mhc_pre`` / ``mhc_post_pre`` with fp32 streams, the model's dtype) and ``mhc_sweep``
(the same at the ``--prefill`` sizes, the projection in the kernel or through cuBLAS), ``compressor``
(``compress_insert`` on its two routes, ``topk_select`` at decode widths).  Image torch + Triton suffice
for all but ``dense``, ``moe_ogs``, ``ogs_flags``, ``moe_bf16``, ``moe_fp8`` and ``moe_cutlass``.  Not collected by pytest.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import sys
from collections import defaultdict

import torch

from _common import HBM_BYTES_PER_S, open_gpu


def kernel_us(fn, iters: int) -> tuple[float, dict[str, float]]:
    """(total device µs per call, {kernel name: µs per call}) of ``fn`` run ``iters`` times."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    per: dict[str, float] = defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name[:48]] += ev.device_time / iters
    return sum(per.values()), dict(per)


def report(label: str, nbytes: float, total: float, per: dict[str, float]) -> None:
    top = ", ".join(f"{k} {v:.1f}" for k, v in sorted(per.items(), key=lambda kv: -kv[1])[:4])
    print(f"{label:<44} {total:9.1f} µs {nbytes / 1e6:9.2f} MB {100 * nbytes / (total * 1e-6) / HBM_BYTES_PER_S:6.1f}%"
          f"  [{top}]", flush=True)


def section_moe(tokens: list[int], iters: int) -> None:
    from vllm_dsv41.ops import moe_mxfp4 as mm

    E, K, H, I = 32, 6, 5120, 2304
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randint(0, 256, (E, 2 * I, H // 2), generator=g, device="cuda", dtype=torch.uint8)
    s13 = torch.randint(118, 124, (E, 2 * I, H // 32), generator=g, device="cuda", dtype=torch.uint8)
    w2 = torch.randint(0, 256, (E, H, I // 2), generator=g, device="cuda", dtype=torch.uint8)
    s2 = torch.randint(118, 124, (E, H, I // 32), generator=g, device="cuda", dtype=torch.uint8)
    per_expert = 3 * H * I // 2 + 3 * H * I // 32
    base_cfg, base_small = mm.launch_config, mm.SMALL_BLOCK_M
    print(f"\nmoe_mxfp4 (Triton): E={E} top-{K} H={H} I={I}; MB = the weights of the experts hit, read once")
    for T in tokens:
        x = (torch.randn(T, H, generator=g, device="cuda") * 0.5).bfloat16()
        wts, idx = torch.softmax(torch.randn(T, E, generator=g, device="cuda"), -1).topk(K, -1)
        nbytes = idx.unique().numel() * per_expert
        # swapab (the default kernel) with its stage counts, then the blocked kernel and its tiles
        variants = [(f"swapab stages={st}", "swapab", None, st) for st in (6, 3, 8)]
        variants += [("blocked", "blocked", None, None)]
        if T * K < 32 * E:  # the 16-row path (the variants pin its block size)
            variants += [(f"blocked bm{bm} bn{bn} bk{bk} w{nw}", "blocked",
                          dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw), None)
                         for bm, bn, bk, nw in ((16, 32, 128, 4), (16, 64, 256, 8), (16, 128, 128, 8),
                                                (32, 64, 128, 8), (16, 32, 256, 4))]
        base_stages = mm.SWAPAB_STAGES
        for name, kernel, cfg, stages in variants:
            if cfg is not None:
                mm.launch_config = lambda block_m, k_in, c=cfg: dict(c)
                mm.SMALL_BLOCK_M = cfg["BLOCK_M"]
            if stages is not None:
                mm.SWAPAB_STAGES = stages
            try:
                total, per = kernel_us(lambda: mm._moe_mxfp4_triton(x, w13, s13, w2, s2, idx, wts, 10.0, kernel),
                                       iters)
                report(f"moe T={T} {name}", nbytes, total, per)
            except Exception as exc:  # a tile that does not fit
                print(f"moe T={T} {name}: {type(exc).__name__}: {str(exc)[:120]}")
            finally:
                mm.launch_config, mm.SMALL_BLOCK_M, mm.SWAPAB_STAGES = base_cfg, base_small, base_stages


def section_dense(tokens: list[int], iters: int) -> None:
    """Marlin W8A16 on the FP8 bytes vs cuBLAS on the bf16 weights, and vLLM's Marlin MXFP4 MoE (needs vLLM).
    Each path cycles through copies of its weights (>= 256 MB) so that they come from HBM, as in a step."""
    import bench_gemm as bg

    from vllm_dsv41.model_executor import linear

    from vllm_dsv41.ops import fp8_gemm

    print("\ndense FP8 GEMMs: Marlin W8A16 (FP8 bytes) vs bf16 cuBLAS vs our dsv41::fp8_gemm (FP8 bytes); MB = the "
          "weight bytes of the path")
    env = os.environ.get(linear.DENSE_GEMM_ENV)
    # (label, N, K, groups): the bench shapes, then the grouped wo_a as one launch over its 8 groups
    for label, N, K, G in [(lb, n, k, 1) for lb, n, k in bg.SHAPES] + [("wo_a 8 groups", 8192, 4096, 8)]:
        copies = max(2, -(-256 * 2 ** 20 // (2 * N * K)))
        marlin, w16, raw = [], [], []
        os.environ[linear.DENSE_GEMM_ENV] = "marlin"
        for _ in range(copies):
            lin = bg.random_fp8_linear(N, K)
            w16.append(lin.dequantized().to(torch.bfloat16))
            raw.append((lin.weight.data.clone(), lin.scale.data.clone()))
            lin.finalize()
            marlin.append(lin)
        for M in tokens:
            x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
            xg = torch.randn(M, G * K, device="cuda").to(torch.bfloat16)
            paths = [("fp8_gemm", raw, lambda r: fp8_gemm.fp8_gemm(xg, r[0], r[1], G), N * K)]
            if G == 1:
                paths += [("marlin", marlin, lambda m: m(x), N * K),
                          ("bf16", w16, lambda w: torch.nn.functional.linear(x, w), 2 * N * K)]
            if M == max(tokens):  # launch-config variants of ours
                for bn, nw, ns in ((128, 8, 3), (128, 8, 8), (64, 4, 6), (64, 4, 3)):
                    cfg = dict(BLOCK_N=bn, num_warps=nw, num_stages=ns)
                    paths.append((f"fp8_gemm {bn}/{nw}/{ns}", raw,
                                  lambda r, cfg=cfg: fp8_gemm._fp8_gemm_triton(xg, r[0], r[1], G, config=cfg), N * K))
            for name, mats, call, nbytes in paths:
                cycle = itertools.cycle(mats)
                total, per = kernel_us(lambda: call(next(cycle)), iters)
                report(f"{label} {N}x{K} M={M} {name}", nbytes, total, per)
        del marlin, w16, raw
        torch.cuda.empty_cache()
    if env is None:
        os.environ.pop(linear.DENSE_GEMM_ENV)
    else:
        os.environ[linear.DENSE_GEMM_ENV] = env

    stack = linear.marlin_expert_stack(bg.random_experts())
    per_expert = 3 * bg.H * bg.I // 2
    print(f"\nMarlin MXFP4 MoE (fused_marlin_moe): E={bg.E} top-{bg.TOPK}; MB = experts hit x their MXFP4 bytes")
    for T in tokens:
        x = (torch.randn(T, bg.H, device="cuda") * 0.5).bfloat16()
        wts, idx = torch.softmax(torch.randn(T, bg.E, device="cuda"), -1).topk(bg.TOPK, -1)
        total, per = kernel_us(lambda: linear.marlin_moe(x, stack, idx, wts, 10.0), iters)
        report(f"marlin moe T={T}", idx.unique().numel() * per_expert, total, per)


def section_w8a8(tokens: list[int], iters: int, grouped_only: bool = False) -> None:
    """FP8 x FP8 (W8A8) GEMMs from libraries against cuBLAS on the bf16 weights, at the bench's dense shapes: the
    activations quantised on the fly (per token, or per 1x128 group), the 32x32-tiled weights re-scaled once per
    output row or per 128x128 block (powers of two).  Kernel time includes the quantisation kernel; "err" is the
    relative error against the fp32 product of the checkpoint's exact weights (the bf16 path's error is its
    rounding of x and the weight to bf16)."""
    import bench_gemm as bg
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.quantization.utils.fp8_utils import per_token_group_quant_fp8

    from vllm_dsv41 import formats
    from vllm_dsv41.model_executor import linear
    from vllm_dsv41.ops import fp8_gemm  # noqa: F401  (registers dsv41::fp8_rows_gemm)

    print("\nW8A8 dense GEMMs: bf16 cuBLAS vs vLLM CUTLASS FP8 (per-token x per-row; 1x128 x 128x128 blocks) vs "
          "torch._scaled_mm per-token x per-row; MB = the weight bytes of the path")
    bf = torch.bfloat16

    shapes = [] if grouped_only else [(lb, n, k, 1) for lb, n, k in bg.SHAPES]
    for label, N, K, G in shapes + [("wo_a 8 groups", 8192, 4096, 8)]:
        lin = bg.random_fp8_linear(N, K)
        w = lin.dequantized().float()
        wr, sr = formats.fp8_block_to_rows(lin.weight.data, lin.scale.data)  # what the model's w8a8 layers hold
        del lin
        w16 = w.to(bf)
        wb, sb = bg.reblock_128(w) if G == 1 else (None, None)
        copies = max(2, -(-256 * 2 ** 20 // (2 * N * K)))
        sets = [(w16.clone(), wr.clone(), sr.clone(), None if wb is None else wb.clone(),
                 None if sb is None else sb.clone()) for _ in range(copies)]
        for M in tokens:
            x = torch.randn(M, G * K, device="cuda").to(bf)
            wg = w.view(G, N // G, K)
            ref = torch.einsum("tgk,gok->tgo", x.float().view(M, G, K), wg).reshape(M, N)
            paths = []
            if G == 1:
                paths.append(("bf16", lambda s: torch.nn.functional.linear(x, s[0]), 2 * N * K))
                paths.append(("cutlass rowwise", lambda s: linear.w8a8_gemm(x, s[1], s[2]), N * K))
                paths.append(("torch rowwise", lambda s: _rowwise_torch(ops, x, s[1], s[2]), N * K))

                def block(s):
                    q, sa = per_token_group_quant_fp8(x, 128, column_major_scales=True, use_ue8m0=True)
                    return ops.cutlass_scaled_mm(q, s[3].t(), sa, s[4].t(), bf)
                paths.append(("cutlass block128", block, N * K))
                if M <= 64:  # VLLM_DSV41_SMALL_GEMM=triton: bf16 x against the same row-scaled E4M3, split K
                    paths.append(("fp8_rows_gemm", lambda s: torch.ops.dsv41.fp8_rows_gemm(x, s[1], s[2]), N * K))
            else:
                xg = x.view(M, G, K)
                paths.append(("bf16 einsum", lambda s: torch.einsum("tgk,gok->tgo", xg, s[0].view(G, N // G, K))
                              .reshape(M, N), 2 * N * K))

                def loop(s):
                    q, sa = ops.scaled_fp8_quant(x.view(M * G, K), use_per_token_if_dynamic=True)
                    q, sa = q.view(M, G, K), sa.view(M, G)
                    wv, sv = s[1].view(G, N // G, K), s[2].view(G, N // G, 1)
                    return torch.cat([ops.cutlass_scaled_mm(q[:, g].contiguous(), wv[g].t(), sa[:, g:g + 1].contiguous(), sv[g], bf)
                                      for g in range(G)], 1)
                paths.append(("cutlass rowwise x8", loop, N * K))

                def grouped(s):
                    q, sa = ops.scaled_fp8_quant(x.view(M * G, K), use_per_token_if_dynamic=True)
                    qa = q.view(M, G, K).transpose(0, 1).contiguous()
                    sa = sa.view(M, G).t().contiguous()
                    wv = s[1].view(G, N // G, K).transpose(-2, -1)
                    out = torch._scaled_grouped_mm(qa, wv, sa, s[2].view(G, N // G), out_dtype=bf)
                    return out.transpose(0, 1).reshape(M, N)
                paths.append(("torch scaled_grouped_mm", grouped, N * K))
                # VLLM_DSV41_GROUPED_GEMM=fused_moe: the groups as the experts of vLLM's fused-MoE FP8 kernel
                paths.append(("fused_moe grouped", lambda s: linear.grouped_w8a8(xg, s[1], s[2]).reshape(M, N),
                              N * K))
                if M <= 64:
                    paths.append(("fp8_rows_gemm grouped", lambda s: torch.ops.dsv41.fp8_rows_gemm(x, s[1], s[2], G),
                                  N * K))
            for name, call, nbytes in paths:
                try:
                    err = bg.rel_err(call(sets[0]).reshape(M, N), ref)
                    cycle = itertools.cycle(sets)
                    total, per = kernel_us(lambda: call(next(cycle)), iters)
                    report(f"{label} {N}x{K} M={M} {name} err={err:.1e}", nbytes, total, per)
                except Exception as exc:
                    print(f"{label} {N}x{K} M={M} {name}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
            del x, ref
        del sets, w, w16, wr, sr, wb, sb
        torch.cuda.empty_cache()


def section_norm_quant(tokens: list[int], iters: int) -> None:
    """The q norm and ``wq_b`` (N 32768, K 1280) under ``w8a8``, the two routes of ``VLLM_DSV41_FUSED_QUANT``:
    ``fused_rms_norm`` + the GEMM's own per-token quantisation + CUTLASS (0) against vLLM's fused
    ``rms_norm_dynamic_per_token_quant`` + CUTLASS on its rows (1); "err" is each route against the fp32 norm times
    the exact weights."""
    import bench_gemm as bg

    from vllm_dsv41 import formats
    from vllm_dsv41.model_executor import linear
    from vllm_dsv41.reference.model import rms_norm

    print("\nq norm + wq_b under w8a8: unfused (rms_norm, scaled_fp8_quant, cutlass) vs fused norm-quant + cutlass")
    N, K, eps = 64 * 512, 1280, 1e-6
    lin = bg.random_fp8_linear(N, K)
    w = lin.dequantized().float()
    wr, sr = formats.fp8_block_to_rows(lin.weight.data, lin.scale.data)  # as section_w8a8
    del lin
    copies = max(2, -(-256 * 2 ** 20 // (N * K)))
    sets = [(wr.clone(), sr.clone()) for _ in range(copies)]
    nw = (torch.rand(K, device="cuda") + 0.5).to(torch.bfloat16)
    for M in tokens:
        x = (torch.randn(M, K, device="cuda") * 3).to(torch.bfloat16)
        ref = rms_norm(x.float(), nw.float(), eps) @ w.t()
        paths = [("unfused", lambda s: linear.w8a8_gemm(linear.fused_rms_norm(x, nw, eps), s[0], s[1])),
                 ("fused norm-quant", lambda s: linear.w8a8_gemm_rows(linear.fused_rms_norm_quant(x, nw, eps), s[0],
                                                                      s[1]))]
        for name, call in paths:
            err = bg.rel_err(call(sets[0]), ref)
            cycle = itertools.cycle(sets)
            total, per = kernel_us(lambda: call(next(cycle)), iters)
            report(f"q norm + wq_b {N}x{K} M={M} {name} err={err:.1e}", N * K, total, per)
        del x, ref
    del sets, w, wr, sr
    torch.cuda.empty_cache()


def section_fused_quant(tokens: list[int], iters: int) -> None:
    """The activation quantisations folded into the kernels that make the activations (``VLLM_DSV41_FUSED_QUANT``):
    ``mhc_collapse`` / ``mhc_post_collapse`` + vLLM's per-token ``scaled_fp8_quant`` against ``mhc_collapse_quant``
    / ``mhc_post_collapse_quant``, and vLLM's ``silu_and_mul_with_clamp`` + ``scaled_fp8_quant`` against
    ``dsv41::swiglu_quant`` (bf16, C 4, H 5120, I 2304).  MB: the bytes each route must move at least (the stream
    read, the new stream, x, the codes)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
    from vllm import _custom_ops as vops
    from vllm.model_executor.layers.fused_moe.activation import silu_and_mul_with_clamp

    from tests.ops import test_mhc as tm
    from vllm_dsv41.ops import mhc, swiglu_quant  # noqa: F401  (registers the ops)

    ops = torch.ops.dsv41
    print("\nfused activation quantisation: each op + vLLM's per-token FP8 quantisation vs the quantising op")
    H, C, inter, limit = 5120, 4, 2304, 7.0
    for M in tokens:
        t = tm.make_inputs(M, C, H, torch.bfloat16, seed=M, device="cuda")
        ca, pa = tm.collapse_args(t), tm.post_collapse_args(t)
        y = (torch.randn(M, 2 * inter, device="cuda") * 4).to(torch.bfloat16)
        h = torch.empty(M, inter, dtype=torch.bfloat16, device="cuda")

        def swiglu_then_quant():
            silu_and_mul_with_clamp(h, y, limit)
            return vops.scaled_fp8_quant(h, use_per_token_if_dynamic=True)

        stream_b, x_b = M * C * H * 2, M * H * 2
        cases = [("collapse + quant",
                  lambda: vops.scaled_fp8_quant(ops.mhc_collapse(*ca), use_per_token_if_dynamic=True),
                  stream_b + x_b + M * H),
                 ("collapse_quant", lambda: ops.mhc_collapse_quant(*ca), stream_b + x_b + M * H),
                 ("post_collapse + quant",
                  lambda: vops.scaled_fp8_quant(ops.mhc_post_collapse(*pa)[1], use_per_token_if_dynamic=True),
                  2 * stream_b + 2 * x_b + M * H),
                 ("post_collapse_quant", lambda: ops.mhc_post_collapse_quant(*pa), 2 * stream_b + 2 * x_b + M * H),
                 ("silu_and_mul_with_clamp + quant", swiglu_then_quant, M * inter * 7),
                 ("swiglu_quant", lambda: ops.swiglu_quant(y, limit), M * inter * 7)]
        for name, call, nbytes in cases:
            total, per = kernel_us(call, iters)
            report(f"{name} M={M}", nbytes, total, per)
        del t, y, h
    torch.cuda.empty_cache()


def _rowwise_torch(ops, x: torch.Tensor, wr: torch.Tensor, sr: torch.Tensor) -> torch.Tensor:
    q, sa = ops.scaled_fp8_quant(x, use_per_token_if_dynamic=True)
    return torch._scaled_mm(q, wr.t(), scale_a=sa, scale_b=sr.view(1, -1), out_dtype=torch.bfloat16)


def routed_batch(T: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16 x [T, H] large enough that the clamp bites, and a softmax top-k routing (idx, wts) over the bench
    experts (``bench_gemm``'s shapes)."""
    import bench_gemm as bg

    x = (torch.randn(T, bg.H, generator=g, device="cuda") * 2).bfloat16()
    wts, idx = torch.softmax(torch.randn(T, bg.E, generator=g, device="cuda"), -1).topk(bg.TOPK, -1)
    return x, idx, wts


def section_moe_ogs(tokens: list[int], iters: int) -> None:
    """``VLLM_DSV41_MOE=ogs`` (``matmul_ogs``) against the Marlin MXFP4 MoE (up to 4,096 tokens) and the prefill path
    ``bf16_moe`` (from 1,024) on the same random MXFP4 experts, then ogs and Marlin against the fp32 expert loop over
    the dequantised weights at T=64 (relative error)."""
    import bench_gemm as bg

    from vllm_dsv41.model_executor import linear

    experts = bg.random_experts()
    limit = 10.0
    paths = [("marlin", linear.marlin_moe, linear.marlin_expert_stack(experts))]
    try:
        paths.insert(0, ("ogs", linear.ogs_moe, linear.ogs_expert_stack(experts)))
    except Exception as exc:
        print(f"moe_ogs: no ogs stack: {type(exc).__name__}: {str(exc)[:200]}")
    if max(tokens) >= 1024:  # the prefill paths
        mx = linear.mxfp4_expert_stack(experts)
        paths.append(("bf16_moe", linear.bf16_moe, mx))
        rows = linear.fp8_row_exponents(mx)
        paths.append(("fp8_moe", lambda x, st, i, w, lim: linear.fp8_moe(x, st, rows, i, w, lim), mx))
    per_expert = 3 * bg.H * bg.I // 2 + 3 * bg.H * bg.I // 32
    print(f"\nmatmul_ogs MoE vs Marlin MoE (and bf16_moe from 1,024 tokens): E={bg.E} top-{bg.TOPK} H={bg.H} "
          f"I={bg.I}; MB = the MXFP4 weights and scales of the experts hit, read once")
    g = torch.Generator(device="cuda").manual_seed(0)
    for T in tokens:
        x, idx, wts = routed_batch(T, g)
        nbytes = idx.unique().numel() * per_expert
        errs = []
        for name, fn, stack in paths:
            if (name in ("bf16_moe", "fp8_moe") and T < 1024) or (name == "marlin" and T > 4096):
                continue
            try:
                total, per = kernel_us(lambda: fn(x, stack, idx, wts, limit), iters)
                report(f"moe T={T} {name}", nbytes, total, per)
                if T == 64:
                    ref = linear.loop_moe(x.float(), experts, idx, wts, limit)
                    err = (fn(x, stack, idx, wts, limit).float() - ref).norm() / ref.norm()
                    errs.append(f"{name} {err.item():.2e}")
            except Exception as exc:
                print(f"moe T={T} {name}: {type(exc).__name__}: {str(exc)[:160]}")
        if errs:
            print(f"moe T={T} relative error vs the fp32 dequantised experts: {', '.join(errs)}")


#: ``matmul_ogs`` opt-flag constraints tried by ``--only ogs_flags`` (triton_kernels' names; {} = its own choice):
#: all of them at decode sizes, the first few at prefill sizes (each is a new kernel to compile)
OGS_FLAG_SWEEP = ({}, {"is_persistent": True}, {"num_stages": 3}, {"block_k": 256}, {"num_stages": 5}, {"split_k": 2},
                  {"block_m": 32}, {"epilogue_subtile": 1})
OGS_FLAG_SWEEP_PREFILL = 3
OGS_FLAG_SWEEP_DECODE_MAX = 256  # token counts up to this get the whole sweep


@contextlib.contextmanager
def _ogs_constraints(flags: dict):
    """triton_kernels' global opt-flag constraints set to ``flags`` for the calls inside."""
    from triton_kernels.matmul_ogs_details import opt_flags

    opt_flags.reset_opt_flags_constraints()
    opt_flags.update_opt_flags_constraints(flags)
    try:
        yield
    finally:
        opt_flags.reset_opt_flags_constraints()


def section_ogs_flags(tokens: list[int], iters: int) -> None:
    """The ``matmul_ogs`` MoE (:func:`linear.ogs_moe`) under :data:`OGS_FLAG_SWEEP`'s constraints (set around the
    calls with triton_kernels' ``update_opt_flags_constraints``); a constraint the kernel cannot take is reported,
    not fatal.  ``d`` is the relative difference from triton_kernels' own choice."""
    import bench_gemm as bg

    from vllm_dsv41.model_executor import linear

    experts = bg.random_experts()
    stack = linear.ogs_expert_stack(experts)
    per_expert = 3 * bg.H * bg.I // 2 + 3 * bg.H * bg.I // 32
    print(f"\nmatmul_ogs MoE under opt-flag constraints: E={bg.E} top-{bg.TOPK} H={bg.H} I={bg.I}")
    g = torch.Generator(device="cuda").manual_seed(0)
    for T in tokens:
        x, idx, wts = routed_batch(T, g)
        nbytes = idx.unique().numel() * per_expert
        want = linear.ogs_moe(x, stack, idx, wts, 10.0).float()
        for flags in OGS_FLAG_SWEEP[:None if T <= OGS_FLAG_SWEEP_DECODE_MAX else OGS_FLAG_SWEEP_PREFILL]:
            try:
                with _ogs_constraints(flags):
                    got = linear.ogs_moe(x, stack, idx, wts, 10.0).float()
                    total, per = kernel_us(lambda: linear.ogs_moe(x, stack, idx, wts, 10.0), iters)
                diff = ((got - want).norm() / want.norm()).item()
                report(f"ogs T={T} {json.dumps(flags)} d={diff:.1e}", nbytes, total, per)
            except Exception as exc:
                print(f"ogs T={T} {flags}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)


#: bf16 fused-MoE tiles to sweep: (BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, GROUP_SIZE_M, num_warps, num_stages);
#: the first is vLLM's default for a large batch and no tuned file
BF16_MOE_SWEEP = ((128, 128, 64, 16, 8, 3), (128, 256, 64, 16, 8, 3), (128, 256, 64, 1, 8, 4), (128, 128, 64, 1, 4, 4),
                  (64, 256, 64, 16, 8, 3), (128, 128, 128, 16, 8, 3), (256, 128, 64, 16, 8, 3), (64, 128, 64, 1, 4, 4))


FP8_MOE_SWEEP = ((128, 256, 128, 1, 8, 3), (128, 128, 128, 1, 8, 4), (128, 256, 128, 16, 8, 3),
                 (64, 256, 128, 1, 8, 4), (128, 128, 256, 1, 8, 3), (256, 128, 128, 1, 8, 3))
"""(BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages) tried by ``--only moe_fp8``; the first is ``FP8_MOE_TILES``."""


DEQUANT_TILES = ((16, 128, 4), (16, 256, 4), (32, 128, 4), (32, 256, 8), (8, 512, 4), (64, 64, 4))
"""(BLOCK_R, BLOCK_C packed bytes, warps) tried by ``--only dequant``; the first is the module's default."""


def section_dequant(iters: int) -> None:
    """``dsv41::dequant_mxfp4_fp8`` (the FP8 prefill MoE's conversion) on one layer's bench experts (w13 and w2 of
    32 experts), under a tile sweep: µs a call and the achieved fraction of the HBM bandwidth (MXFP4 + scales read,
    FP8 written)."""
    from vllm_dsv41 import formats
    from vllm_dsv41.ops import dequant_mxfp4 as dq

    g = torch.Generator(device="cuda").manual_seed(0)
    print("\ndequant_mxfp4_fp8: MXFP4 -> FP8 rows (the FP8 prefill MoE's conversion), bench experts")
    for E, R, C in ((32, 2 * 2304, 5120), (32, 5120, 2304)):
        w = torch.randint(0, 256, (E, R, C // 2), generator=g, device="cuda", dtype=torch.uint8)
        s = torch.randint(118, 124, (E, R, C // 32), generator=g, device="cuda", dtype=torch.uint8)
        rows = formats.mxfp4_row_exponents(s).contiguous()
        out = torch.empty(E, R, C, dtype=torch.float8_e4m3fn, device="cuda")
        nbytes = w.numel() + s.numel() + out.numel()
        for tiles in DEQUANT_TILES:
            try:
                total, per = kernel_us(lambda t=tiles: dq._dequant_mxfp4_fp8_triton(w, s, rows, out, tiles=t), iters)
                report(f"dequant [{E},{R},{C}] {tiles[0]}x{tiles[1]} w{tiles[2]}", nbytes, total, per)
            except Exception as exc:  # a tile that does not compile
                print(f"dequant {tiles}: {type(exc).__name__}: {str(exc)[:120]}")


def _moe_tile_sweep(label: str, sweep: tuple, tokens: list[int], iters: int, fp8: bool) -> None:
    """A prefill MoE path (``linear.bf16_moe``, or ``linear.fp8_moe`` with ``fp8``) under a tile sweep at prefill
    sizes, with ``matmul_ogs`` (the default up to then) timed first when it imports; TFLOP/s counts the two GEMMs'
    products, "diff" is against ``matmul_ogs`` (else the sweep's first tile)."""
    import bench_gemm as bg

    from vllm_dsv41.model_executor import linear

    experts = bg.random_experts()
    stack = linear.mxfp4_expert_stack(experts)
    rows = linear.fp8_row_exponents(stack) if fp8 else None
    try:
        ogs = linear.ogs_expert_stack(experts)
    except Exception as exc:  # noqa: BLE001 - the sweep runs without its comparison
        print(f"{label}: no ogs stack ({type(exc).__name__}); diffs against the first tile")
        ogs = None

    def path(x, idx, wts, cfg):
        if fp8:
            return linear.fp8_moe(x, stack, rows, idx, wts, 10.0, config=cfg)
        return linear.bf16_moe(x, stack, idx, wts, 10.0, config=cfg)

    g = torch.Generator(device="cuda").manual_seed(0)
    print(f"\n{label} fused MoE (prefill path) tiles: E={bg.E} top-{bg.TOPK} H={bg.H} I={bg.I}")
    for T in tokens:
        x, idx, wts = routed_batch(T, g)
        flop = 2 * T * bg.TOPK * 3 * bg.H * bg.I
        ref = None
        if ogs is not None:
            ref = _time_moe(f"moe_ogs T={T}", lambda: linear.ogs_moe(x, ogs, idx, wts, 10.0), iters, flop, None)
        for bm, bn, bk, gm, nw, ns in sweep:
            cfg = dict(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=gm, num_warps=nw, num_stages=ns)
            got = _time_moe(f"moe_{label} T={T} {bm}x{bn}x{bk} g{gm} w{nw} s{ns}",
                            lambda c=cfg: path(x, idx, wts, c), iters, flop, ref)
            ref = got if ref is None else ref  # no ogs: the sweep's first tile that runs


def _time_moe(name: str, fn, iters: int, flop: float, ref: torch.Tensor | None) -> torch.Tensor | None:
    """Print one MoE path's CUPTI time, rate, three longest kernels and difference from ``ref`` (if any); -> its
    output in fp32, or None where it failed (a tile that does not fit: reported, the others still run)."""
    try:
        total, per = kernel_us(fn, iters)
        got = fn().float()
    except Exception as exc:  # noqa: BLE001
        print(f"{name}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
        return None
    diff = f"diff {((got - ref).norm() / ref.norm()).item():.1e}" if ref is not None else ""
    top = ", ".join(f"{k} {v:.0f}" for k, v in sorted(per.items(), key=lambda kv: -kv[1])[:3])
    print(f"{name:<44} {total:10.1f} µs  {flop / (total * 1e-6) / 1e12:6.1f} TFLOP/s  {diff}  [{top}]", flush=True)
    return got


def section_moe_cutlass(tokens: list[int], iters: int) -> None:
    """The prefill experts three ways at each token count: ``matmul_ogs`` on the MXFP4 bytes (the default below
    ``VLLM_DSV41_MOE_FP8_FROM``), ``fp8_moe`` through vLLM's Triton fused-MoE kernel (the default above it) and
    ``fp8_moe`` through vLLM's CUTLASS grouped GEMM (``VLLM_DSV41_FP8_MOE_GEMM=cutlass``); each FP8 time includes
    the layer's MXFP4 -> FP8 conversion.  "diff" is against ``matmul_ogs``."""
    import bench_gemm as bg

    from vllm_dsv41.model_executor import linear

    experts = bg.random_experts()
    stack = linear.mxfp4_expert_stack(experts)
    rows = linear.fp8_row_exponents(stack)
    ogs = linear.ogs_expert_stack(experts)
    g = torch.Generator(device="cuda").manual_seed(0)
    print(f"\nprefill MoE paths: E={bg.E} top-{bg.TOPK} H={bg.H} I={bg.I}")
    for T in tokens:
        x, idx, wts = routed_batch(T, g)
        flop = 2 * T * bg.TOPK * 3 * bg.H * bg.I
        ref = _time_moe(f"moe_ogs T={T}", lambda: linear.ogs_moe(x, ogs, idx, wts, 10.0), iters, flop, None)
        for gemm in ("triton", "cutlass"):
            _time_moe(f"moe_fp8 {gemm} T={T}", lambda m=gemm: linear.fp8_moe(x, stack, rows, idx, wts, 10.0, gemm=m),
                      iters, flop, ref)


def short_prompt_case(bsa, T: int) -> dict:
    """A prompt's prefill from position 0: windows and compressed lists fill up along it (-1 padded, as the
    model lists them), the case where ``sparse_attn``'s ``skip_empty`` pays."""
    c = bsa.prefill_case(T, T, start=0)
    c["swa_slots"] = torch.where(c["swa_slots"] >= 0, c["swa_slots"], -1)
    n_vis = (c["positions"] + 1) // 2
    j = torch.arange(c["comp_slots"].shape[1], device="cuda")
    c["comp_slots"] = torch.where(j[None, :] < n_vis[:, None], c["comp_slots"], -1).int()
    return c


def section_sparse_attn(tokens: list[int], prefill: list[int], iters: int) -> None:
    import bench_sparse_attn as bsa

    from vllm_dsv41.ops import sparse_attn as sa
    from vllm_dsv41.ops import sparse_attn_gathered as sag

    print("\nsparse_attn: Hq=64 D=512 W=128 K=512, bf16 q; MB = each distinct record once + q + out")
    cases = [(f"decode T={t}", bsa.decode_case(t, t)) for t in tokens]
    cases += [(f"prefill T={t}", bsa.prefill_case(t, t)) for t in prefill]
    cases += [("prompt 0..1023", short_prompt_case(bsa, 1024)), ("prompt 0..4095", short_prompt_case(bsa, 4096))]
    for name, c in cases:
        T = c["q"].shape[0]
        _, ubytes = bsa.moved_bytes(c)
        variants = [("default", None, None, False), ("default int-decode", None, None, False)]
        if T >= 256:
            variants.append(("default skip_empty", None, None, True))
        if "prompt" not in name:
            # (BLOCK_H, BLOCK_N, warps, stages, V_SPLIT): V_SPLIT 2 = half the value pairs a program
            cfgs = [(64, 32, 8, 2, 1), (16, 32, 4, 2, 1), (64, 64, 8, 2, 2), (64, 32, 8, 2, 2), (64, 16, 8, 2, 2),
                    (16, 64, 8, 2, 2), (16, 32, 8, 2, 2)]
            variants += [(f"{bh}/{bn}/{nw}/{ns}/v{vs}",
                          dict(BLOCK_H=bh, BLOCK_N=bn, num_warps=nw, num_stages=ns, V_SPLIT=vs), None, False)
                         for bh, bn, nw, ns, vs in cfgs]
        if T <= 64:
            variants += [(f"default splits={s}", None, s, False) for s in (1, 2, 4, 8) if T * s <= 256]
            for bn in (32, 64):
                v2 = dict(BLOCK_H=64 if T >= 8 else 16, BLOCK_N=bn, num_warps=8, num_stages=2, V_SPLIT=2)
                variants += [(f"v2 h{v2['BLOCK_H']}n{bn} splits={s}", v2, s, False) for s in (1, 2, 4, 8)
                             if T * s <= 256]
        if T < sag.MIN_ROWS and sag.flashmla_sparse_fwd() is not None:
            # the decode-rows route (VLLM_DSV41_DECODE_ATTN=flashmla): each row's keys gathered, FlashMLA's kernel
            try:
                total, per = kernel_us(lambda: sag.sparse_attn_rows(*bsa._args(c)), iters)
                report(f"{name} flashmla rows", ubytes, total, per)
            except Exception as exc:
                print(f"{name} flashmla rows: {type(exc).__name__}: {str(exc)[:120]}")
        for vname, cfg, splits, skip in variants:
            try:
                # int-decode: the records decoded bit by bit instead of the hardware E4M3 conversion
                hw = None if "int-decode" not in vname else False
                total, per = kernel_us(lambda: sa._sparse_attn_triton(*bsa._args(c), skip, num_splits=splits,
                                                                       config=cfg, hw_fp8=hw), iters)
                report(f"{name} {vname}", ubytes, total, per)
            except Exception as exc:
                print(f"{name} {vname}: {type(exc).__name__}: {str(exc)[:120]}")


def _mhc_variants(op: str, T: int, variants: list[tuple[str, dict | None]], iters: int,
                  dtype: torch.dtype = torch.float32) -> None:
    """One line per (name, launch config) of ``mhc_{op}`` (``pre`` or ``post_pre``) at T rows of ``dtype`` streams."""
    import bench_mhc as bm

    from vllm_dsv41.ops import mhc

    fn = mhc._mhc_pre_triton if op == "pre" else mhc._mhc_post_pre_triton
    a = bm.op_args(op, bm.make_inputs(T, dtype))
    nbytes = bm.ideal_bytes(op, T, dtype.itemsize)
    for vname, cfg in variants:
        try:
            total, per = kernel_us(lambda: fn(*a, config=cfg), iters)
            report(f"mhc_{op} T={T} {vname}", nbytes, total, per)
        except Exception as exc:
            print(f"mhc_{op} T={T} {vname}: {type(exc).__name__}: {str(exc)[:120]}")


def section_mhc(tokens: list[int], iters: int) -> None:
    import bench_mhc as bm

    from vllm_dsv41.ops import mhc
    from vllm_dsv41.ops._triton import sm_count

    print("\nmhc with fp32 streams (C=4, H=5120); MB = every input read once, every output written once")
    for op in ("pre", "post_pre"):
        for T in tokens:
            d = mhc._pre_config(T, bm.H, op == "post_pre", torch.device("cuda"))
            variants = [("default", None)]
            for bt, bh, nw in ((16, 16, 4), (16, 64, 4), (64, 16, 4), (64, 16, 8), (64, 32, 8)):
                if (bt, bh, nw) != (d["block_t"], d["block_h"], d["num_warps"]) and (bt == 16 or T > 16):
                    split = max(1, min(2 * sm_count(torch.device("cuda")) // -(-T // bt), -(-bm.H // bh)))
                    variants.append((f"bt{bt} bh{bh} w{nw}", dict(block_t=bt, block_h=bh, num_warps=nw, split=split)))
            _mhc_variants(op, T, variants, iters)


def section_mhc_split(tokens: list[int], iters: int) -> None:
    """The split boundary (``VLLM_DSV41_MHC_SPLIT_ROWS``) against the fused ops at decode sizes, bf16 streams (the
    fast path's): what stays on the critical path (``mhc_collapse``, ``mhc_post_collapse``) and what goes beside the
    sublayer (``mhc_coeffs``), each kernel's µs a call."""
    import bench_mhc as bm

    from vllm_dsv41.ops import mhc

    print("\nmhc split boundary, bf16 streams (C=4, H=5120): critical path (collapse) vs side stream (coeffs)")
    for T in tokens:
        t = bm.make_inputs(T, torch.bfloat16)
        pre, post = bm.op_args("pre", t), bm.op_args("post", t)
        cases = {
            "fused mhc_pre": lambda: mhc._mhc_pre_triton(*pre),
            "fused mhc_post_pre": lambda: mhc._mhc_post_pre_triton(*bm.op_args("post_pre", t)),
            "split mhc_collapse": lambda: mhc._mhc_collapse_triton(t["stream"], t["pre_prev"], t["norm_w"], bm.EPS),
            "split mhc_post_collapse": lambda: mhc._mhc_post_collapse_triton(*post, t["pre_prev"], t["norm_w"],
                                                                           bm.EPS),
            "split mhc_coeffs (side stream)": lambda: mhc._mhc_coeffs_triton(t["stream"], *pre[1:4], bm.EPS,
                                                                             bm.HC_EPS, bm.ITERS),
        }
        for name, fn in cases.items():
            try:
                total, per = kernel_us(fn, iters)
                report(f"{name} T={T}", 0, total, per)
            except Exception as exc:
                print(f"{name} T={T}: {type(exc).__name__}: {str(exc)[:120]}")


def section_mhc_sweep(tokens: list[int], iters: int) -> None:
    """``mhc_pre`` / ``mhc_post_pre`` at prefill sizes: the projection in the kernel (``project`` on, the launch
    config below ``mhc.gemm_from()`` rows) against the streaming kernel + one cuBLAS fp32 GEMM (``project`` off)
    under a few tiles and H-split counts (``waves`` = the programs per SM the split count aims at).  Session 12
    swept the in-kernel projection's tiles and splits (32/64 tokens, 16/32/64 columns, 4/8 warps, 2/3 stages, 1-33
    splits): none was more than 12% faster than its default, all at 19-27% of the bandwidth."""
    import bench_mhc as bm

    from vllm_dsv41.ops._triton import sm_count

    sms = sm_count(torch.device("cuda"))
    # bf16 streams (the fast path's since session 15); session 18's sm_90 builds: the default fused tile 16 x 128
    # spills 4,952 bytes a thread with them, 2 x 256 and 1 x 512 none
    print("\nmhc at prefill sizes with bf16 streams (C=4, H=5120); MB = every input read once, every output "
          "written once")
    for op in ("pre", "post_pre"):
        for T in tokens:
            variants = [("projection in the kernel", dict(project=True)),
                        ("cuBLAS projection, default", dict(project=False))]
            for bt, bh, nw, waves in ((8, 256, 4, 8), (4, 512, 4, 4), (16, 128, 4, 4), (8, 512, 8, 4), (2, 1024, 4, 4),
                                      (8, 256, 8, 2), (2, 256, 4, 4), (1, 512, 4, 4)):
                split = max(1, min(-(-waves * sms // -(-T // bt)), -(-bm.H // bh)))
                variants.append((f"cuBLAS projection, bt{bt} bh{bh} w{nw} (split {split})",
                                 dict(project=False, block_t=bt, block_h=bh, num_warps=nw, split=split)))
            _mhc_variants(op, T, variants, iters, torch.bfloat16)


def section_router(tokens: list[int], iters: int) -> None:
    import bench_router as br

    from vllm_dsv41.ops import router

    print("\nrouter with an fp32 x (the model's dtype), E 32 (bench) and 384 (full), top-6, H 5120; MB = x + weight")
    br.X_DTYPE = torch.float32
    for E in (32, 384):
        for T in tokens:
            x, w, b = br.make(T, E)
            nbytes = x.numel() * 4 + w.numel() * 2
            variants = [("default", {}, None), ("fused epilogue", {}, True), ("unfused epilogue", {}, False)]
            variants += [(f"split_k={k}", dict(SPLIT_K=k), None) for k in (1, 2, 4, 8)]
            variants += [(f"block_k={k} w{nw}", dict(BLOCK_K=k, num_warps=nw), None)
                         for k, nw in ((64, 4), (256, 4), (128, 2), (128, 8))]
            for vname, cfg, fuse in variants:
                try:
                    total, per = kernel_us(lambda: router._router_triton(x, w, b, 6, 1.5, fuse_epilogue=fuse,
                                                                         config=cfg), iters)
                    report(f"router E={E} T={T} {vname}", nbytes, total, per)
                except Exception as exc:
                    print(f"router E={E} T={T} {vname}: {type(exc).__name__}: {str(exc)[:120]}")


def section_compressor(tokens: list[int], iters: int) -> None:
    """``dsv41::compress_insert`` at the real sizes (D 512, ID 128, RoPE 64), the tl.dot route (16 tokens a program)
    against the small-row route (``compressor.SMALL_BLOCK_T``); one request's consecutive positions, so every
    ``ratio``-th row closes a group and writes both records.  Then ``dsv41::topk_select`` (k 512) over the score widths
    a batch-64 decode step of the bench workload sees (the context bucket over the ratio), the register route (4- and
    8-bit digits) against the candidate compaction."""
    import pathlib

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
    from tests.ops import test_compressor as tc
    from vllm_dsv41.ops import compressor as cp, topk

    print("\ncompress_insert, D 512, ID 128, R 64, bf16 wk; MB = rows read + records written")
    for ratio in (1, 2):
        for T in tokens:
            c = tc.make_case(ratio, D=512, ID=128, R=64, P=T, start=4096, seed=T, wk_dtype=torch.bfloat16)
            cc, ic = tc.empty_caches(c, T, "cuda")
            args = tc.op_args(c, range(T), lambda j: j - 4096 // ratio, lambda j: j - 4096 // ratio, cc, ic, "cuda")
            nbytes = T * ratio * 512 * 4 * (2 if ratio == 2 else 1) + (T // ratio) * (cc.shape[1] + ic.shape[1])
            for bt in (16, cp.SMALL_BLOCK_T):
                total, per = kernel_us(lambda: cp._compress_insert_triton(*args[:11], cc, ic, block_t=bt), iters)
                report(f"compress_insert r={ratio} T={T} {bt} a program", nbytes, total, per)
    print("\ntopk_select, k 512, every row sees its whole width; MB = scores read")
    g = torch.Generator(device="cuda").manual_seed(0)
    for T in tokens:
        for N in (1024, 1280, 2048, 4096, 16384):
            scores = torch.randn(T, N, device="cuda", generator=g)
            n_vis = torch.full((T,), N, dtype=torch.int32, device="cuda")
            variants = [("registers", {}), ("registers 8-bit", {"REG_BITS": 8}), ("compaction", {"IN_REGS": False})]
            for vname, cfg in variants:
                if N > topk.REG_MAX_N and vname != "compaction":
                    continue
                total, per = kernel_us(lambda: topk._topk_select_triton(scores, n_vis, 512, config=cfg), iters)
                report(f"topk_select T={T} N={N} {vname}", scores.numel() * 4, total, per)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=["moe", "sparse_attn", "mhc"])
    ap.add_argument("--tokens", type=int, nargs="*", default=[1, 64], help="decode token counts")
    ap.add_argument("--prefill", type=int, nargs="*", default=[4096], help="prefill token counts")
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args()
    if open_gpu("kernel_times") is None:
        return 0
    for name in a.only:
        if name == "moe":
            section_moe(a.tokens + a.prefill, a.iters)
        elif name == "sparse_attn":
            section_sparse_attn(a.tokens, a.prefill, a.iters)
        elif name == "dense":
            section_dense(a.tokens, a.iters)
        elif name in ("w8a8", "w8a8_grouped"):  # w8a8_grouped: the grouped wo_a only
            section_w8a8(a.tokens + a.prefill, a.iters, grouped_only=name == "w8a8_grouped")
        elif name == "norm_quant":
            section_norm_quant(a.tokens, a.iters)
        elif name == "fused_quant":
            section_fused_quant(a.tokens, a.iters)
        elif name == "dequant":
            section_dequant(a.iters)
        elif name in ("moe_bf16", "moe_fp8"):
            fp8 = name == "moe_fp8"
            _moe_tile_sweep("fp8" if fp8 else "bf16", FP8_MOE_SWEEP if fp8 else BF16_MOE_SWEEP, a.prefill, a.iters, fp8)
        elif name == "moe_ogs":
            section_moe_ogs(sorted(set(a.tokens) | {512, 4096}), a.iters)
        elif name == "moe_cutlass":
            section_moe_cutlass(a.tokens + a.prefill, a.iters)
        elif name == "ogs_flags":
            section_ogs_flags(a.tokens + a.prefill, a.iters)
        elif name == "mhc":
            section_mhc(a.tokens + a.prefill, a.iters)
        elif name == "mhc_split":
            section_mhc_split(a.tokens, a.iters)
        elif name == "mhc_sweep":
            section_mhc_sweep(a.prefill, a.iters)
        elif name == "router":
            section_router(a.tokens, a.iters)
        elif name == "compressor":
            section_compressor(a.tokens, a.iters)
        else:
            raise SystemExit(f"unknown section {name!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
