"""vLLM (with this plugin) against the reference oracle, token for token, on the tiny checkpoint."""

from __future__ import annotations

import logging
import statistics

import pytest
import torch
import torch.utils._python_dispatch

from tests.e2e.conftest import engine

MAX_TOKENS = 8
_RAW_LOGITS: dict[tuple, list[torch.Tensor]] = {}  # (chunk, ops) -> per prompt [steps, vocab] raw logits


def _generate(llm, prompts, logits=False):
    """Greedy generation; ``logits``: every step's raw logits over the whole vocabulary too."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=-1 if logits else None)
    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)


def _assert_dummy_weights_run(ckpt: str, prompt: list[int]) -> None:
    """``load_format="dummy"`` serves 4 greedy tokens with finite logits."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    with engine(ckpt, exact=False, load_format="dummy") as llm:
        o = llm.generate([TokensPrompt(prompt_token_ids=prompt)],
                         SamplingParams(temperature=0.0, max_tokens=4, logprobs=1), use_tqdm=False)[0]
    lps = [next(iter(d.values())).logprob for d in o.outputs[0].logprobs]
    assert len(o.outputs[0].token_ids) == 4 and all(abs(x) < 1e4 for x in lps)


def _assert_logits_close(ref: list[torch.Tensor], got: list[torch.Tensor], what: str) -> float:
    """Per prompt: complete, NaN-free and within 1e-4 of ``ref`` (fp32 rounding, see the ops-wiring test);
    returns the largest difference."""
    worst = 0.0
    for k, (a, b) in enumerate(zip(ref, got)):
        assert a.shape == b.shape and not a.isnan().any() and not b.isnan().any(), f"prompt {k}: incomplete logits"
        d = (a - b).abs().max().item()
        worst = max(worst, d)
        assert d < 1e-4, f"prompt {k}: {what} differ by {d:.3e}"
    return worst


def _counted(calls: dict, name: str, fn):
    """``fn`` adding one to ``calls[name]`` per call."""
    def run(*a, **kw):
        calls[name] += 1
        return fn(*a, **kw)
    return run


def _count_ops(monkeypatch, calls: dict, counted: set[str]) -> None:
    """The model's ``torch.ops.dsv41`` calls of the ops named in ``counted`` add to ``calls[name]`` (through the
    model's ``_ops()``; the namespace's own attributes stay untouched)."""
    from vllm_dsv41.model_executor import model as model_mod

    class CountedOps:
        def __getattr__(self, name):
            op = getattr(torch.ops.dsv41, name)
            return _counted(calls, name, op) if name in counted else op

    monkeypatch.setattr(model_mod, "_ops", lambda real=model_mod._ops: (real(), CountedOps())[1])


def _vocab_logits(out) -> torch.Tensor:
    steps = out.outputs[0].logprobs
    V = max(max(d) for d in steps) + 1
    rows = torch.full((len(steps), V), float("nan"))
    for k, d in enumerate(steps):
        for tok, lp in d.items():
            rows[k, tok] = lp.logprob
    return rows


@pytest.mark.parametrize("ops", ["0", "1"], ids=["torch", "ops"])
@pytest.mark.parametrize("chunk", [None, 24], ids=["one-chunk", "chunked-24"])
def test_exact_mode_matches_reference(tiny_ckpt, tiny_model, prompts, chunk, ops, monkeypatch):
    """``ops``: VLLM_DSV41_OPS, i.e. the plain-PyTorch path or the torch.ops.dsv41 wiring (whose CPU
    implementations are the op references)."""
    from vllm_dsv41.model_executor import model as model_mod
    from vllm_dsv41.ops import mhc

    monkeypatch.setenv("VLLM_DSV41_OPS", ops)
    kw = dict(logprobs_mode="raw_logits", max_logprobs=-1)
    if chunk:
        kw.update(enable_chunked_prefill=True, max_num_batched_tokens=chunk)
    # the ops path takes the split mHC boundaries (coefficients beside the sublayer) up to split_rows() rows, the
    # fused ones above: both must run here, and both equal the reference
    seen = {"split": 0, "fused": 0}
    ops_fwd = model_mod.DecoderLayer._forward_ops

    def counted(self, model, step, S, *a):
        seen["split" if S.shape[0] <= mhc.split_rows() else "fused"] += 1
        return ops_fwd(self, model, step, S, *a)

    monkeypatch.setattr(model_mod.DecoderLayer, "_forward_ops", counted)
    monkeypatch.setattr(mhc, "SPLIT_ROWS_DEFAULT", 20)  # decode steps and short prompts split, longer ones fused
    with engine(tiny_ckpt, exact=True, **kw) as llm:
        outs = _generate(llm, prompts, logits=True)
    if ops == "1":
        assert seen["split"] and seen["fused"], f"layer passes by mHC boundary kind: {seen}"
    worst = 0.0
    for p, o in zip(prompts, outs):
        ref_tokens, ref_logits = tiny_model.generate(p, MAX_TOKENS)
        got = list(o.outputs[0].token_ids)
        assert got == ref_tokens, f"prompt of {len(p)} tokens: vLLM {got} != reference {ref_tokens}"
        for step, (tok, lp) in enumerate(zip(got, o.outputs[0].logprobs)):
            diff = abs(lp[tok].logprob - ref_logits[step][tok].item())
            worst = max(worst, diff)
    _RAW_LOGITS[(chunk, ops)] = [_vocab_logits(o) for o in outs]
    print(f"exact mode (chunk={chunk}, ops={ops}): {len(prompts)} prompts x {MAX_TOKENS} tokens equal; "
          f"largest |logit difference| of the chosen token per step = {worst:.3e}")
    assert worst < 5e-2


