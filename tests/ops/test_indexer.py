"""torch.ops.dsv41.index_scores: the reference against ``reference.index_scores`` over decoded keys
(CPU), the inline-PTX dequantiser against formats (CPU emulation of its instructions), the Triton
kernel in the interpreter (subprocess, CPU tensors) and on CUDA at the real sizes.

``python -m tests.ops.test_indexer --interpret`` (with TRITON_INTERPRET=1 in the environment) is
the interpreter run; the pytest case below starts it.
"""

from __future__ import annotations

import os
import re
import sys
import time

import numpy as np
import pytest
import torch

from tests.ops.conftest import assert_close, requires_cuda, run_under_interpreter
from vllm_dsv41 import formats
from vllm_dsv41.ops import indexer as ix
from vllm_dsv41.reference.model import index_scores

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# --------------------------------------------------------------------------- case builders


def make_case(T: int, IH: int, ID: int, n_vis: list[int], req_of_row: list[int], rows_per_block: int,
              n_max: int, *, seed: int = 0, q_dtype: torch.dtype = torch.float32, spread: int = 6,
              spare_blocks: int = 3, device: str = "cpu") -> dict:
    """Random keys in a paged MXFP4 cache (blocks shuffled across requests, garbage in spare
    blocks and beyond each request's visible entries), queries and head weights."""
    g = torch.Generator().manual_seed(seed)
    n_req = max(req_of_row) + 1
    per_req = [max([n for n, r in zip(n_vis, req_of_row) if r == i] + [0]) for i in range(n_req)]
    blocks = [max(1, -(-n // rows_per_block)) for n in per_req]
    n_blocks = sum(blocks) + spare_blocks
    perm = torch.randperm(n_blocks, generator=g)
    table = torch.full((n_req, max(blocks) + 2), 10 ** 6, dtype=torch.int32)  # never-read entries are junk
    used = 0
    for i, b in enumerate(blocks):
        table[i, :b] = perm[used:used + b].to(torch.int32)
        used += b
    n_slots = n_blocks * rows_per_block
    gexp = torch.randint(-spread, spread + 1, (n_slots, ID // 32), generator=g).float()
    keys = torch.randn(n_slots, ID, generator=g) * torch.exp2(gexp).repeat_interleave(32, 1)
    q = (torch.randn(T, IH, ID, generator=g) * 2).to(q_dtype)
    w = torch.randn(T, IH, generator=g) / (IH * ID) ** 0.5
    return dict(q=q.to(device), w=w.to(device), idx_cache=formats.encode_mxfp4_record(keys).to(device),
                block_table=table.to(device), rows_per_block=rows_per_block,
                req_of_row=torch.tensor(req_of_row, dtype=torch.int32, device=device),
                n_vis=torch.tensor(n_vis, dtype=torch.int32, device=device), n_max=n_max)


def args(c: dict) -> tuple:
    return (c["q"], c["w"], c["idx_cache"], c["block_table"], c["rows_per_block"], c["req_of_row"], c["n_vis"],
            c["n_max"])


def per_row_oracle(c: dict) -> torch.Tensor:
    """Row by row: decode the request's first n_vis records and call reference.index_scores."""
    T, _, ID = c["q"].shape
    out = torch.full((T, c["n_max"]), float("-inf"))
    rpb = c["rows_per_block"]
    for t in range(T):
        n = min(int(c["n_vis"][t]), c["n_max"])
        if n == 0:
            continue
        e = torch.arange(n)
        slots = c["block_table"][int(c["req_of_row"][t])].long().cpu()[e // rpb] * rpb + e % rpb
        keys = formats.decode_mxfp4_record(c["idx_cache"].cpu()[slots], ID)
        out[t, :n] = index_scores(c["q"][t:t + 1].float().cpu(), c["w"][t:t + 1].float().cpu(), keys)[0]
    return out


def check_scores(name: str, ref: torch.Tensor, got: torch.Tensor, ratio: float) -> None:
    ref, got = ref.cpu(), got.cpu()
    assert got.shape == ref.shape and got.dtype == torch.float32, f"{name}: {got.shape} {got.dtype}"
    fin = torch.isfinite(ref)
    assert torch.equal(fin, torch.isfinite(got)), f"{name}: -inf pattern differs"
    assert (got[~fin] == float("-inf")).all(), f"{name}: masked entries must be -inf"
    if fin.any():
        assert_close(name, ref[fin], got[fin], ratio=ratio)


# --------------------------------------------------------------------------- CPU: reference

_CPU_CASES = {
    "ID32-IH12": dict(T=5, IH=12, ID=32, n_vis=[0, 37, 100, 5, 64], req_of_row=[0, 1, 1, 2, 0], rows_per_block=16,
                      n_max=130),
    "ID128-IH32-bf16": dict(T=4, IH=32, ID=128, n_vis=[300, 301, 1, 700], req_of_row=[1, 1, 0, 2],
                            rows_per_block=64, n_max=700, q_dtype=torch.bfloat16),
    "clip-n_max": dict(T=3, IH=8, ID=64, n_vis=[90, 20, 0], req_of_row=[0, 0, 1], rows_per_block=32, n_max=50),
}


@pytest.mark.parametrize("name", list(_CPU_CASES))
def test_ref_equals_reference_index_scores(name):
    c = make_case(**_CPU_CASES[name], seed=len(name))
    got = ix.index_scores_ref(*args(c))
    want = per_row_oracle(c)
    assert torch.equal(torch.isfinite(got), torch.isfinite(want))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * want[torch.isfinite(want)].abs().max().item())


def test_ref_chunks_keys(monkeypatch):
    c = make_case(**_CPU_CASES["ID128-IH32-bf16"], seed=3)
    whole = ix.index_scores_ref(*args(c))
    monkeypatch.setattr(ix, "_REF_CHUNK", 96)
    torch.testing.assert_close(ix.index_scores_ref(*args(c)), whole, rtol=1e-6, atol=1e-6)


def test_op_dispatches_to_reference_on_cpu():
    c = make_case(**_CPU_CASES["ID32-IH12"], seed=1)
    assert torch.equal(torch.ops.dsv41.index_scores(*args(c)), ix.index_scores_ref(*args(c)))


def test_opcheck_schema_and_fake():
    c = make_case(**_CPU_CASES["ID32-IH12"], seed=2)
    torch.library.opcheck(torch.ops.dsv41.index_scores.default, args(c),
                          test_utils=("test_schema", "test_faketensor"))


def test_bad_shapes_raise():
    c = make_case(**_CPU_CASES["ID32-IH12"], seed=2)
    a = list(args(c))
    bad = list(a)
    bad[1] = a[1][:, :3]
    with pytest.raises(ValueError):
        ix.index_scores_ref(*bad)
    bad = list(a)
    bad[2] = torch.zeros(4, 20, dtype=torch.uint8)
    with pytest.raises(ValueError):
        ix.index_scores_ref(*bad)
    bad = list(a)
    bad[6] = a[6][:2]
    with pytest.raises(ValueError):
        ix.index_scores_ref(*bad)


# --------------------------------------------------------------------------- CPU: the PTX dequantiser


_E4M3_TO_F16_BITS = (torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
                     .to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF).tolist()


def _f16(bits: int) -> float:
    return float(np.array([bits], dtype=np.uint16).view(np.float16)[0])


def _f16_bits(x: float) -> int:
    return int(np.array([x], dtype=np.float16).view(np.uint16)[0])


def _emulate_ptx(src: str, regs: dict[str, int]) -> dict[str, int]:
    """Run the straight-line PTX subset of ``_DECODE_PTX_SRC`` on Python integers (one instance)."""
    def val(x: str) -> int:
        x = x.strip()
        return int(x, 0) if x[0].isdigit() else regs[x]

    for line in src.strip().splitlines():
        line = line.strip().rstrip(";")
        if line in ("{", "}") or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        ops = [o.strip() for o in re.split(r",(?![^{]*})", rest)]
        if op == "mov.b32":  # {lo, hi}, src
            lo, hi = ops[0].strip("{}").split(",")
            v = val(ops[1])
            regs[lo.strip()], regs[hi.strip()] = v & 0xFFFF, v >> 16
        elif op in ("shl.b32", "shr.b32", "and.b32", "or.b32"):
            a, b = val(ops[1]), val(ops[2])
            fn = {"shl.b32": lambda: a << b, "shr.b32": lambda: a >> b, "and.b32": lambda: a & b,
                  "or.b32": lambda: a | b}[op]
            regs[ops[0]] = fn() & 0xFFFFFFFF
        elif op == "cvt.rn.f16x2.e4m3x2":  # byte i -> half i
            v = val(ops[1])
            regs[ops[0]] = _E4M3_TO_F16_BITS[v & 0xFF] | (_E4M3_TO_F16_BITS[(v >> 8) & 0xFF] << 16)
        elif op == "mul.rn.f16x2":  # exact product (float64), one rounding to fp16
            a, b = val(ops[1]), val(ops[2])
            regs[ops[0]] = sum(_f16_bits(_f16((a >> 16 * h) & 0xFFFF) * _f16((b >> 16 * h) & 0xFFFF)) << 16 * h
                               for h in (0, 1))
        else:
            raise AssertionError(f"unhandled PTX: {line}")
    return regs


def test_ptx_dequantiser_matches_formats():
    """Every byte value, in every byte lane, against formats' E2M1 table x 2^-6 x factor (fp16)."""
    src = ix._DECODE_PTX_SRC
    table = formats.E2M1_VALUES.tolist()
    rng = np.random.default_rng(0)
    factors = [1.0, 0.5, 2.0 ** -10, 2.0 ** -20, 2.0 ** -24, 0.0]
    for lane_shift in range(4):
        for start in range(0, 256, 4):
            b = [(start + (i + lane_shift) % 4) for i in range(4)]
            fac = [factors[i] for i in rng.integers(0, len(factors), 4)]
            fb = [_f16_bits(f) for f in fac]
            regs = _emulate_ptx(src, {"$4": b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24,
                                      "$5": fb[0] | fb[1] << 16, "$6": fb[2] | fb[3] << 16})
            halves = [regs[r] >> 16 * h & 0xFFFF for r in ("$0", "$1", "$2", "$3") for h in (0, 1)]
            for lane in range(4):
                for nib, got in ((b[lane] & 15, halves[lane]), (b[lane] >> 4, halves[4 + lane])):
                    want = _f16_bits(table[nib] * 2.0 ** -6 * fac[lane])
                    assert got == want, f"byte {b[lane]:#x} nibble {nib} factor {fac[lane]}: {got:#x} != {want:#x}"


# --------------------------------------------------------------------------- Triton (interpreter / CUDA)

# name -> case kwargs (small shapes; the kernel's tiles are 128 records)
_INTERP_CASES = {
    "ID32-IH12-fp32": dict(T=5, IH=12, ID=32, n_vis=[0, 37, 100, 5, 64], req_of_row=[0, 1, 1, 2, 0],
                           rows_per_block=16, n_max=130),
    "ID64-IH32-fp32-3tiles": dict(T=3, IH=32, ID=64, n_vis=[300, 129, 1], req_of_row=[0, 1, 0],
                                  rows_per_block=32, n_max=333),
    "ID128-IH32-bf16": dict(T=2, IH=32, ID=128, n_vis=[200, 90], req_of_row=[1, 0], rows_per_block=64,
                            n_max=256, q_dtype=torch.bfloat16),
    "ID128-wide-exponents": dict(T=2, IH=16, ID=128, n_vis=[150, 40], req_of_row=[0, 0], rows_per_block=128,
                                 n_max=150, spread=40),
    "ID64-4tiles-per-program": dict(T=3, IH=16, ID=64, n_vis=[700, 129, 0], req_of_row=[0, 1, 0],
                                    rows_per_block=64, n_max=1100, tiles=4),
}


def _interpreter_main() -> int:
    assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 before Python starts"
    failed = 0
    for name, kw in _INTERP_CASES.items():
        kw = dict(kw)
        tiles = kw.pop("tiles", None)
        c = make_case(**kw, seed=len(name))
        t0 = time.perf_counter()
        got = ix._index_scores_triton(*args(c), tiles=tiles)
        dt = time.perf_counter() - t0
        try:
            check_scores(name, ix.index_scores_ref(*args(c)), got, ratio=1e-5)
            print(f"  ok {name} ({dt:.1f} s)")
        except AssertionError as e:
            failed += 1
            print(f"FAIL {name}: {e}")
    return 1 if failed else 0


def test_triton_interpreter():
    run_under_interpreter(["-m", "tests.ops.test_indexer", "--interpret"])


REAL = dict(IH=32, ID=128, rows_per_block=64)


def _real_case(T: int, N: int, q_dtype: torch.dtype, seed: int) -> dict:
    """T rows over a few requests; row i sees a ragged prefix of its request's N entries."""
    g = torch.Generator().manual_seed(seed)
    req = [i % max(1, min(T, 4)) for i in range(T)]
    n_vis = [N if i < 2 else int(torch.randint(0, N + 1, (1,), generator=g)) for i in range(T)]
    return make_case(T=T, n_vis=n_vis, req_of_row=req, n_max=N, seed=seed, q_dtype=q_dtype, device="cuda", **REAL)


@requires_cuda
@pytest.mark.parametrize("decode", ["asm", "portable"])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=["q32", "q16"])
@pytest.mark.parametrize("T,N", [(1, 4096), (1, 70_000), (64, 4096), (7, 20_000)])
def test_cuda_real_sizes(T, N, q_dtype, decode):
    c = _real_case(T, N, q_dtype, seed=T + N)
    got = ix._index_scores_triton(*args(c), decode=decode)
    check_scores(f"T{T}-N{N}-{decode}", ix.index_scores_ref(*args(c)), got, ratio=1e-5)


@requires_cuda
def test_cuda_op_and_oracle():
    c = _real_case(3, 5000, torch.float32, seed=1)
    got = torch.ops.dsv41.index_scores(*args(c))
    check_scores("op-vs-oracle", per_row_oracle(c), got, ratio=1e-5)


if __name__ == "__main__":
    if "--interpret" in sys.argv:
        sys.exit(_interpreter_main())
