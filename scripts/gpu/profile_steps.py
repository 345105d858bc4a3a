"""Where a bench-config step spends its GPU time: kernels by name, count and total time.

One engine (bench checkpoint, dummy weights, our plugin), then under ``torch.profiler``:
  1. batch-1 decode through the captured graphs (per-token latency, kernels inside the graphs);
  2. the same decode eagerly (graphs switched off on the model): the launch count of one step;
  3. one prefill chunk of ``--prefill`` tokens.
Prints the top kernels of each and writes the full tables to $OUT.

    PYTHONPATH=/tmp/site OUT=$OUT python3 scripts/gpu/profile_steps.py /tmp/bench
"""

from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")


def kernel_table(prof, gpu: bool) -> list[tuple[str, int, float]]:
    """(kernel name, launches, total µs) of the GPU kernels the profiler saw, largest total first (on a
    machine without a GPU, the aten ops and their own CPU time: the script's dry run)."""
    agg: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if gpu and e.device_type.name == "CUDA" and e.device_time > 0:
            t = e.device_time
        elif not gpu and e.name.startswith("aten::"):
            t = e.self_cpu_time_total
        else:
            continue
        row = agg[e.name[:90]]
        row[0] += 1
        row[1] += t
    return sorted(((k, int(v[0]), v[1]) for k, v in agg.items()), key=lambda r: -r[2])


def report(title: str, rows: list[tuple[str, int, float]], steps: int, out: str, top: int = 25) -> None:
    n = sum(r[1] for r in rows)
    t = sum(r[2] for r in rows)
    print(f"\n== {title}: {n / steps:.0f} kernels and {t / steps / 1e3:.2f} ms of kernel time per step "
          f"({steps} steps)")
    for name, cnt, us in rows[:top]:
        print(f"  {us / steps:9.1f} µs/step {cnt / steps:7.1f} launches/step  {name}")
    with open(os.path.join(out, title.replace(" ", "_") + ".tsv"), "w") as f:
        f.write("kernel\tlaunches_per_step\tus_per_step\n")
        for name, cnt, us in rows:
            f.write(f"{name}\t{cnt / steps:.2f}\t{us / steps:.2f}\n")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--decode", type=int, default=16, help="decode steps profiled")
    ap.add_argument("--prefill", type=int, default=16384)
    args = ap.parse_args()
    out = os.environ.get("OUT", "/tmp")

    import torch
    from torch.profiler import ProfilerActivity, profile
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    gpu = torch.cuda.is_available()
    activities = [ProfilerActivity.CUDA if gpu else ProfilerActivity.CPU]
    t0 = time.perf_counter()
    extra = dict(kv_cache_memory_bytes=16 << 30) if gpu else dict(dtype="float32")
    llm = LLM(model=args.model, load_format="dummy", async_scheduling=False, max_model_len=args.prefill + 1024,
              max_num_seqs=64, seed=0, **extra)
    print(f"engine start {time.perf_counter() - t0:.1f} s", flush=True)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    ids = torch.randint(3, vocab - 64, (args.prefill + args.context + 300,)).tolist()

    def gen(n_prompt: int, n_out: int, offset: int) -> float:
        t = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=ids[offset:offset + n_prompt])],
                     SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - t

    gen(args.context, 4, 0)  # compile, capture
    short, long = gen(args.context, 2, 1), gen(args.context, 2 + args.decode, 2)
    print(f"batch-1 decode, graphs: {(long - short) / args.decode * 1e3:.2f} ms/token "
          f"({args.decode / (long - short):.1f} tok/s) at context {args.context}", flush=True)
    with profile(activities=activities) as prof:
        gen(args.context, 1 + args.decode, 3)
    report("decode graphs", kernel_table(prof, gpu), args.decode + 1, out)

    def graphs_off(model):
        model._graphs, model._graph_mode = None, "off"

    llm.apply_model(graphs_off)
    gen(args.context, 4, 4)
    short, long = gen(args.context, 2, 5), gen(args.context, 2 + args.decode, 6)
    print(f"batch-1 decode, eager: {(long - short) / args.decode * 1e3:.2f} ms/token", flush=True)
    with profile(activities=activities) as prof:
        gen(args.context, 1 + args.decode, 7)
    report("decode eager", kernel_table(prof, gpu), args.decode + 1, out)

    gen(args.prefill, 1, 100)
    with profile(activities=activities) as prof:
        dt = gen(args.prefill, 1, 200)
    print(f"\nprefill {args.prefill} tokens: {dt:.3f} s ({args.prefill / dt:,.0f} tok/s)")
    report("prefill", kernel_table(prof, gpu), 1, out)
    os._exit(0)


if __name__ == "__main__":
    raise SystemExit(main())
