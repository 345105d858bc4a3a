"""Microbenchmarks of ``dsv41::rope`` and ``dsv41::paged_rows``: the torch reference on the GPU versus the
Triton kernel, at the bench config's shapes.

    python benchmarks/ops/bench_rope_paged_rows.py

rope: the attention queries (64 heads x 512, rotary 64) and the indexer queries (32 x 128), bf16 and fp32; the
copying op (``dsv41::rope``, the model's path until session 12) against the in-place one (``dsv41::rope_``),
whose bytes are the rotated slice read and written.
paged_rows: one list of entries per row through a request's block table (int32 [64, 2080]: max_model_len
66k in 32-token blocks) to flat cache rows (int64), at the SWA width (128) and the top-k width (512).
Columns: median µs of each (rope: copy, in place; paged_rows: reference, Triton), the speed-up, the bytes the
second must move and its fraction of 4.8 TB/s.
Not collected by pytest.
"""

import sys

import torch

from _common import HBM_BYTES_PER_S, open_gpu


def _row(label: str, t_ref: float, t_tri: float, nbytes: int) -> str:
    pct = nbytes / (t_tri * 1e-6) / HBM_BYTES_PER_S * 100
    return f"{label:>28}{t_ref:>10.1f}{t_tri:>11.1f}{t_ref / t_tri:>10.1f}{nbytes / 1e6:>10.3f}{pct:>11.1f}"


def main() -> int:
    if open_gpu("bench_rope_paged_rows") is None:
        return 0
    from triton.testing import do_bench

    from vllm_dsv41.ops.paged_rows import _paged_rows_triton, paged_rows_ref
    from vllm_dsv41.ops.rope import _rope_inplace_triton, _rope_triton

    def us(fn) -> float:
        return do_bench(fn, return_mode="median") * 1e3

    print(f"{'case':>28}{'copy us':>10}{'in place':>11}{'speed-up':>10}{'MB':>10}{'% 4.8TB/s':>11}")
    inv = 1.0 / 10000.0 ** (torch.arange(0, 64, 2, device="cuda", dtype=torch.float32) / 64)
    for heads, D in ((64, 512), (32, 128)):
        for dtype in (torch.bfloat16, torch.float32):
            for T in (1, 64, 4096, 16384):
                x = torch.randn(T, heads, D, device="cuda", dtype=dtype)
                pos = torch.randint(0, 65536, (T,), device="cuda")
                nbytes = 2 * T * heads * 64 * x.element_size() + T * 8
                print(_row(f"rope {heads}x{D} {str(dtype)[6:]} T={T}", us(lambda: _rope_triton(x, pos, inv)),
                           us(lambda: _rope_inplace_triton(x, pos, inv)), nbytes), flush=True)
    print(f"{'case':>28}{'ref us':>10}{'triton us':>11}{'speed-up':>10}{'MB':>10}{'% 4.8TB/s':>11}")
    B, M, E = 64, 2080, 32
    table = torch.randint(1, 300000, (B, M), device="cuda", dtype=torch.int32)
    for K in (128, 512):
        for R in (1, 64, 4096):
            req = torch.randint(0, B, (R,), device="cuda")
            ent = torch.randint(-1, M * E, (R, K), device="cuda")
            nbytes = R * K * (8 + 8 + 4)  # entries in, rows out, one table word per entry
            print(_row(f"paged_rows K={K} R={R}", us(lambda: paged_rows_ref(table, req, ent, E, E * 33, 33)),
                       us(lambda: _paged_rows_triton(table, req, ent, E, E * 33, 33)), nbytes), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
