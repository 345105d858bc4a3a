"""Count the launches of one decode step on CPU: the non-view aten ops (and our custom ops) the model issues,
by call site.  The batch-1 bound on Hopper, once weights stream at bandwidth, is the number of small kernels
per step; this counts them without a GPU.

By default the fast CUDA path's code runs (Marlin, fused norm, bf16 activations; vLLM's kernels swapped for
the stand-ins of tests/e2e/test_fast_path_emulated.py, whose own arithmetic is not counted: each stands for
one kernel call), as a padded static decode step (what CUDA captures).  ``--plain`` counts the dequantised
ops path instead.

    .venv/bin/python scripts/count_decode_ops.py [--plain] [--top 40]
    # the bench config's 40-layer layout at small widths (config only, dummy weights):
    .venv/bin/python -m vllm_dsv41.tools.make_checkpoint /tmp/benchsmall --preset bench --no-engram \
        --set hidden_size=256 --set q_lora_rank=128 --set o_lora_rank=128 --set head_dim=128 \
        --set num_attention_heads=4 --set o_groups=2 --set index_head_dim=64 --set index_n_heads=4 \
        --set moe_intermediate_size=128
    .venv/bin/python scripts/count_decode_ops.py --model /tmp/benchsmall --dummy
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# ops that make no kernel: views, allocations, metadata
NO_KERNEL = {"view", "_unsafe_view", "as_strided", "slice", "select", "t", "transpose", "expand", "unsqueeze",
             "squeeze", "reshape", "alias", "detach", "permute", "diagonal", "split", "narrow", "empty",
             "empty_strided", "new_empty", "empty_like", "lift_fresh", "unflatten"}
MAYBE_COPY = {"to", "contiguous", "flatten", "clone", "_to_copy"}


def launch_counter(sites: collections.Counter):
    """A dispatch mode that adds one to ``sites[(call site, op name)]`` for every op that launches a kernel: views,
    allocations and copies that return their input are not counted, nor the ops inside a test stand-in for a vLLM
    kernel; the call site is the two innermost frames of vllm_dsv41 outside ``ops/``."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args_=(), kwargs=None):
            out = func(*args_, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if name in NO_KERNEL:
                return out
            if (name in MAYBE_COPY and isinstance(out, torch.Tensor) and args_ and isinstance(args_[0], torch.Tensor)
                    and out.data_ptr() == args_[0].data_ptr() and out.dtype == args_[0].dtype):
                return out  # returned its input: no copy
            stack = traceback.extract_stack()
            if any("/tests/" in f.filename for f in stack[-6:]):
                return out  # inside a stand-in for a vLLM kernel
            ours = [f for f in stack if "vllm_dsv41" in f.filename and "/ops/" not in f.filename]
            site = " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(ours[-2:])) or "?"
            sites[(site, name)] += 1
            return out

    return Count()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "ckpt" / "tiny"))
    ap.add_argument("--plain", action="store_true", help="the dequantised ops path, not the emulated fast path")
    ap.add_argument("--dummy", action="store_true", help="load_format=dummy (a config-only checkpoint, e.g. the "
                    "bench layout at small widths)")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    os.environ.update(VLLM_DSV41_OPS="1", VLLM_DSV41_CUDAGRAPH="static", VLLM_DSV41_EXACT="1",
                      VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")

    import pytest
    import torch
    from vllm_dsv41.model_executor import graphs

    if not args.plain:
        from tests.e2e.test_fast_path_emulated import _emulate_fast_path

        _emulate_fast_path(pytest.MonkeyPatch(), torch.bfloat16)

    sites: collections.Counter = collections.Counter()

    run, seen = graphs.DecodeGraphs.run, []

    def counted(self, meta, input_ids, device, capture=True):
        model = self.run_model
        if len(seen) == 2:  # a steady decode step (keys already seen)
            self.run_model = lambda step: _under(launch_counter(sites), model, step)
        seen.append(meta.num_reqs)
        try:
            return run(self, meta, input_ids, device, capture)
        finally:
            self.run_model = model

    graphs.DecodeGraphs.run = counted
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=args.model, enforce_eager=True, dtype="bfloat16" if not args.plain else "float32",
              max_model_len=1024, max_num_seqs=4, seed=0, async_scheduling=False,
              load_format="dummy" if args.dummy else "auto")
    layers = llm.llm_engine.model_config.hf_config.num_hidden_layers
    g = torch.Generator().manual_seed(0)
    llm.generate([TokensPrompt(prompt_token_ids=[0] + torch.randint(3, 990, (130,), generator=g).tolist())],
                 SamplingParams(max_tokens=5, temperature=0), use_tqdm=False)
    total = sum(sites.values())
    print(f"{'emulated fast path' if not args.plain else 'dequantised ops path'}: {total} launches in one "
          f"batch-1 decode step, {total / layers:.1f} per layer ({layers} layers), excluding vLLM's own kernels")
    for (site, name), n in sorted(sites.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"{n:5d}  {name:22s} {site}")
    return 0


def _under(mode, fn, *a):
    with mode:
        return fn(*a)


if __name__ == "__main__":
    raise SystemExit(main())