@pytest.mark.parametrize("chunk", [None, 24], ids=["one-chunk", "chunked-24"])
def test_ops_wiring_is_bitwise_equal_to_torch_path(chunk):
    """On CPU the ops run their references, and every one of them computes what the plain path computes in
    the same order (attention in float64, see reference.model.sparse_attention): the whole-vocabulary
    logits of both exact-mode runs above agree to fp32 rounding.  Run alone they are the same bits; once
    (of many runs) a full CI suite saw 2.4e-05 on one prompt (|logits| ~15), an fp32 summation that came
    out differently in one of the two engines, so the bound is 1e-4 rather than bit equality."""
    if (chunk, "0") not in _RAW_LOGITS or (chunk, "1") not in _RAW_LOGITS:
        pytest.skip("needs both exact-mode runs of this chunking (run the whole module)")
    worst = _assert_logits_close(_RAW_LOGITS[(chunk, "0")], _RAW_LOGITS[(chunk, "1")], "ops path and plain path")
    print(f"ops wiring vs plain path (chunk={chunk}): largest |logit difference| {worst:.2e}")


@pytest.mark.parametrize("ops", ["0", "1"], ids=["torch", "ops"])
def test_default_mode_pruning_and_prefix_replay(tiny_ckpt, tiny_model, prompts, ops, monkeypatch):
    monkeypatch.setenv("VLLM_DSV41_OPS", ops)
    W = tiny_model.cfg.sliding_window
    base = prompts[-1]  # 200 tokens
    follow = base[:150] + [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]  # shares 150 tokens: a 128-token block hit
    with engine(tiny_ckpt, exact=False, max_num_batched_tokens=4096, enable_prefix_caching=True) as llm:
        first = _generate(llm, prompts)
        second = _generate(llm, [follow])[0]
    for p, o in zip(prompts, first):  # decoder pruning on, no hits (fresh prompts)
        ref, _ = tiny_model.generate(p, MAX_TOKENS, prune=True)
        assert list(o.outputs[0].token_ids) == ref, f"pruned prefill of {len(p)} tokens differs"
    hit = second.num_cached_tokens
    print(f"prefix hit: {hit} cached tokens of {len(follow)}; replay_start = {hit - W}")
    assert hit >= 64 and hit % 64 == 0, "the prefix-cache hit was not taken"
    ref, _ = tiny_model.generate(follow, MAX_TOKENS, prune=True, replay_start=hit - W, hit=hit, filler=base)
    assert list(second.outputs[0].token_ids) == ref
    exact_ref, _ = tiny_model.generate(follow, MAX_TOKENS)
    print("replayed:", ref, "exact:", exact_ref)


@pytest.mark.parametrize("ops", ["0", "1", "static", "gathered"], ids=["torch", "ops", "static-decoder", "gathered"])
def test_pruned_step_keeps_untrimmed_windows(tiny_ckpt, tiny_model, prompts, ops, monkeypatch):
    """A pruned step (some request brings more than a window of rows) beside a request whose chunk of 2..W rows
    follows earlier context: only the trimmed request's decoder windows start at its kept rows (§3.2 item 5); the
    other one's rows read their whole windows, from the decoder KV its previous chunk kept.  Budget 64: the
    200-token prompt's chunks are 64, 64, 64 and 8, the last beside the 40-token prompt (trimmed to W rows).
    ``static-decoder``: the decoder layers of every step but the pure decode ones as the padded static step that CUDA
    captures (``graphs.DecoderGraphs``), the untrimmed steps' too (every row kept).  ``gathered``: attention through
    the routes the H200 takes (FlashMLA's kernel on gathered keys for prefill-sized steps and on each row's keys for
    decode rows; the kernel's CPU stand-in), forced for every step."""
    from vllm_dsv41.model_executor import graphs
    from vllm_dsv41.model_executor import model as model_mod
    from vllm_dsv41.ops import sparse_attn_gathered as sag

    kernel_rows = []

    def kernel(*a, **kw):
        kernel_rows.append(a[0].shape[0])
        return sag.sparse_fwd_ref(*a, **kw)

    if ops == "gathered":
        monkeypatch.setattr(sag, "applies", lambda q, rows: rows > 1)
        monkeypatch.setattr(sag, "applies_rows", lambda q, rows: rows == 1)
        monkeypatch.setattr(sag, "flashmla_sparse_fwd", lambda: kernel)

    monkeypatch.setenv("VLLM_DSV41_OPS", "0" if ops == "0" else "1")
    monkeypatch.setenv(graphs.PREFILL_GRAPH_ENV, "static" if ops == "static" else "0")
    static, run = [], graphs.DecoderGraphs.run

    def run_counted(self, meta, kept, *a, **k):
        static.append((meta.query_lens.tolist(), kept.numel()))
        return run(self, meta, kept, *a, **k)

    monkeypatch.setattr(graphs.DecoderGraphs, "run", run_counted)
    W = tiny_model.cfg.sliding_window
    long, short = prompts[-1], prompts[2]  # 200 and 40 tokens
    assert len(long) % 64 == 8 and len(short) > W
    mixed, rows_of = [], model_mod.decoder_rows

    def probed(step, window, enabled):
        q = step.meta.query_lens.tolist()
        if enabled and any(1 < n <= window for n in q) and any(n > window for n in q):
            mixed.append(q)
        return rows_of(step, window, enabled)

    monkeypatch.setattr(model_mod, "decoder_rows", probed)
    kw = dict(enable_chunked_prefill=True, max_num_batched_tokens=64, logprobs_mode="raw_logits", max_logprobs=-1)
    with engine(tiny_ckpt, exact=False, **kw) as llm:
        outs = _generate(llm, [long, short], logits=True)
    assert mixed, "no pruned step held an untrimmed multi-row chunk"
    assert bool(kernel_rows) == (ops == "gathered") and (ops != "gathered" or 24 in kernel_rows), kernel_rows
    if ops == "static":  # the pruned mixed step and the untrimmed ones (the first chunks kept whole are not: > W)
        assert any(q == m for m in mixed for q, _ in static), static
        assert any(n == sum(q) for q, n in static), f"no untrimmed step ran as a static decoder step: {static}"
    else:
        assert not static
    worst = 0.0
    for p, chunk, o in zip((long, short), (64, None), outs):
        ref_tokens, ref_logits = tiny_model.generate(p, MAX_TOKENS, prune=True, chunk=chunk)
        assert list(o.outputs[0].token_ids) == ref_tokens, f"prompt of {len(p)} tokens"
        for k, (tok, lp) in enumerate(zip(ref_tokens, o.outputs[0].logprobs)):
            worst = max(worst, abs(lp[tok].logprob - ref_logits[k][tok].item()))
    print(f"pruned steps with an untrimmed chunk: {mixed}; largest |logit difference| {worst:.3e}")
    assert worst < 5e-2


