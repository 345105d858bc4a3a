"""``dsv41::ring_step``: the reference against the model's torch route (partner rows through the ring layer's own
read, then its masked write), and the Triton kernel against the reference, bitwise (interpreter on CPU, compiled on
CUDA).  The ring sits in a packed pool (block stride past its rows), as the engine allocates it, so the flat-row map
is not the identity.

``python -m tests.ops.test_ring --interpret`` (with TRITON_INTERPRET=1) is the interpreter run.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from tests.ops.conftest import requires_cuda, run_under_interpreter
from vllm_dsv41.attention.caches import CompressorRing
from vllm_dsv41.ops import ring as ring_op

CAP = 8


def _ring_layer(pool: torch.Tensor, nb: int, W: int, block_stride: int, offset: int) -> CompressorRing:
    """A compressor ring of ``nb`` blocks of CAP rows bound to a strided view of ``pool`` (no vLLM config)."""
    layer = CompressorRing.__new__(CompressorRing)
    nn.Module.__init__(layer)
    layer.prefix, layer.capacity = "model.layers.2.attn.compressor.state_cache", CAP
    layer.spec = SimpleNamespace(num_states=CAP, block_size=CAP)
    layer.kv_cache = pool.as_strided((nb, 1, CAP, W), (block_stride, CAP * W, W, 1), offset)
    return layer


def make_case(W: int, dtype: torch.dtype = torch.float32, seed: int = 0, device: str = "cpu") -> dict:
    """A step of 4 requests: request 0 a 12-row chunk (more rows than the ring holds: the step writes a slot some row
    reads, so reads must come first), 1 and 2 one decode row each (2 at position 0), 3 a 3-row chunk with no ring
    block (block 0: reads the null block, writes nothing); one of request 0's rows has slot -1."""
    g = torch.Generator().manual_seed(seed)
    nb = 6
    pool = torch.randn(nb * (CAP * W + 3 * W) + 5 * W, generator=g)
    layer = _ring_layer(pool, nb, W, CAP * W + 3 * W, 5 * W)
    req = torch.tensor([0] * 12 + [1, 2] + [3] * 3)
    pos = torch.cat((torch.arange(20, 32), torch.tensor([41, 0]), torch.arange(5, 8)))
    seq_lens = torch.tensor([32, 42, 1, 8], dtype=torch.int32)
    ring_blocks = torch.tensor([3, 1, 5, 0], dtype=torch.int32)
    slots = ring_blocks.long()[req] * CAP + pos % CAP
    slots = torch.where(ring_blocks.long()[req] > 0, slots, -1)
    slots[9] = -1
    rows = (torch.randn(req.numel(), W, generator=g) * 3).to(dtype)
    t = dict(rows=rows, pos=pos, req=req, seq_lens=seq_lens, ring_blocks=ring_blocks, slots=slots)
    t = {k: v.to(device) for k, v in t.items()}
    if device != "cpu":
        pool = pool.to(device)
        layer = _ring_layer(pool, nb, W, CAP * W + 3 * W, 5 * W)
    return {**t, "layer": layer, "pool": pool}


def op_args(c: dict) -> tuple:
    flat, bstep, rstep = c["layer"].flat_rows()
    return (c["rows"], c["pos"], c["req"], c["seq_lens"], c["ring_blocks"], c["slots"], flat, CAP, CAP, bstep, rstep)


