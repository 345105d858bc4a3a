"""Engram lookback ids under async scheduling, on CPU.

Under async scheduling vLLM's runner keeps placeholders (-1) for generated token ids in its host token table (the
ids stay on the GPU), so the lookback ids our runner hooks read for a step's first rows are unknown wherever they
are generated tokens; the model then takes them from its device token history (``step.TokenHistory``).  The CPU
platform runs synchronously, so the test makes the hooks see what async scheduling would give them: every
generated position's id masked to -1.  The Engram windows of every step must equal those of the unmasked run,
and so must the tokens and logits; the masked run must have needed the history (its windows without it differ).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.e2e.conftest import engine


def _masked_like_async(collect):
    """``runner_hooks._collect_step_info`` as under async scheduling: generated positions' lookback ids unknown."""
    from vllm_dsv41.attention.backend import LOOKBACK_DEPTH

    masked = []

    def wrapped(runner):
        info = collect(runner)
        batch, n = runner.input_batch, len(info.req_ids)
        pos = batch.num_computed_tokens_cpu[:n, None].astype(np.int64) - np.arange(1, LOOKBACK_DEPTH + 1)[None, :]
        generated = pos >= batch.num_prompt_tokens[:n, None]
        masked.append(int((generated & (info.lookback_token_ids >= 0)).sum()))
        info.lookback_token_ids = np.where(generated, -1, info.lookback_token_ids).astype(np.int32)
        return info

    return wrapped, masked


def _sync_and_async_like(tiny_ckpt, monkeypatch, prompts, sp, **engine_kw):
    """The prompts served twice, synchronously and with the hooks seeing what async scheduling would leave them:
    per run (tokens, logprobs, every Engram window computation as (windows, windows without the history, static
    step?), preemptions), and the lookback ids masked per step of the second run."""
    from vllm.inputs import TokensPrompt

    from vllm_dsv41.attention import runner_hooks
    from vllm_dsv41.model_executor.graphs import StaticStep
    from vllm_dsv41.model_executor.step import Step

    windows: list = []
    token_windows = Step._token_windows

    def recorded(self, depth, history):
        before = None if history is None else token_windows(self, depth, None)  # no history: reads, no write
        out = token_windows(self, depth, history)
        windows.append((out.clone(), before, isinstance(self, StaticStep)))
        return out

    monkeypatch.setattr(Step, "_token_windows", recorded)
    runs, masked = {}, []
    for name in ("sync", "async-like"):
        windows.clear()
        with monkeypatch.context() as m:
            if name == "async-like":
                wrapped, masked = _masked_like_async(runner_hooks._collect_step_info)
                m.setattr(runner_hooks, "_collect_step_info", wrapped)
            with engine(tiny_ckpt, exact=True, **engine_kw) as llm:
                scheduler = llm.llm_engine.engine_core.engine_core.scheduler
                preempted = []

                def preempt(request, *a, _orig=scheduler._preempt_request, **k):
                    preempted.append(request.request_id.rsplit("-", 1)[0])  # vLLM appends "-<random>" to the id
                    return _orig(request, *a, **k)

                scheduler._preempt_request = preempt
                outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
        runs[name] = ([list(o.outputs[0].token_ids) for o in outs],
                      [[{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs or []] for o in outs],
                      list(windows), preempted)
    return runs, masked


def _assert_same_windows(runs, masked) -> tuple[int, int]:
    (tok_s, lp_s, win_s, _), (tok_a, lp_a, win_a, _) = runs["sync"], runs["async-like"]
    assert sum(masked) > 0, "no lookback id was masked: the test did not exercise the history"
    assert len(win_s) == len(win_a) > 0
    for k, ((a, _, _), (b, _, _)) in enumerate(zip(win_s, win_a)):
        assert torch.equal(a, b), f"step {k}: Engram windows differ from the synchronous run's"
    needed = sum(int((w != nh).any()) for w, nh, _ in win_a)
    assert needed > 0, "the masked run's windows never needed the history"
    assert tok_s == tok_a and lp_s == lp_a
    return needed, sum(st for _, _, st in win_a)


@pytest.mark.parametrize("graphs", ["0", "static"], ids=["eager", "static-steps"])
def test_engram_lookback_from_history(tiny_ckpt, prompts, monkeypatch, graphs):
    from vllm import SamplingParams

    monkeypatch.setenv("VLLM_DSV41_OPS", "1")
    monkeypatch.setenv("VLLM_DSV41_CUDAGRAPH", graphs)
    runs, masked = _sync_and_async_like(tiny_ckpt, monkeypatch, prompts[:6],
                                        SamplingParams(temperature=0.0, max_tokens=10, logprobs=5),
                                        max_num_seqs=4, enable_chunked_prefill=True, max_num_batched_tokens=48)
    needed, static = _assert_same_windows(runs, masked)
    assert (static > 0) == (graphs == "static"), f"{static} windows computed in static steps"
    print(f"{graphs}: {sum(masked)} lookback ids masked in {len(masked)} steps, {needed} of {len(runs['sync'][2])} "
          f"window computations ({static} in static steps) took ids from the history; windows, tokens and "
          f"logprobs equal")


def test_engram_lookback_from_history_across_preemption(tiny_ckpt, monkeypatch):
    """Under a KV budget that forces preemption (tests/e2e/test_preemption.py's): a preempted request keeps its
    history row until it finishes, so after it resumes its lookbacks still come out right even with every generated
    id masked (real async scheduling would give a resumed request its ids back; the test is stricter)."""
    from vllm import SamplingParams

    from tests.e2e.test_preemption import MAX_LEN, N_BLOCKS, _prompts

    monkeypatch.setenv("VLLM_DSV41_OPS", "1")
    runs, masked = _sync_and_async_like(tiny_ckpt, monkeypatch, _prompts(7, [20, 30, 40, 50, 60, 70, 80, 90]),
                                        SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True),
                                        num_gpu_blocks_override=N_BLOCKS, max_model_len=MAX_LEN, max_num_seqs=8,
                                        enable_prefix_caching=False)
    assert runs["async-like"][3], "no preemption: the KV budget is no longer tight"
    assert runs["async-like"][3] == runs["sync"][3]
    needed, _ = _assert_same_windows(runs, masked)
    print(f"preemption: {len(runs['sync'][3])} preemption(s), {sum(masked)} lookback ids masked, {needed} window "
          f"computations took ids from the history; windows and tokens equal")