def test_prompt_logprobs_keep_every_row(tiny_ckpt, tiny_model, prompts, monkeypatch):
    """A request that asks for prompt logprobs reads every prompt row's logits, so the decoder layers keep all its rows
    (§3.2 item 3) while the others in the step are trimmed: its prompt logprobs equal the reference's unpruned rows,
    and the tokens of both requests the pruned reference's."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    monkeypatch.setenv("VLLM_DSV41_OPS", "1")
    W = tiny_model.cfg.sliding_window
    asks, other = prompts[4], prompts[-1]  # 90 and 200 tokens, both past the window
    assert len(asks) > W
    with engine(tiny_ckpt, exact=False, max_num_batched_tokens=4096) as llm:
        got, plain = llm.generate([TokensPrompt(prompt_token_ids=p) for p in (asks, other)],
                                  [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, prompt_logprobs=0),
                                   SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)], use_tqdm=False)
    from vllm_dsv41.reference.model import Session

    logits = tiny_model.forward(Session(), asks, prune=True, all_logits=True)  # every row kept
    ref = torch.log_softmax(logits.double(), -1)
    lps = got.prompt_logprobs
    assert lps is not None and len(lps) == len(asks) and lps[0] is None
    worst = max(abs(lps[i][asks[i]].logprob - ref[i - 1, asks[i]].item()) for i in range(1, len(asks)))
    print(f"prompt logprobs of {len(asks)} rows: largest difference to the reference {worst:.3e}")
    assert worst < 5e-2, f"prompt logprobs differ by {worst:.3e} (trimmed rows read as zeros?)"
    assert list(got.outputs[0].token_ids) == tiny_model.generate(asks, MAX_TOKENS)[0]  # its prompt ran whole
    assert list(plain.outputs[0].token_ids) == tiny_model.generate(other, MAX_TOKENS, prune=True)[0]


def test_gathered_attention_path(tiny_ckpt, tiny_model, prompts, monkeypatch):
    """The gathered-keys attention path (``ops.sparse_attn_gathered``, the FlashMLA prefill route) wired into the
    model, with the CPU stand-in of FlashMLA's kernel and the path forced for every step: exact mode equals the
    reference token for token and the plain ops path's logits to fp32 rounding; default mode (decoder rows
    pruned, so the decoder layers' plans are their own, and a replayed prefix hit) equals the pruned reference.
    Every gather plan is made without a host read (its host-side block bound holds on every step), and the eager
    steps of this path read nothing back on the host but what only the CPU run reads."""
    from vllm_dsv41.ops import sparse_attn_gathered as sag

    calls, plans, make_plan = [], [], sag.gather_plan

    def kernel(*a, **kw):
        calls.append(a[0].shape[0])
        return sag.sparse_fwd_ref(*a, **kw)

    def plan(slots, bstep, rstep, rows_per_block, n_flat, max_blocks=None):
        plans.append((count_touched(slots, bstep), max_blocks))
        return make_plan(slots, bstep, rstep, rows_per_block, n_flat, max_blocks)

    monkeypatch.setattr(sag, "gather_plan", plan)
    monkeypatch.delenv(sag.READBACK_ENV, raising=False)
    probe = _prefill_host_reads(monkeypatch)
    probe.active = False  # on for the default-mode run below (pruned decoder rows, a replayed prefix hit)

    monkeypatch.setenv("VLLM_DSV41_OPS", "1")
    monkeypatch.setattr(sag, "applies", lambda q, rows: True)
    monkeypatch.setattr(sag, "flashmla_sparse_fwd", lambda: kernel)
    kw = dict(logprobs_mode="raw_logits", max_logprobs=-1)
    with engine(tiny_ckpt, exact=True, **kw) as llm:
        outs = _generate(llm, prompts, logits=True)
    assert calls, "the gathered path did not run"
    for p, o in zip(prompts, outs):
        assert list(o.outputs[0].token_ids) == tiny_model.generate(p, MAX_TOKENS)[0], f"prompt of {len(p)} tokens"
    if (None, "1") in _RAW_LOGITS:
        worst = _assert_logits_close(_RAW_LOGITS[(None, "1")], [_vocab_logits(o) for o in outs],
                                     "gathered path and sparse_attn")
        print(f"gathered path vs sparse_attn (exact mode): largest |logit difference| {worst:.2e}")

    W = tiny_model.cfg.sliding_window
    base = prompts[-1]
    follow = base[:150] + [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    with engine(tiny_ckpt, exact=False, max_num_batched_tokens=4096, enable_prefix_caching=True) as llm:
        first = _generate(llm, prompts)
        probe.active = True
        second = _generate(llm, [follow])[0]
    for p, o in zip(prompts, first):
        assert list(o.outputs[0].token_ids) == tiny_model.generate(p, MAX_TOKENS, prune=True)[0]
    hit = second.num_cached_tokens
    assert hit >= 64, "the prefix-cache hit was not taken"
    ref, _ = tiny_model.generate(follow, MAX_TOKENS, prune=True, replay_start=hit - W, hit=hit, filler=base)
    assert list(second.outputs[0].token_ids) == ref
    assert plans and all(bound is not None and touched <= bound for touched, bound in plans), plans
    print(f"{len(plans)} gather plans, blocks touched / bound: {sum(t for t, _ in plans)} / {sum(b for _, b in plans)}")
    assert probe.steps > 0 and not probe.hits, sorted(probe.hits)  # eager steps of the CUDA path: no host read



def test_decode_rows_attention_path(tiny_ckpt, tiny_model, prompts, monkeypatch):
    """The decode-rows route (``sparse_attn_gathered.sparse_attn_rows``: each row's own keys gathered, FlashMLA's
    kernel; ``VLLM_DSV41_DECODE_ATTN=flashmla`` on a GPU) wired into the model, forced for every step with the CPU
    stand-in of the kernel: exact mode equals the reference token for token, default mode (pruned decoder rows) the
    pruned reference."""
    from vllm_dsv41.ops import sparse_attn_gathered as sag

    calls = []

    def kernel(*a, **kw):
        calls.append(a[0].shape[0])
        return sag.sparse_fwd_ref(*a, **kw)

    monkeypatch.setenv("VLLM_DSV41_OPS", "1")
    monkeypatch.setattr(sag, "applies", lambda q, rows: False)
    monkeypatch.setattr(sag, "applies_rows", lambda q, rows: True)
    monkeypatch.setattr(sag, "flashmla_sparse_fwd", lambda: kernel)
    with engine(tiny_ckpt, exact=True) as llm:
        outs = _generate(llm, prompts)
    assert calls, "the decode-rows path did not run"
    for p, o in zip(prompts, outs):
        assert list(o.outputs[0].token_ids) == tiny_model.generate(p, MAX_TOKENS)[0], f"prompt of {len(p)} tokens"
    with engine(tiny_ckpt, exact=False, max_num_batched_tokens=4096) as llm:
        outs = _generate(llm, prompts)
    for p, o in zip(prompts, outs):
        assert list(o.outputs[0].token_ids) == tiny_model.generate(p, MAX_TOKENS, prune=True)[0]


def test_gathered_path_failure_falls_back_to_sparse_attn(tiny_ckpt, tiny_model, prompts, monkeypatch):
    """A FlashMLA kernel that refuses a step (here: raises) costs no request: the step is served through
    ``sparse_attn`` (tokens equal the reference), the path is switched off for the process and the log says why
    once; running out of memory for the gathered keys falls back for that step only."""
    from vllm_dsv41.ops import sparse_attn_gathered as sag

    calls = []

    def refusing(*a, **kw):
        calls.append(a[0].shape[0])
        raise RuntimeError("the chosen implementation does not support this step")

    monkeypatch.setenv("VLLM_DSV41_OPS", "1")
    monkeypatch.setattr(sag, "_switched_off", None)
    monkeypatch.setattr(sag, "flashmla_sparse_fwd", lambda: refusing)
    monkeypatch.setattr(sag, "applies", lambda q, rows: sag._switched_off is None)  # any step, until switched off
    records = []  # on the module's logger itself: whether records reach caplog depends on vLLM's logging setup
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    sag.logger.addHandler(handler)
    try:
        with engine(tiny_ckpt, exact=True) as llm:
            outs = _generate(llm, prompts[:3])
    finally:
        sag.logger.removeHandler(handler)
    assert len(calls) == 1 and sag._switched_off.startswith("RuntimeError: the chosen implementation")
    assert sum("FlashMLA attention on gathered keys failed" in r.getMessage() for r in records) == 1
    for p, o in zip(prompts[:3], outs):
        assert list(o.outputs[0].token_ids) == tiny_model.generate(p, MAX_TOKENS)[0], f"prompt of {len(p)} tokens"

    def out_of_memory(*a, **kw):
        calls.append(a[0].shape[0])
        raise torch.OutOfMemoryError("no room for the workspace")

    monkeypatch.setattr(sag, "_switched_off", None)
    monkeypatch.setattr(sag, "flashmla_sparse_fwd", lambda: out_of_memory)
    calls.clear()
    with engine(tiny_ckpt, exact=True) as llm:
        outs = _generate(llm, prompts[:2])
    assert len(calls) > 1 and sag._switched_off is None  # tried again on later steps
    for p, o in zip(prompts[:2], outs):
        assert list(o.outputs[0].token_ids) == tiny_model.generate(p, MAX_TOKENS)[0]


def test_served_dtype_and_dummy_weights(tiny_ckpt, tiny_model, prompts):
    """The checkpoint's bf16 dtype serves the same tokens (the CPU path computes in fp32), and
    ``load_format="dummy"`` runs with finite logits."""
    with engine(tiny_ckpt, exact=True, dtype="auto") as llm:
        outs = _generate(llm, prompts[:3])
    for p, o in zip(prompts[:3], outs):
        assert list(o.outputs[0].token_ids) == tiny_model.generate(p, MAX_TOKENS)[0]
    _assert_dummy_weights_run(tiny_ckpt, prompts[4])


def test_kept_quantised_weights_equal_dequantised(tiny_ckpt, prompts, monkeypatch):
    """``VLLM_DSV41_WEIGHTS=quant`` keeps the FP8 / MXFP4 bytes and scales as stored (the layout the
    CUDA path repacks for Marlin).  On CPU those layers dequantise per call into the same fp32 values the
    load-time path holds, so every logit of the exact-mode ops run is the same (to fp32 rounding) - which checks the
    loader's raw copies, the expert / shared-expert / grouped ``wo_a`` layers and the dummy loader's
    scale values end to end.  Dummy weights in this mode give finite logits."""
    monkeypatch.setenv("VLLM_DSV41_OPS", "1")
    kw = dict(logprobs_mode="raw_logits", max_logprobs=-1)
    if (None, "1") not in _RAW_LOGITS:
        with engine(tiny_ckpt, exact=True, **kw) as llm:
            _RAW_LOGITS[(None, "1")] = [_vocab_logits(o) for o in _generate(llm, prompts, logits=True)]
    monkeypatch.setenv("VLLM_DSV41_WEIGHTS", "quant")
    with engine(tiny_ckpt, exact=True, **kw) as llm:
        kinds = llm.apply_model(lambda model: {type(m).__name__ for m in model.modules()
                                               if getattr(m, "quant", False)})[0]
        got = [_vocab_logits(o) for o in _generate(llm, prompts, logits=True)]
    assert kinds == {"QuantLinear", "Expert"}, kinds
    _assert_logits_close(_RAW_LOGITS[(None, "1")], got, "kept-quantised and dequantised weights")
    _assert_dummy_weights_run(tiny_ckpt, prompts[4])


def test_bf16_queries_on_the_ops_path(tiny_ckpt, prompts, monkeypatch):
    """The fast CUDA path runs attention on bf16 queries (``Attention.q_dtype``).  The same switch on CPU:
    q leaves ``wq_b`` in bf16 and goes through ``dsv41::rope``, ``dsv41::sparse_attn`` and ``wo_a`` /
    ``wo_b`` in bf16, the layer output returns to the fp32 stream.  The logits are finite and differ from
    the fp32 run (the switch is live).  No closeness bound: the tiny model's random weights amplify noise
    (rounding only q to bf16 inside the fp32 path already moves its logits by up to 3.5, std 7.8); the
    Hopper tests compare the fast path with the dequantised one at Marlin-sized widths."""
    monkeypatch.setenv("VLLM_DSV41_OPS", "1")
    kw = dict(logprobs_mode="raw_logits", max_logprobs=-1)
    if (None, "1") not in _RAW_LOGITS:
        with engine(tiny_ckpt, exact=True, **kw) as llm:
            _RAW_LOGITS[(None, "1")] = [_vocab_logits(o) for o in _generate(llm, prompts, logits=True)]
    with engine(tiny_ckpt, exact=True, **kw) as llm:
        n = llm.apply_model(lambda model: sum(setattr(m, "q_dtype", torch.bfloat16) or 1
                                              for m in model.modules() if hasattr(m, "q_dtype")))[0]
        got = [_vocab_logits(o) for o in _generate(llm, prompts, logits=True)]
    assert n > 0
    step0 = [(a[0] - b[0]).abs().max().item() for a, b in zip(_RAW_LOGITS[(None, "1")], got)]
    assert all(not g.isnan().any() for g in got)
    print(f"bf16 queries: step-0 |logit difference| max {max(step0):.2e}, median {sorted(step0)[len(step0) // 2]:.2e}")
    assert max(step0) > 0


class _HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the ops that read device values on the host (or size their output by them) - each would
    break a CUDA-graph capture - with the plugin frames that issued them."""

    SYNCING = {"_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive",
               "repeat_interleave", "is_nonzero", "equal"}

    def __init__(self):
        super().__init__()
        self.hits: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        import traceback

        name = func.overloadpacket.__name__
        bool_index = name in ("index", "index_put", "index_put_") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None)
        if name in self.SYNCING or bool_index:
            # innermost frame first; no source lines read (the CPU references issue many host reads)
            stack = traceback.StackSummary.extract(traceback.walk_stack(None), lookup_lines=False)
            if self.counts(stack):
                where = [f"{f.filename.rsplit('vllm_dsv41/', 1)[-1]}:{f.lineno}" for f in stack
                         if "vllm_dsv41" in f.filename]
                self.hits.add(f"{name}{' (bool index)' if bool_index else ''} at {' <- '.join(where[:3])}")
        return func(*args, **(kwargs or {}))

    def counts(self, stack) -> bool:
        """Whether a host read issued from ``stack`` is recorded (all of them here)."""
        return True


