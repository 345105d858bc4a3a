"""Demo: greedy generation from a checkpoint with vLLM (our plugin) and with the reference oracle, on CPU.

    python examples/demo.py ckpt/tiny
"""

import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

PROMPTS = ["The quick brown fox", "Once upon a time, in a small village,", "Hello"]


def main(path: str) -> None:
    import torch

    from transformers import AutoTokenizer
    from vllm_dsv41.reference import Transformer

    torch.set_grad_enabled(False)
    tok = AutoTokenizer.from_pretrained(path)
    ref = Transformer(path)
    print("== reference (vllm_dsv41.reference)")
    for p in PROMPTS:
        out, _ = ref.generate([ref.cfg.bos_token_id] + tok.encode(p, add_special_tokens=False), 16)
        print(f"{p!r} -> {tok.decode(out)!r}")

    from vllm import LLM, SamplingParams

    print("== vLLM 0.32 + vllm-dsv41")
    llm = LLM(model=path, enforce_eager=True, dtype="float32", max_model_len=512, max_num_seqs=8)
    for o in llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16)):
        print(f"{o.prompt!r} -> {o.outputs[0].text!r}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "ckpt/tiny")
