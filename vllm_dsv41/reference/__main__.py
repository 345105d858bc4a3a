"""``python -m vllm_dsv41.reference --model DIR --prompt "..." --max-tokens N``: greedy text from the oracle."""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vllm_dsv41.reference", description=__doc__)
    ap.add_argument("--model", required=True, help="checkpoint directory (official V4.1 format)")
    ap.add_argument("--prompt", default="The quick brown fox")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--no-cache-quant", action="store_true", help="keep KV caches in fp32 (no record quantisation)")
    ap.add_argument("--prune", action="store_true", help="decoder-side pruning of long prefill chunks")
    ap.add_argument("--draft", action="store_true", help="also print one DSpark draft block after the prompt")
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    from vllm_dsv41.reference.model import Options, Session, Transformer

    torch.set_grad_enabled(False)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = Transformer(args.model, Options(cache_quant=not args.no_cache_quant))
    ids = [model.cfg.bos_token_id] + tok.encode(args.prompt, add_special_tokens=False)
    t0 = time.perf_counter()
    out, _ = model.generate(ids, args.max_tokens, prune=args.prune)
    dt = time.perf_counter() - t0
    print(args.prompt + tok.decode(out, skip_special_tokens=False))
    print(f"[{len(ids)} prompt tokens, {len(out)} generated in {dt:.2f} s]", file=sys.stderr)
    if args.draft and model.cfg.n_draft_layers:
        s = Session()
        logits = model.forward(s, ids)
        anchor = int(torch.argmax(logits))
        print("draft after anchor", anchor, "->", model.draft(s, anchor), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
