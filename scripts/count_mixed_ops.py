"""Count the launches of one eager mixed step on CPU (decode rows of many requests plus prefill chunks): the
non-view aten ops and our custom ops the model issues, by call site, and how they grow with the requests in the
step.  On an H200 the prefill and mixed steps of the batch-64 workload are host-bound (~60-130 µs of host time
a launch, docs/benchmarks.md sessions 13-16): a launch count that grows with the requests is host time that the
GPU waits through.

The emulated fast CUDA path runs (as in ``scripts/count_decode_ops.py``), eagerly (no decode graphs).  Each run
prefills ``--reqs`` requests of ``--prompt`` tokens in one step, then decodes them together while one more
request's prompt arrives: that step is counted (``reqs`` decode rows + one prefill chunk).

    .venv/bin/python scripts/count_mixed_ops.py --model /tmp/benchsmall --dummy --reqs 4 16
    # /tmp/benchsmall: see scripts/count_decode_ops.py
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "ckpt" / "tiny"))
    ap.add_argument("--dummy", action="store_true", help="load_format=dummy (a config-only checkpoint)")
    ap.add_argument("--reqs", type=int, nargs="+", default=[4, 16], help="decode rows of the counted step")
    ap.add_argument("--prompt", type=int, default=200)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    os.environ.update(VLLM_DSV41_OPS="1", VLLM_DSV41_CUDAGRAPH="0", VLLM_DSV41_EXACT="1",
                      VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="2",
                      VLLM_DSV41_MOE_BF16_FROM="0", VLLM_DSV41_MOE_FP8_FROM="0")  # no stand-ins for those

    import pytest
    import torch
    from scripts.count_decode_ops import launch_counter
    from tests.e2e.test_fast_path_emulated import _emulate_fast_path
    from vllm_dsv41.model_executor import model as model_mod

    _emulate_fast_path(pytest.MonkeyPatch(), torch.bfloat16)
    counts: dict[int, collections.Counter] = {}

    final_hidden = model_mod.DeepseekV41ForCausalLM._final_hidden
    want: dict = {}

    def counted(self, step, e):
        meta = step.meta
        n = meta.num_tokens
        if "reqs" in want and meta.num_reqs == want["reqs"] + 1 and n > meta.num_reqs:
            sites = counts.setdefault(want.pop("reqs"), collections.Counter())
            with launch_counter(sites):
                return final_hidden(self, step, e)
        return final_hidden(self, step, e)

    model_mod.DeepseekV41ForCausalLM._final_hidden = counted
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    top = max(args.reqs)
    llm = LLM(model=args.model, enforce_eager=True, dtype="bfloat16", max_model_len=4 * args.prompt,
              max_num_seqs=top + 1, max_num_batched_tokens=(top + 1) * args.prompt, seed=0,
              async_scheduling=False, load_format="dummy" if args.dummy else "auto")
    layers = llm.llm_engine.model_config.hf_config.num_hidden_layers
    engine = llm.llm_engine
    g = torch.Generator().manual_seed(0)
    for r in args.reqs:
        def prompt():
            return TokensPrompt(prompt_token_ids=torch.randint(3, 990, (args.prompt,), generator=g).tolist())
        sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        for i in range(r):
            engine.add_request(f"r{r}-{i}", prompt(), sp)
        engine.step()  # the r prompts in one step
        want["reqs"] = r
        engine.add_request(f"r{r}-late", prompt(), sp)
        while engine.has_unfinished_requests():
            engine.step()
        if r not in counts:
            raise SystemExit(f"no mixed step of {r} decode rows + one prefill was seen")
    for r in args.reqs:
        total = sum(counts[r].values())
        print(f"{r} decode rows + one {args.prompt}-token prefill: {total} launches, {total / layers:.1f} per layer "
              f"({layers} layers), excluding vLLM's own kernels")
    lo, hi = min(args.reqs), max(args.reqs)
    grow = {k: counts[hi][k] - counts[lo].get(k, 0) for k in counts[hi]}
    print(f"\ngrowth from {lo} to {hi} decode rows, by site:")
    for (site, name), d in sorted(grow.items(), key=lambda kv: -kv[1])[: args.top]:
        if d:
            print(f"{d:+6d}  {name:22s} {site}")
    print(f"\nat {hi} decode rows, by site:")
    for (site, name), n in sorted(counts[hi].items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"{n:6d}  {name:22s} {site}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
