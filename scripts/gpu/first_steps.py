"""Diagnostic: time the first engine steps of the bench config and dump Python stacks every 20 s."""
import faulthandler, os, sys, time
out = os.environ.get("OUT", "/tmp")
f = open(f"{out}/stacks.txt", "w")
faulthandler.dump_traceback_later(20, repeat=True, file=f)
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
t0 = time.time()
llm = LLM(model=sys.argv[1], load_format="dummy", async_scheduling=False, max_model_len=8192,
          max_num_seqs=64, kv_cache_memory_bytes=8 << 30, seed=0)
print(f"engine {time.time()-t0:.1f}s", flush=True)
for n, m, b in [(16, 4, 1), (16, 4, 1), (1024, 32, 1), (1024, 32, 1), (1024, 32, 16)]:
    t = time.time()
    llm.generate([TokensPrompt(prompt_token_ids=list(range(100, 100 + n)))] * b,
                 SamplingParams(max_tokens=m, ignore_eos=True), use_tqdm=False)
    print(f"prompt {n} x{b} -> {m}: {time.time()-t:.2f}s", flush=True)
os._exit(0)
