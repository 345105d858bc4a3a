"""The runner's host work outside the model forward, per decode step, on any machine (CPU included).

At batch 1 a decode step on the H200 took 10.36 ms of GPU and 5.50 ms of host time (docs/benchmarks.md, session 21),
so the host does not set the pace today; at the issue's 2x target (~4.5 ms a step) it might.  What the host does
outside the forward (vLLM's input preparation, our step metadata, the static step's padding and loads, sampling)
does not depend on the width of the model, only on its layer layout (cache groups, KV sources) and the batch: this
script serves a checkpoint of the ``tiny`` preset's widths on the ``full`` preset's 40-layer layout (written into
``--ckpt`` unless it holds one already), greedy, and times the runner's methods with ``perf_counter`` wrappers:

    python benchmarks/e2e/host_overhead.py --batch 1 --steps 64

``execute_model`` minus ``_model_forward`` is the host work around the forward; inside the forward, on CPU the
static step is run eagerly (no capture), so ``StaticStep.__init__`` runs each step there and once per bucket on CUDA.
The figures are the host's (CPU speed matters: compare on one machine only).
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The full preset's layer layout; the tiny preset's widths.
LAYOUT_KEYS = ("num_hidden_layers", "compress_ratios", "kv_source_layer_ids", "index_source_layer_ids",
               "candidate_source_layer_id", "dspark_target_layer_ids")


def write_layout_checkpoint(out: str) -> None:
    from vllm_dsv41 import presets
    from vllm_dsv41.tools.make_checkpoint import make_checkpoint

    full = presets.preset("full")
    make_checkpoint(out, preset="tiny", overrides={k: full[k] for k in LAYOUT_KEYS}, no_engram=True)


def _timed(times: dict[str, list[float]], owner, name: str, key: str) -> None:
    """``owner.name`` appending each call's seconds to ``times[key]``."""
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def run(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            times[key].append(time.perf_counter() - t)

    setattr(owner, name, run)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", default="/tmp/dsv41_host_overhead", help="checkpoint dir (written if it has none)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=300, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=64, help="tokens generated per request")
    ap.add_argument("--graphs", default="static", help="VLLM_DSV41_CUDAGRAPH for the run (static, 0, auto)")
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ["VLLM_DSV41_CUDAGRAPH"] = args.graphs
    os.environ.setdefault("VLLM_DSV41_OPS", "1")  # the ops path, as on CUDA (the static steps need it)
    sys.path.insert(0, ROOT)
    if not os.path.exists(os.path.join(args.ckpt, "config.json")):
        write_layout_checkpoint(args.ckpt)

    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_dsv41.model_executor import graphs

    times: dict[str, list[float]] = collections.defaultdict(list)
    for name in ("execute_model", "_model_forward", "_prepare_inputs", "_build_attention_metadata", "sample_tokens",
                 "_update_states"):
        _timed(times, GPUModelRunner, name, name)
    _timed(times, graphs.DecodeGraphs, "run", "DecodeGraphs.run")
    _timed(times, graphs.StaticStep, "load", "StaticStep.load")
    _timed(times, graphs.StaticStep, "__init__", "StaticStep.__init__")

    cuda = torch.cuda.is_available()
    llm = LLM(model=args.ckpt, enforce_eager=not cuda, dtype="bfloat16" if cuda else "float32",
              max_model_len=max(1024, args.prompt + args.steps + 16), max_num_seqs=max(8, args.batch), seed=0)
    prompts = [TokensPrompt(prompt_token_ids=[0] + [3 + (i * 7 + j) % 900 for j in range(args.prompt - 1)])
               for i in range(args.batch)]
    sp = SamplingParams(temperature=0.0, max_tokens=args.steps, ignore_eos=True)
    llm.generate(prompts, sp, use_tqdm=False)  # warm-up: first steps, buckets, caches
    times.clear()
    t0 = time.perf_counter()
    llm.generate(prompts, sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    print(f"batch {args.batch}, prompt {args.prompt}, {args.steps} steps, VLLM_DSV41_CUDAGRAPH={args.graphs}, "
          f"{'cuda' if cuda else 'cpu'}; wall {wall:.2f} s")
    # medians: the prefill step (one of the calls) does not move them
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    for key in sorted(med, key=lambda k: -med[k]):
        print(f"  {key:28s} {len(times[key]):5d} calls, median {med[key]:9.3f} ms")
    outside = [(e - f + s) * 1e3 for e, f, s in zip(times["execute_model"], times["_model_forward"],
                                                     times["sample_tokens"])]
    print(f"host work outside the forward (execute_model - _model_forward + sample_tokens): median "
          f"{statistics.median(outside):.3f} ms a step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