def probe_static_steps(monkeypatch, probe: _HostReads | None = None) -> _HostReads:
    """Run every static decode step's model forward under ``probe`` (default a fresh :class:`_HostReads`; returned)."""
    from vllm_dsv41.model_executor import graphs

    probe, run = probe or _HostReads(), graphs.DecodeGraphs.run

    def run_probed(self, *a, **k):
        model = self.run_model

        def probed(step):
            with probe:
                return model(step)

        self.run_model = probed
        try:
            return run(self, *a, **k)
        finally:
            self.run_model = model

    monkeypatch.setattr(graphs.DecodeGraphs, "run", run_probed)
    return probe


def count_touched(slots: torch.Tensor, bstep: int) -> int:
    """Blocks of a flat cache view that a slot list touches (a host read: the test's own count)."""
    return torch.unique(slots[slots >= 0] // bstep).numel()


def gather_everywhere(monkeypatch) -> list[tuple[bool, int, int | None]]:
    """Attention through the gathered-keys path (FlashMLA's route, its CPU stand-in) in every step; returns the list
    that records each gather plan as (made inside a static step, blocks its slots touch, the plan's bound)."""
    from vllm_dsv41.model_executor import graphs
    from vllm_dsv41.ops import sparse_attn_gathered as sag

    plans, make_plan = [], sag.gather_plan

    def plan(slots, bstep, rstep, rows_per_block, n_flat, max_blocks=None):
        plans.append((graphs.in_static_step(), count_touched(slots, bstep), max_blocks))
        return make_plan(slots, bstep, rstep, rows_per_block, n_flat, max_blocks)

    monkeypatch.setattr(sag, "gather_plan", plan)
    monkeypatch.setattr(sag, "applies", lambda q, rows: True)
    monkeypatch.setattr(sag, "flashmla_sparse_fwd", lambda: sag.sparse_fwd_ref)
    return plans


class _CudaPathHostReads(_HostReads):
    """:class:`_HostReads` less the host reads that only the CPU run makes: inside the ops' CPU references (the
    ``*_ref`` functions, which CUDA replaces with Triton), the CPU expert loop (CUDA: ``matmul_ogs`` or Marlin), the
    stand-in of FlashMLA's kernel, host tensors read on the host (``Step.needs_pruning``) and the tests' own counts."""

    CPU_ONLY = {"loop_moe", "sparse_fwd_ref", "needs_pruning", "count_touched"}

    def counts(self, stack) -> bool:
        return not any(f.name.endswith("_ref") or f.name in self.CPU_ONLY for f in stack)


def _prefill_host_reads(monkeypatch) -> _CudaPathHostReads:
    """Run every eager step's model forward (prefill and mixed steps) under a :class:`_CudaPathHostReads`
    (returned; ``steps`` counts the probed steps, ``active`` False pauses it: the probe makes CPU steps slow)."""
    from vllm_dsv41.model_executor import model as model_module

    probe, final_hidden = _CudaPathHostReads(), model_module.DeepseekV41ForCausalLM._final_hidden
    probe.steps, probe.active = 0, True

    def probed(self, step, e):
        from vllm_dsv41.model_executor.graphs import in_static_step

        if in_static_step() or not probe.active:
            return final_hidden(self, step, e)
        probe.steps += 1
        with probe:
            return final_hidden(self, step, e)

    monkeypatch.setattr(model_module.DeepseekV41ForCausalLM, "_final_hidden", probed)
    return probe


def test_padded_static_decode_steps(tiny_ckpt, prompts, monkeypatch):
    """``VLLM_DSV41_CUDAGRAPH=static`` runs every decode step the way a captured CUDA graph does (padded
    to a power-of-two batch, fixed buffers, the context bucket's score width: ``graphs.py``) but without
    capture, so CPU checks the padding: with at most 6 requests per step the 9 prompts decode as batches of
    6 and 3, padded to 8 and 4.  Against the same run unpadded the tokens are equal and the logits differ
    by fp32 summation order (matmuls over 8 rows instead of 6), which may flip a cache-record code at a
    rounding midpoint for a prompt (bounded loosely).

    It also checks what capture needs and CPU can see: inside a static step no op reads a device value on
    the host (``_HostReads``) and no step metadata is copied to the device (the step's buffers hold it)."""
    from vllm_dsv41.attention.backend import DSV41StepMetadata
    from vllm_dsv41.model_executor import graphs

    monkeypatch.setenv("VLLM_DSV41_OPS", "1")
    probe, copies = probe_static_steps(monkeypatch), []
    on = DSV41StepMetadata.on

    def on_checked(self, name, *a, **k):
        if graphs.in_static_step():
            copies.append(name)
        return on(self, name, *a, **k)

    monkeypatch.setattr(DSV41StepMetadata, "on", on_checked)
    kw = dict(logprobs_mode="raw_logits", max_logprobs=-1, max_num_seqs=6)
    runs = {}
    for mode in ("0", "static"):
        monkeypatch.setenv("VLLM_DSV41_CUDAGRAPH", mode)
        with engine(tiny_ckpt, exact=True, **kw) as llm:
            outs = _generate(llm, prompts, logits=True)
            runs[mode] = ([list(o.outputs[0].token_ids) for o in outs], [_vocab_logits(o) for o in outs])
            if mode == "static":
                keys = llm.apply_model(lambda model: sorted(model._graphs.entries_seen))[0]
    assert {(8, 1024), (4, 1024)} <= set(keys), keys
    assert not probe.hits, f"host reads inside static decode steps: {sorted(probe.hits)}"
    assert not copies, f"step metadata copied to the device inside static decode steps: {sorted(set(copies))}"
    assert runs["0"][0] == runs["static"][0]
    per_prompt = [(a - b).abs().max().item() for a, b in zip(runs["0"][1], runs["static"][1])]
    worst, typical = max(per_prompt), statistics.median(per_prompt)
    print(f"padded static decode steps: tokens equal, |logit difference| median {typical:.2e}, largest {worst:.2e}")
    assert typical < 1e-4  # fp32 summation order
    # a cache-record code at a rounding midpoint can flip between 6- and 8-row sums (on an AVX2 CPU one prompt's
    # logits moved by 1.5e-3 from its first decode step on); a padding fault moves them by far more
    assert worst < 1e-2


def test_decode_rows_in_static_decode_steps(tiny_ckpt, prompts, monkeypatch):
    """The decode-rows route (``sparse_attn_gathered.sparse_attn_rows``, forced, the CPU stand-in of FlashMLA's
    kernel) inside the padded static decode steps that CUDA captures: the route runs there, the tokens equal the eager
    run's, and nothing but the CPU stand-ins reads a device value on the host."""
    from vllm_dsv41.model_executor import graphs
    from vllm_dsv41.ops import sparse_attn_gathered as sag

    static_calls = []

    def kernel(*a, **kw):
        static_calls.append(graphs.in_static_step())
        return sag.sparse_fwd_ref(*a, **kw)

    monkeypatch.setenv("VLLM_DSV41_OPS", "1")
    monkeypatch.setattr(sag, "applies", lambda q, rows: False)
    monkeypatch.setattr(sag, "applies_rows", lambda q, rows: True)
    monkeypatch.setattr(sag, "flashmla_sparse_fwd", lambda: kernel)
    probe = probe_static_steps(monkeypatch, _CudaPathHostReads())
    tokens = {}
    for mode in ("0", "static"):
        monkeypatch.setenv("VLLM_DSV41_CUDAGRAPH", mode)
        with engine(tiny_ckpt, exact=True, max_num_seqs=6) as llm:
            tokens[mode] = [list(o.outputs[0].token_ids) for o in _generate(llm, prompts)]
    assert any(static_calls), "the route did not run inside a static decode step"
    assert not probe.hits, f"host reads inside static decode steps: {sorted(probe.hits)}"
    assert tokens["0"] == tokens["static"]


@pytest.mark.parametrize("attn", ["sparse_attn", "gathered"])
def test_prefill_decoder_graphs_static(tiny_ckpt, tiny_model, prompts, monkeypatch, attn):
    """``VLLM_DSV41_PREFILL_GRAPHS=static``: the decoder layers of pruned prefill steps run as the padded static step
    over their kept rows that CUDA captures (``graphs.DecoderGraphs``, ``kept_step_meta``), without capture.
    Default mode (decoder rows pruned, then a replayed prefix hit): the tokens equal the pruned reference and the
    eager run's, the logits the eager run's to fp32 summation order; the static decoder steps read nothing back on
    the host (what capture needs) and the keys are the buckets of the steps' shapes.  ``gathered``: attention through
    the gathered-keys path (FlashMLA's route, its CPU stand-in) in every step, the static decoder steps included,
    whose gather plans take the bucket's bounds (``StaticStep.gather_bounds``): every plan's bound holds."""
    from vllm_dsv41.model_executor import graphs

    monkeypatch.setenv("VLLM_DSV41_OPS", "1")
    probe, run = (_HostReads() if attn == "sparse_attn" else _CudaPathHostReads()), graphs.DecoderGraphs.run
    seen = []
    plans = gather_everywhere(monkeypatch) if attn == "gathered" else []

    def run_probed(self, meta, kept, *a, **k):
        decoder = self.run_decoder

        def probed(step, S, pre, carry):
            with probe:
                return decoder(step, S, pre, carry)

        self.run_decoder = probed
        seen.append((meta.num_reqs, kept.numel(), self.key(meta, kept.numel())))
        try:
            return run(self, meta, kept, *a, **k)
        finally:
            self.run_decoder = decoder

    monkeypatch.setattr(graphs.DecoderGraphs, "run", run_probed)
    W = tiny_model.cfg.sliding_window
    base = prompts[-1]  # 200 tokens
    follow = base[:150] + [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    kw = dict(max_num_batched_tokens=4096, enable_prefix_caching=True, logprobs_mode="raw_logits", max_logprobs=-1)
    runs = {}
    for mode in ("0", "static"):
        monkeypatch.setenv(graphs.PREFILL_GRAPH_ENV, mode)
        with engine(tiny_ckpt, exact=False, **kw) as llm:
            first = _generate(llm, prompts, logits=True)
            second = _generate(llm, [follow], logits=True)[0]
        outs = first + [second]
        runs[mode] = [list(o.outputs[0].token_ids) for o in outs], [_vocab_logits(o) for o in outs]
        if mode == "0":
            assert not seen, "decoder graphs ran with VLLM_DSV41_PREFILL_GRAPHS=0"
    assert seen, "no prefill step went through the decoder graphs"
    for (B, n_kept, key), in zip(seen):
        assert key[0] >= B and key[1] >= max(n_kept, graphs.MIN_KEPT_ROWS) and n_kept <= B * W, (B, n_kept, key)
    assert not probe.hits, f"host reads inside static decoder steps: {sorted(probe.hits)}"
    for p, toks in zip(prompts, runs["static"][0]):
        assert toks == tiny_model.generate(p, MAX_TOKENS, prune=True)[0], f"pruned prefill of {len(p)} tokens differs"
    hit = second.num_cached_tokens
    assert hit >= 64, "the prefix-cache hit was not taken"
    ref, _ = tiny_model.generate(follow, MAX_TOKENS, prune=True, replay_start=hit - W, hit=hit, filler=base)
    assert runs["static"][0][-1] == ref
    assert runs["static"][0] == runs["0"][0]
    worst = max((a - b).abs().max().item() for a, b in zip(runs["0"][1], runs["static"][1]))
    print(f"static decoder steps of {len(seen)} prefill steps, keys {sorted({k for *_, k in seen})}: "
          f"|logit difference| to eager {worst:.2e}")
    assert worst < 1e-2  # fp32 summation order over padded rows; a padding fault moves logits by far more
    if attn == "gathered":
        static_plans = [(t, b) for st, t, b in plans if st]
        assert static_plans and all(b is not None and t <= b for _, t, b in plans), plans
        print(f"{len(static_plans)} gather plans in static decoder steps, blocks touched / bound: "
              f"{sum(t for t, _ in static_plans)} / {sum(b for _, b in static_plans)}")


@pytest.mark.parametrize("attn", ["sparse_attn", "gathered"])
def test_mixed_step_graphs_static(tiny_ckpt, tiny_model, prompts, monkeypatch, attn):
    """``VLLM_DSV41_MIXED_GRAPHS=static``: steps in which some request brings several rows, none more than a window
    (short chunks beside decode rows, under the 24-token budget of the chunked exact-mode test), run whole as the padded static step that CUDA captures
    (``graphs.MixedGraphs``, ``pad_mixed_meta``: the padded rows in a padding request that writes nothing), without
    capture.  Exact mode: every prompt's tokens equal the reference's, and the eager run's (logits to fp32 summation
    order); inside the static steps nothing reads a device value on the host and no step metadata is copied to the
    device.  ``gathered``: attention through FlashMLA's route (its CPU stand-in) in every step, the static ones
    included, whose gather plans take the bucket's bounds: every plan's bound holds."""
    from vllm_dsv41.attention.backend import DSV41StepMetadata
    from vllm_dsv41.model_executor import graphs

    monkeypatch.setenv("VLLM_DSV41_OPS", "1")
    monkeypatch.setenv(graphs.GRAPH_ENV, "0")
    probe = probe_static_steps(monkeypatch, _HostReads() if attn == "sparse_attn" else _CudaPathHostReads())
    copies, seen = [], []
    plans = gather_everywhere(monkeypatch) if attn == "gathered" else []
    on, accepts = DSV41StepMetadata.on, graphs.MixedGraphs.accepts

    def on_checked(self, name, *a, **k):
        if graphs.in_static_step():
            copies.append(name)
        return on(self, name, *a, **k)

    def accepts_seen(self, meta):
        ok = accepts(self, meta)
        if ok:
            seen.append((meta.query_lens.tolist(), self.key(meta)))
        return ok

    monkeypatch.setattr(DSV41StepMetadata, "on", on_checked)
    monkeypatch.setattr(graphs.MixedGraphs, "accepts", accepts_seen)
    W = tiny_model.cfg.sliding_window
    # (under a 20-token budget a record near-tie of the 200-token prompt flips against the reference, eager or not)
    kw = dict(enable_chunked_prefill=True, max_num_batched_tokens=24, logprobs_mode="raw_logits", max_logprobs=-1)
    runs = {}
    for mode in ("0", "static"):
        monkeypatch.setenv(graphs.MIXED_GRAPH_ENV, mode)
        with engine(tiny_ckpt, exact=True, **kw) as llm:
            outs = _generate(llm, prompts, logits=True)
        runs[mode] = [list(o.outputs[0].token_ids) for o in outs], [_vocab_logits(o) for o in outs]
        if mode == "0":
            assert not seen, "mixed-step graphs ran with VLLM_DSV41_MIXED_GRAPHS=0"
    mixed = [q for q, _ in seen if max(q) > 1 and 1 in q]
    assert mixed, f"no step with a multi-row chunk beside decode rows ran as a static mixed step: {seen}"
    for q, (B, R, ctx) in seen:
        power_of_two_plus_one = B > len(q) and (B - 1) & (B - 2) == 0
        assert power_of_two_plus_one and R >= sum(q) and max(q) <= W and ctx >= graphs.MIN_CONTEXT, (q, (B, R, ctx))
    assert not probe.hits, f"host reads inside static mixed steps: {sorted(probe.hits)}"
    assert not copies, f"step metadata copied to the device inside static mixed steps: {sorted(set(copies))}"
    for p, toks in zip(prompts, runs["static"][0]):
        assert toks == tiny_model.generate(p, MAX_TOKENS)[0], f"prompt of {len(p)} tokens differs from the reference"
    assert runs["static"][0] == runs["0"][0]
    per_prompt = [(a - b).abs().max().item() for a, b in zip(runs["0"][1], runs["static"][1])]
    print(f"{len(seen)} static mixed steps, keys {sorted({k for _, k in seen})}: |logit difference| to eager median "
          f"{statistics.median(per_prompt):.2e}, largest {max(per_prompt):.2e}")
    assert statistics.median(per_prompt) < 1e-4 and max(per_prompt) < 1e-2  # fp32 summation order over padded rows
    if attn == "gathered":
        static_plans = [(t, b) for st, t, b in plans if st]
        assert static_plans and all(b is not None and t <= b for t, b in static_plans), static_plans


def test_index_passes_are_exact(tiny_ckpt, prompts, monkeypatch):
    """``VLLM_DSV41_INDEX_CHUNK_MIB``: the indexer's score rows ([rows, n_max] fp32, 4.4 GB for a 16k-row chunk at a
    66k context) go through ``index_scores`` and the selections in passes of bounded size.  Ops path, eager steps, the
    candidate blocks made (shortcut off) so the source's blocks are joined over passes and each consumer pass reads its
    rows' blocks: passes of 3 rows give the tokens and logits of one pass, bitwise, with more ``index_scores`` calls."""
    from vllm_dsv41.model_executor import model as model_mod

    monkeypatch.setenv("VLLM_DSV41_OPS", "1")
    monkeypatch.setenv("VLLM_DSV41_CUDAGRAPH", "0")
    monkeypatch.setenv(model_mod.CANDIDATE_SHORTCUT_ENV, "0")
    calls = {"index_scores": 0}
    _count_ops(monkeypatch, calls, {"index_scores"})
    runs = {}
    for name, rows in (("one", lambda n_max: 1 << 62), ("passes", lambda n_max: 3)):
        monkeypatch.setattr(model_mod, "index_chunk_rows", rows)
        calls["index_scores"] = 0
        with engine(tiny_ckpt, exact=True, logprobs_mode="raw_logits", max_logprobs=-1) as llm:
            outs = _generate(llm, prompts[:5], logits=True)
        runs[name] = ([list(o.outputs[0].token_ids) for o in outs], [_vocab_logits(o) for o in outs],
                      calls["index_scores"])
    (tok0, lg0, n0), (tok1, lg1, n1) = runs["one"], runs["passes"]
    print(f"index_scores calls: {n1} in passes of 3 rows, {n0} in one pass")
    assert n1 > n0 > 0
    assert tok1 == tok0 and all(torch.equal(a, b) for a, b in zip(lg0, lg1))


def test_index_chunk_rows_setting(monkeypatch):
    """``index_chunk_rows``: rows whose selection cells fit the MiB budget (at least one), 0 = one pass, and a clear
    error naming the variable for a value that is not a whole number."""
    from vllm_dsv41.model_executor import model as model_mod

    monkeypatch.setenv(model_mod.INDEX_CHUNK_ENV, "1")
    assert model_mod.index_chunk_rows(1024) == (1 << 20) // (model_mod.INDEX_BYTES_PER_ENTRY * 1024)
    assert model_mod.index_chunk_rows(1 << 30) == 1
    monkeypatch.setenv(model_mod.INDEX_CHUNK_ENV, "0")
    assert model_mod.index_chunk_rows(66560) >= 1 << 40
    for bad in ("-1", "1.5", "lots"):
        monkeypatch.setenv(model_mod.INDEX_CHUNK_ENV, bad)
        with pytest.raises(ValueError, match="VLLM_DSV41_INDEX_CHUNK_MIB"):
            model_mod.index_chunk_rows(66560)


def test_candidate_shortcut_is_exact(tiny_ckpt, prompts, monkeypatch):
    """``VLLM_DSV41_CANDIDATE_SHORTCUT``: where the candidate source's host bound fits the candidate budget (the tiny
    model's is 6 blocks of 4 entries: the short prompts' eager steps) it publishes no blocks and its consumers select
    unfiltered; beyond it (the longer prompts) the blocks and the filter run as before.  Ops path, eager steps (their
    bound follows the step's positions): tokens and logits bitwise equal with and without the shortcut, and the
    shortcut skipped some but not all of the source's ``candidate_blocks`` calls."""
    from vllm_dsv41.model_executor import model as model_mod

    monkeypatch.setenv("VLLM_DSV41_OPS", "1")
    monkeypatch.setenv("VLLM_DSV41_CUDAGRAPH", "0")
    calls = {"candidate_blocks": 0}
    _count_ops(monkeypatch, calls, {"candidate_blocks"})
    runs = {}
    for switch in ("0", "1"):
        monkeypatch.setenv(model_mod.CANDIDATE_SHORTCUT_ENV, switch)
        calls["candidate_blocks"] = 0
        # one prompt at a time: each step's bound is that prompt's own
        with engine(tiny_ckpt, exact=True, logprobs_mode="raw_logits", max_logprobs=-1, max_num_seqs=1) as llm:
            outs = _generate(llm, prompts[:5], logits=True)  # 5 to 90 tokens: inside the budget and past it
        runs[switch] = ([list(o.outputs[0].token_ids) for o in outs], [_vocab_logits(o) for o in outs],
                        calls["candidate_blocks"])
    (tok0, lg0, n0), (tok1, lg1, n1) = runs["0"], runs["1"]
    print(f"candidate_blocks calls: {n1} with the shortcut, {n0} without")
    assert 0 < n1 < n0
    assert tok1 == tok0 and all(torch.equal(a, b) for a, b in zip(lg0, lg1))
