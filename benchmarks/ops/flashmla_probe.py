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

``--sparse-fwd`` probes FlashMLA's sparse *prefill* kernel (``flash_mla_sparse_fwd``: bf16 keys, per-row
indices, the sink), which the built-in V4.1 runs on Hopper after dequantising the keys a chunk can see into
a bf16 workspace: the records of a decode case and of a 4,096-row prefill case (one request at positions
8,192..) are decoded to bf16 once, the SWA and compressed lists become indices into that table, and the
kernel is timed against ``sparse_attn`` on the records (the workspace's decode is not in its time).

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
    ap.add_argument("--sparse-fwd", type=int, nargs="*", default=None, metavar="T",
                    help="probe flash_mla_sparse_fwd on decode cases of these T and a 4096-row prefill case")
    a = ap.parse_args()
    if open_gpu("flashmla_probe") is None:
        return 0
    try:
        from vllm.third_party.flashmla.flash_mla_interface import (flash_mla_sparse_fwd, flash_mla_with_kvcache,
                                                                   get_mla_metadata)
    except Exception as exc:  # noqa: BLE001 - report and stop
        print(f"flashmla: not importable: {type(exc).__name__}: {exc}")
        return 0
    if a.sparse_fwd is not None:
        return probe_sparse_fwd(flash_mla_sparse_fwd, a.sparse_fwd, a.iters)

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


def probe_sparse_fwd(sparse_fwd, tokens: list[int], iters: int) -> int:
    """``flash_mla_sparse_fwd`` on keys decoded to bf16 (see the module docstring)."""
    from vllm_dsv41 import formats

    cases = [(f"decode T={t}", bsa.decode_case(t, t)) for t in tokens]
    cases.append(("prefill T=4096", bsa.prefill_case(4096, 4096)))
    for name, c in cases:
        c["positions"] = torch.zeros_like(c["positions"])
        D = c["q"].shape[-1]
        n_swa = c["swa_cache"].shape[0]
        kv = torch.cat((formats.decode_mxfp8_record(c["swa_cache"], D),
                        formats.decode_nvfp4_record(c["comp_cache"], D))).bfloat16().unsqueeze(1).contiguous()
        comp = c["comp_slots"].long()
        idx = torch.cat((c["swa_slots"].long(), torch.where(comp >= 0, comp + n_swa, -1)), 1)
        idx = idx.int().unsqueeze(1).contiguous()                                # [T, 1, W + K]
        ref = sa.sparse_attn_ref(*bsa._args(c)).float()
        ours, _ = kernel_us(lambda: sa._sparse_attn_triton(*bsa._args(c)), iters)

        def call():
            return sparse_fwd(c["q"].contiguous(), kv, idx, c["scale"], 512, attn_sink=c["sink"].float())[0]

        try:
            out = call().float()
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - the probe's answer
            print(f"{name}: flash_mla_sparse_fwd failed: {type(exc).__name__}: {str(exc)[:300]}")
            continue
        err = ((out - ref).norm() / ref.norm()).item()
        fm, per = kernel_us(call, iters)
        top = ", ".join(f"{k} {v:.1f}" for k, v in sorted(per.items(), key=lambda kv: -kv[1])[:3])
        print(f"{name}: rel err vs reference {err:.2e}; kernel time sparse_attn on records {ours:9.1f} µs, "
              f"flash_mla_sparse_fwd on bf16 keys {fm:9.1f} µs  [{top}]", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
