"""Per-launch times of dsv41::moe_gemv's three kernels at the bench shapes (CUDA events over 50 replays of a graph of
8 launches each), for the plan and a few configs: ``python3 benchmarks/ops/moe_gemv_parts.py [T]``."""
import sys

import torch

from _common import open_gpu

triton = open_gpu("moe_gemv_parts")
if triton is None:
    sys.exit(0)
from vllm_dsv41 import formats
from vllm_dsv41.ops import fp8_gemv, moe_gemv as mg

H, I, E, k = 5120, 2304, 32, 6
T = int(sys.argv[1]) if len(sys.argv) > 1 else 1
w13, s13 = formats.quant_mxfp4(torch.randn(E, 2 * I, H, device="cuda") * 0.05)
w2, s2 = formats.quant_mxfp4(torch.randn(E, H, I, device="cuda") * 0.05)
w13, w2, s13, s2 = w13.view(torch.uint8), w2.view(torch.uint8), formats.as_uint8(s13), formats.as_uint8(s2)
x = torch.randn(T, H, device="cuda").bfloat16()
idx = torch.rand(T, E, device="cuda").argsort(1)[:, :k].to(torch.int32).reshape(-1).contiguous()
wts = torch.rand(T * k, device="cuda")
mg._bind()
xq = torch.empty(T, H + 480, dtype=torch.float8_e4m3fn, device="cuda")
xs = torch.empty(T, H // 32, device="cuda")
hq = torch.empty(T * k, I + 480, dtype=torch.float8_e4m3fn, device="cuda")
hs = torch.empty(T * k, I // 32, device="cuda")
out = torch.empty(T, H, dtype=torch.bfloat16, device="cuda")
locks = fp8_gemv._locks(x.device, 4096)


def timed(name, fn):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(8):
            fn()
    us = triton.testing.do_bench(g.replay, warmup=20, rep=100, return_mode="median") * 1e3 / 8
    print(f"T={T} {name}: {us:.1f} us", flush=True)


timed("mxfp8_rows", lambda: mg._mxfp8_rows_kernel[(T, -(-(H // 32) // 8))](x, xq, xs, H, x.stride(0), 1e-4,
                                                                           BLOCK_G=8, INTERPRET=False, num_warps=1))
for bn, split, chunk, warps, stages in [(128, 2, 8, 4, 3), (128, 2, 4, 4, 3), (128, 2, 8, 4, 2), (128, 2, 8, 4, 4),
                                        (64, 2, 8, 4, 3), (128, 4, 8, 4, 3), (128, 1, 8, 4, 3), (64, 4, 8, 4, 3),
                                        (128, 2, 8, 8, 3), (128, 2, 2, 4, 4)]:
    part = torch.empty(T * k, split, 2, I, device="cuda")
    timed(f"up bn={bn} split={split} chunk={chunk} warps={warps} stages={stages}",
          lambda: mg._up_kernel[(-(-I // bn), split, T * k)](
              xq, xs, w13, s13, idx, hq, hs, part, locks, H, I, k, w13.stride(0), w13.stride(1), s13.stride(0),
              s13.stride(1), 10.0, 1e-4, BLOCK_N=bn, SPLIT_K=split, CHUNK=chunk, THREADS=32 * warps, INTERPRET=False,
              num_warps=warps, num_stages=stages))
part = torch.empty(T, k, H, device="cuda")
for bn, chunk, warps, stages in [(128, 8, 4, 3), (64, 8, 4, 3), (128, 4, 4, 3), (128, 8, 4, 2), (64, 8, 4, 4),
                                 (32, 8, 4, 3), (128, 8, 8, 3)]:
    timed(f"down bn={bn} chunk={chunk} warps={warps} stages={stages}",
          lambda: mg._down_kernel[(-(-H // bn), k, T)](hq, hs, w2, s2, idx, wts, out, part, locks, H, I,
                                                        w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1),
                                                        BLOCK_N=bn, K_SLOTS=k, CHUNK=chunk, THREADS=32 * warps, INTERPRET=False,
                                                        num_warps=warps, num_stages=stages))
