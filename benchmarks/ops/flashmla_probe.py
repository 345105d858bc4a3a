"""Can vLLM 0.32's FlashMLA sparse decode serve our KV records on this GPU, and how fast is it?

FlashMLA's interface (``vllm/third_party/flashmla/flash_mla_interface.py``) documents V4.1 formats that are
byte for byte our records: the 528-byte MXFP8 SWA record (512 E4M3 + 16 UE8M0 scales, one per 32) and, as
``extra_k_cache``, the 288-byte NVFP4 compressed record (256 bytes of E2M1 pairs, even element in the low
nibble, + 32 E4M3 scales, one per 16).  The page layout differs: in a FlashMLA page block the P data rows come
first and the P scale rows after them, where our pools keep each record's bytes together.  This probe
rearranges random records into that page layout, calls ``flash_mla_with_kvcache`` (sparse, with the sink,
the SWA list as ``indices`` and the compressed list as ``extra_indices_in_kvcache``), compares the output
with ``sparse_attn_ref`` at position 0 (FlashMLA does not apply the inverse RoPE; at position 0 it is the
identity) and times both (CUPTI kernel time per call, as ``kernel_times.py``).

GPU with vLLM 0.32 (the bundle) importable:

    PYTHONPATH=/tmp/site python3 benchmarks/ops/flashmla_probe.py --tokens 1 16 64 256
"""

from __future__ import annotations

import argparse
import sys
import traceback

import torch

import bench_sparse_attn as bsa
from _common import open_gpu
from kernel_times import kernel_us

from vllm_dsv41.ops import sparse_attn as sa


def page_split(records: torch.Tensor, page: int, data_bytes: int) -> torch.Tensor:
    """uint8 records [N, rec] (N a multiple of ``page``) -> FlashMLA's page layout [N/page, page, 1, rec]:
    in each page the ``page`` data rows, then the ``page`` scale rows."""
    n, rec = records.shape
    r = records.view(n // page, page, rec)
    data = r[:, :, :data_bytes].reshape(n // page, page * data_bytes)
    scales = r[:, :, data_bytes:].reshape(n // page, page * (rec - data_bytes))
    return torch.cat((data, scales), 1).view(n // page, page, 1, rec).contiguous()


def pad_rows(records: torch.Tensor, page: int) -> torch.Tensor:
    n = -(-records.shape[0] // page) * page
    return torch.cat((records, records.new_zeros(n - records.shape[0], records.shape[1])))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="*", default=[1, 16, 64, 256])
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args()
    if open_gpu("flashmla_probe") is None:
        return 0
    try:
        from vllm.third_party.flashmla.flash_mla_interface import flash_mla_with_kvcache, get_mla_metadata
    except Exception as exc:  # noqa: BLE001 - report and stop
        print(f"flashmla: not importable: {type(exc).__name__}: {exc}")
        return 0

    for T in a.tokens:
        for holes in (0.0, 0.05):  # without and with -1 entries inside the SWA lists
            c = bsa.decode_case(T, T)
            drop = torch.rand(c["swa_slots"].shape, device="cuda") < holes
            c["swa_slots"] = torch.where(drop, -1, c["swa_slots"])
            c["positions"] = torch.zeros_like(c["positions"])
            ref = sa.sparse_attn_ref(*bsa._args(c)).float()
            ours, _ = kernel_us(lambda: sa._sparse_attn_triton(*bsa._args(c)), a.iters)

            swa = page_split(pad_rows(c["swa_cache"], a.page), a.page, 512)
            comp = page_split(pad_rows(c["comp_cache"], a.page), a.page, 256)
            q = c["q"].unsqueeze(1).contiguous()                                    # [T, 1, 64, 512]
            idx = c["swa_slots"].int().unsqueeze(1).contiguous()                    # [T, 1, 128]
            eidx = c["comp_slots"].int().unsqueeze(1).contiguous()                  # [T, 1, 512]
            lens = torch.full((T,), idx.shape[-1], dtype=torch.int32, device="cuda")
            elens = torch.full((T,), eidx.shape[-1], dtype=torch.int32, device="cuda")
            meta = get_mla_metadata()[0]

            def call():
                return flash_mla_with_kvcache(q=q, k_cache=swa, block_table=None, cache_seqlens=None,
                                              head_dim_v=512, tile_scheduler_metadata=meta,
                                              softmax_scale=c["scale"], is_fp8_kvcache=True, indices=idx,
                                              topk_length=lens, attn_sink=c["sink"].float(), extra_k_cache=comp,
                                              extra_indices_in_kvcache=eidx, extra_topk_length=elens)[0]

            try:
                out = call().squeeze(1).float()
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - the probe's answer
                print(f"T={T}: FlashMLA refused our formats: {type(exc).__name__}: {str(exc)[:300]}")
                traceback.print_exc(limit=2)
                return 0
            err = ((out - ref).norm() / ref.norm()).item()
            fm, per = kernel_us(call, a.iters)
            top = ", ".join(f"{k} {v:.1f}" for k, v in sorted(per.items(), key=lambda kv: -kv[1])[:3])
            print(f"T={T:5d} holes {holes:.2f}: rel err vs reference {err:.2e} (ours bf16 ~4e-3); kernel time "
                  f"ours {ours:8.1f} µs, FlashMLA {fm:8.1f} µs  [{top}]", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