def model_route(c: dict) -> torch.Tensor:
    """The model's torch route (``Attention._partners`` then ``_ring_write``) through the ring layer's own read and
    write."""
    layer, rows, pos, req = c["layer"], c["rows"], c["pos"], c["req"]
    t = torch.arange(rows.shape[0])
    before = (t - 1).clamp(min=0)
    in_step = (t > 0) & (req[before] == req) & (pos[before] == pos - 1)
    from_ring = layer.read(c["ring_blocks"].long()[req] * CAP + (pos - 1) % CAP)
    prev = torch.where(in_step[:, None], rows[before], from_ring)
    keep = pos > c["seq_lens"].long()[req] - 1 - CAP
    layer.write(torch.where(keep, c["slots"], torch.full_like(c["slots"], -1)), rows)
    return prev


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_the_models_route(dtype):
    a, b = make_case(64, dtype), make_case(64, dtype)
    want = model_route(a)
    got = ring_op.ring_step_ref(*op_args(b))
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert torch.equal(a["pool"], b["pool"])  # the same ring writes, nothing else touched
    # the case exercises what it claims: in-step partners, ring partners and a read of a slot the step rewrites
    assert torch.equal(got[1], b["rows"][0].float()) and not torch.equal(b["pool"], make_case(64, dtype)["pool"])


def test_registered_op_on_cpu_is_the_reference():
    a, b = make_case(32), make_case(32)
    assert torch.equal(torch.ops.dsv41.ring_step(*op_args(a)), ring_op.ring_step_ref(*op_args(b)))
    assert torch.equal(a["pool"], b["pool"])


def test_bad_shapes_are_named():
    args = list(op_args(make_case(32)))
    args[5] = args[5][:-1]
    with pytest.raises(ValueError, match="ring_slots must be"):
        ring_op.ring_step_ref(*args)


def test_fake_impl():
    torch.library.opcheck(torch.ops.dsv41.ring_step, op_args(make_case(32)), test_utils=("test_schema",
                                                                                        "test_faketensor"))


@pytest.mark.parametrize("rows", ["*fp32", "*bf16"])  # bf16: the model's rows beside its fp32 ring
@pytest.mark.parametrize("write", [False, True])
def test_kernel_builds_for_sm90(write, rows):
    """Both launches compile for Hopper (Triton's own ptxas, no GPU): the interpreter does not type-check the int64
    slot arithmetic or the scalar branches the way the compiler does (session 23: bf16 rows against the fp32 ring
    gave the read launch's two branches values of two types, which only the compiler rejects)."""
    from tests.ops.conftest import sm90_build

    kernel = ring_op._kernels()
    sig = {"rows_ptr": rows, "pos_ptr": "*i64", "req_ptr": "*i64", "seq_ptr": "*i32", "rb_ptr": "*i32",
           "slot_ptr": "*i64", "ring_ptr": "*fp32", "prev_ptr": "*fp32"}
    sig.update({n: "i32" for n in ("T", "W", "stride_rows", "stride_ring", "stride_prev", "capacity",
                                   "rows_per_block", "bstep", "rstep")})
    const = {"WRITE": write, "BLOCK": 1024}
    sig.update({n: "constexpr" for n in const})
    got = sm90_build(kernel, sig, const, 4)
    assert got["stack"] == 0, got


def _kernel_vs_ref(W: int, dtype: torch.dtype, device: str) -> None:
    a, b = make_case(W, dtype, seed=W, device=device), make_case(W, dtype, seed=W, device=device)
    got = ring_op._ring_step_triton(*op_args(a))
    want = ring_op.ring_step_ref(*op_args(b))
    assert got.dtype == want.dtype and torch.equal(got, want), f"W={W} {dtype}: partner rows differ"
    assert torch.equal(a["pool"], b["pool"]), f"W={W} {dtype}: ring writes differ"


def _interpreter_main() -> int:
    for W, dtype in ((64, torch.float32), (96, torch.bfloat16), (1024, torch.float32)):
        _kernel_vs_ref(W, dtype, "cpu")
        print(f"  ok W={W} {dtype}")
    return 0


def test_triton_interpreter():
    run_under_interpreter(["-m", "tests.ops.test_ring", "--interpret"])


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("W", [1024, 96])
def test_cuda_kernel_equals_reference(W, dtype):
    _kernel_vs_ref(W, dtype, "cuda")


if __name__ == "__main__" and "--interpret" in sys.argv:
    sys.exit(_interpreter_main())
