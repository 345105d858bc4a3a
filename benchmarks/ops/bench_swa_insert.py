"""Microbenchmark of ``dsv41::swa_insert``: the unfused torch write (the reference on the GPU) versus the
Triton kernel, at the production width (D = 512, R = 64).

    python benchmarks/ops/bench_swa_insert.py

Per T it prints the median time of ``swa_insert_ref`` (RMSNorm, RoPE, MXFP8 encode and scatter as
separate torch launches) and of the kernel, the speed-up, the bytes the op must move (kv rows in, records
out, weights) and the fraction of 4.8 TB/s the kernel reaches.  Not collected by pytest.
"""

import sys

import torch

from _common import HBM_BYTES_PER_S, open_gpu

D, R = 512, 64


def main() -> int:
    if open_gpu("bench_swa_insert") is None:
        return 0
    from triton.testing import do_bench

    from tests.ops.test_swa_insert import make_case
    from vllm_dsv41 import formats
    from vllm_dsv41.ops.swa_insert import _swa_insert_triton, swa_insert_ref

    rec = formats.mxfp8_record_bytes(D)
    print(f"{'T':>6}{'ref us':>10}{'triton us':>11}{'speed-up':>10}{'MB':>9}{'% 4.8TB/s':>11}")
    for T in (1, 8, 64, 512, 4096, 16384):
        kv, w, pos, inv, slots, cache = make_case(T, D, R, 2 * T + 7, start=60000, seed=T, device="cuda")
        slots = torch.randperm(2 * T + 7, device="cuda")[:T]  # every row writes
        t_ref = do_bench(lambda: swa_insert_ref(kv, w, 1e-20, pos, inv, slots, cache), return_mode="median") * 1e3
        t_tri = do_bench(lambda: _swa_insert_triton(kv, w, 1e-20, pos, inv, slots, cache),
                         return_mode="median") * 1e3
        nbytes = T * (D * 4 + rec + 16) + D * 4 + R * 2
        pct = nbytes / (t_tri * 1e-6) / HBM_BYTES_PER_S * 100
        print(f"{T:>6}{t_ref:>10.1f}{t_tri:>11.1f}{t_ref / t_tri:>10.1f}{nbytes / 1e6:>9.3f}{pct:>11.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
