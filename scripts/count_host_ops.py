"""Count the ops a decode step issues on the host outside its captured CUDA graph: the metadata builders
(``DSV41CacheMetadataBuilder.build``, once per KV-cache group) and the copies into the graph's static
buffers (``StaticStep.load``).  Without async scheduling these launches sit between two graph replays.
CPU, padded static decode steps (what CUDA captures), by op name.

    .venv/bin/python scripts/count_host_ops.py --model /tmp/benchsmall --batch 1
    # /tmp/benchsmall: the bench layout at small widths, see scripts/count_decode_ops.py
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.update(VLLM_DSV41_OPS="1", VLLM_DSV41_CUDAGRAPH="static", VLLM_ENABLE_V1_MULTIPROCESSING="0",
                  VLLM_CPU_KVCACHE_SPACE="1")

from scripts.count_decode_ops import NO_KERNEL  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "ckpt" / "tiny"))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=8, help="decode steps counted")
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args()

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_dsv41.attention import backend
    from vllm_dsv41.model_executor import graphs

    counts: collections.Counter = collections.Counter()
    loads = [0]

    class Count(TorchDispatchMode):
        def __init__(self, where: str):
            super().__init__()
            self.where = where

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__.split(".")[0]
            if name not in NO_KERNEL:
                counts[(self.where, name)] += 1
            return func(*args, **(kwargs or {}))

    build, load = backend.DSV41CacheMetadataBuilder.build, graphs.StaticStep.load

    def counted_build(self, *a, **k):
        with Count("build"):
            return build(self, *a, **k)

    def counted_load(self, *a, **k):
        loads[0] += 1
        with Count("load"):
            return load(self, *a, **k)

    backend.DSV41CacheMetadataBuilder.build = counted_build
    graphs.StaticStep.load = counted_load
    llm = LLM(model=args.model, load_format="dummy", async_scheduling=False, max_model_len=4096,
              max_num_seqs=max(64, args.batch), seed=0, dtype="float32")
    g = torch.Generator().manual_seed(0)

    def run(n_out: int) -> None:
        prompts = [TokensPrompt(prompt_token_ids=torch.randint(3, 900, (300,), generator=g).tolist())
                   for _ in range(args.batch)]
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True), use_tqdm=False)

    run(4)  # first steps of each kind: graphs made
    counts.clear()
    loads[0] = 0
    run(1 + args.steps)  # one prefill step + args.steps decode steps
    n = loads[0]
    per = collections.Counter()
    for (where, _), c in counts.items():
        per[where] += c
    print(f"batch {args.batch}: {n} decode steps; builders {per['build'] / (n + 1):.1f} ops per step (the prefill "
          f"step's included), static-buffer loads {per['load'] / max(n, 1):.1f} ops per decode step")
    for (where, name), c in counts.most_common(args.top):
        print(f"  {where:5s} {name:24s} {c / max(n, 1):7.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
