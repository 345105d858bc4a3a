"""Per-launch times of dsv41::moe_gemv's three kernels at the bench shapes (``bench_moe_gemv.graph_time``: a graph of 8
launches, median replay time / 8) for the plan and a few configs: ``python3 benchmarks/ops/moe_gemv_parts.py [T]``."""
import sys

import torch

from _common import open_gpu
from bench_moe_gemv import graph_time

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
xs = torch.empty(T, H // 32, device="cuda")
hs = torch.empty(T * k, I // 32, device="cuda")
out = torch.empty(T, H, dtype=torch.bfloat16, device="cuda")
locks = fp8_gemv._locks(x.device, 4096)
f8 = torch.float8_e4m3fn


def timed(name, fn):
    print(f"T={T} {name}: {graph_time(triton, [fn] * 8):.1f} us", flush=True)

for G in (8, 16):
    xd = mg._diag(x.device, "x", T, H // 32, G, f8)
    timed(f"mxfp8_rows G={G}", lambda: mg._mxfp8_rows_kernel[(T, -(-(H // 32) // 8))](
        x, xd, xs, H, x.stride(0), 1e-4, BLOCK_G=8, G=G, INTERPRET=False, num_warps=1))
# (BLOCK_N, SPLIT_K, G, warps, stages)
for bn, split, G, warps, stages in [(128, 2, 8, 4, 3), (128, 1, 8, 4, 3), (128, 4, 8, 4, 3), (128, 5, 8, 4, 3),
                                    (128, 2, 8, 4, 2), (128, 2, 8, 4, 4), (64, 2, 8, 4, 3), (64, 4, 8, 4, 4),
                                    (64, 5, 16, 4, 3), (64, 2, 16, 4, 3), (128, 4, 4, 4, 4), (128, 8, 4, 4, 4),
                                    (128, 2, 8, 8, 3), (64, 10, 16, 4, 2)]:
    xd = mg._diag(x.device, "x", T, H // 32, G, f8)
    hd = mg._diag(x.device, "h", T * k, I // 32, 8, f8)
    part = torch.empty(T * k, split, 2, I, device="cuda")
    try:
        timed(f"up bn={bn} split={split} G={G} warps={warps} stages={stages}",
              lambda: mg._up_kernel[(-(-I // bn), split, T * k)](
                  xd, xs, w13, s13, idx, hd, hs, part, locks, H, I, k, w13.stride(0), w13.stride(1), s13.stride(0),
                  s13.stride(1), 10.0, 1e-4, BLOCK_N=bn, SPLIT_K=split, G=G, H_G=8, EVEN=(H // 32) % G == 0,
                  THREADS=32 * warps, INTERPRET=False, num_warps=warps, num_stages=stages))
    except Exception as e:  # noqa: BLE001 - a config that does not build (shared memory) is reported, not fatal
        print(f"T={T} up bn={bn} split={split} G={G} warps={warps} stages={stages}: {type(e).__name__} {e}"[:200])
part = torch.empty(T, k, H, device="cuda")
for bn, G, warps, stages in [(128, 8, 4, 3), (64, 8, 4, 3), (128, 8, 4, 4), (128, 8, 4, 2), (64, 8, 4, 4),
                             (32, 8, 4, 3), (128, 8, 8, 3), (64, 16, 4, 3), (128, 4, 4, 4), (32, 16, 4, 3)]:
    hd = mg._diag(x.device, "h", T * k, I // 32, G, f8)
    try:
        timed(f"down bn={bn} G={G} warps={warps} stages={stages}",
              lambda: mg._down_kernel[(-(-H // bn), k, T)](hd, hs, w2, s2, idx, wts, out, part, locks, H, I,
                                                            w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1),
                                                            BLOCK_N=bn, K_SLOTS=k, G=G, EVEN=(I // 32) % G == 0,
                                                            THREADS=32 * warps, INTERPRET=False, num_warps=warps,
                                                            num_stages=stages))
    except Exception as e:  # noqa: BLE001
        print(f"T={T} down bn={bn} G={G} warps={warps} stages={stages}: {type(e).__name__} {e}"[:200])
