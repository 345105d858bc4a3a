"""The OpenAI-compatible server (vLLM + this plugin) on the tiny checkpoint, over real HTTP.

One server for the session (``tiny_server``: 127.0.0.1, a free port, default mode = decoder pruning
and prefix replay on); its process group is killed and checked gone at the end of the session.
Greedy outputs (and returned log-probabilities) are compared with the reference model run the way
the server runs it: pruned prefill (``prune=True``), and after a prefix-cache hit the bounded replay
on the cache blocks that the earlier request wrote (``reference_after_hit``).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.e2e.server import SERVED_NAME

pytestmark = pytest.mark.engine

TIMEOUT_S = 300.0  # per request: the 2-core box is shared, keep slack


@pytest.fixture(autouse=True)
def _server_log_on_failure(request, tiny_server):
    """Print what the server logged during a test that failed, and fail if it died."""
    start, failed_before = tiny_server.log_size(), request.session.testsfailed
    yield
    if request.session.testsfailed > failed_before:
        print(f"\n--- server log during {request.node.name} ({tiny_server.log_path}) ---\n"
              + "\n".join(tiny_server.log_text(start).splitlines()[-80:]))
    tiny_server.assert_alive()


def post(base: str, path: str, body, timeout: float = TIMEOUT_S) -> tuple[int, dict]:
    """POST JSON (or raw bytes) and return (status, decoded body); 4xx/5xx do not raise."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, {"raw": raw.decode(errors="replace")}


def stream(base: str, path: str, body, timeout: float = TIMEOUT_S) -> list[dict]:
    """POST with ``stream: true`` and return the decoded SSE events (``[DONE]`` must end them)."""
    req = urllib.request.Request(base + path, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    events, done = [], False
    with urllib.request.urlopen(req, timeout=timeout) as r:
        assert r.status == 200
        assert r.headers.get("Content-Type", "").startswith("text/event-stream")
        for raw in r:
            line = raw.decode().strip()
            if not line:
                continue
            assert line.startswith("data: "), line
            payload = line[len("data: "):]
            if payload == "[DONE]":
                done = True
                break
            events.append(json.loads(payload))
    assert done, "the stream ended without data: [DONE]"
    return events


def rand_prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [0] + torch.randint(3, 990, (n - 1,), generator=g).tolist()


def completion_body(prompt, max_tokens: int, **kw) -> dict:
    return {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, **kw}


def assert_error(status: int, body: dict, what: str) -> str:
    assert 400 <= status < 500, f"{what}: expected a 4xx, got {status}: {str(body)[:600]}"
    msg = (body.get("error") or {}).get("message") if isinstance(body.get("error"), dict) else None
    assert msg, f"{what}: no error message in {body}"
    return msg


def test_models_lists_the_tiny_model(tiny_server):
    from tests.e2e.server import get_json

    models = get_json(tiny_server + "/v1/models")
    assert [m["id"] for m in models["data"]] == [SERVED_NAME]
    assert models["data"][0]["max_model_len"] == 1024


def test_completion_text_prompt(tiny_server, tiny_ckpt):
    from transformers import AutoTokenizer

    text = "The quick brown fox jumps over the lazy dog."
    status, out = post(tiny_server, "/v1/completions", completion_body(text, 12))
    assert status == 200, out
    choice = out["choices"][0]
    assert choice["text"].strip(), out
    assert choice["finish_reason"] == "length"
    assert len(choice["token_ids"]) == 12
    expect = AutoTokenizer.from_pretrained(tiny_ckpt).encode(text)
    assert choice["prompt_token_ids"] == expect
    u = out["usage"]
    assert (u["prompt_tokens"], u["completion_tokens"]) == (len(expect), 12)
    assert u["total_tokens"] == len(expect) + 12
    # greedy: the same request gives the same text
    status, again = post(tiny_server, "/v1/completions", completion_body(text, 12))
    assert status == 200 and again["choices"][0]["text"] == choice["text"]


LOGPROB_TOL = 1e-2  # |server - reference| of the returned log-probabilities (no-hit runs: ~1e-5)


def logprob_diff(out: dict, ref_logits, steps: int | None = None) -> float:
    """Largest |server - reference| over the top log-probabilities the server returned in the first
    ``steps`` steps (requests use ``return_tokens_as_token_ids``: the keys are ``token_id:N``)."""
    worst = 0.0
    top = out["choices"][0]["logprobs"]["top_logprobs"]
    assert len(top) == len(ref_logits)
    steps = len(top) if steps is None else steps
    for step, (entries, logits) in enumerate(zip(top[:steps], ref_logits[:steps])):
        ref_lp = torch.log_softmax(logits.double(), dim=-1)
        assert entries, f"no logprobs at step {step}"
        for key, lp in entries.items():
            tok = int(key.split(":", 1)[1])
            worst = max(worst, abs(lp - ref_lp[tok].item()))
    return worst


def test_completion_token_ids_match_reference(tiny_server, tiny_model):
    """A token-id prompt (no prefix-cache hit): greedy ids and log-probabilities equal the
    reference's pruned prefill + decode."""
    n = 10
    base = rand_prompt(1003, 150)
    body = completion_body(base, n, logprobs=5, return_tokens_as_token_ids=True)
    status, out = post(tiny_server, "/v1/completions", body)
    assert status == 200, out
    got = out["choices"][0]["token_ids"]
    ref, ref_logits = tiny_model.generate(base, n, prune=True)
    assert got == ref, f"server {got} != reference {ref}"
    assert out["usage"]["prompt_tokens"] == len(base)
    assert out["usage"]["completion_tokens"] == n
    assert (out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") == 0
    worst = logprob_diff(out, ref_logits)
    print(f"no hit: {n} tokens equal; largest |logprob difference| {worst:.2e}")
    assert worst < LOGPROB_TOL


def reference_after_hit(model, filler: list[int], prompt: list[int], hit: int, n: int):
    """Greedy reference of ``prompt`` served from a ``hit``-token prefix-cache hit on the blocks that
    request ``filler`` wrote in one pruned prefill chunk (see ``Transformer.generate``'s ``filler``)."""
    return model.generate(prompt, n, prune=True, replay_start=hit - model.cfg.sliding_window, hit=hit,
                          filler=filler)


def test_prefix_cache_hit_replay_matches_reference(tiny_server, tiny_model):
    """Follow-ups sharing 140 tokens with an earlier 150-token prompt hit the prefix cache (128
    tokens, block-aligned) and equal the reference's replay of that hit, token for token and in
    log-probabilities."""
    n = 6
    bad = []
    for seed in (1000, 1001, 1004, 1005):  # prompts where the filler's chunk extent matters
        base = rand_prompt(seed, 150)
        status, out = post(tiny_server, "/v1/completions", completion_body(base, 4))
        assert status == 200, out
        follow = base[:140] + list(range(5, 15))
        body = completion_body(follow, n, logprobs=5, return_tokens_as_token_ids=True)
        status, out = post(tiny_server, "/v1/completions", body)
        assert status == 200, out
        hit = (out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
        assert hit == 128, f"expected a 128-token prefix-cache hit: {out['usage']}"
        got = out["choices"][0]["token_ids"]
        ref, ref_logits = reference_after_hit(tiny_model, base, follow, hit, n)
        same = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), n)
        worst = logprob_diff(out, ref_logits, steps=min(same + 1, n))  # same context up to there
        W = tiny_model.cfg.sliding_window
        naive, _ = tiny_model.generate(follow, n, prune=True, replay_start=hit - W, hit=hit)
        line = (f"seed {seed}: hit {hit}: server {got}, reference {ref}, largest |logprob "
                f"difference| {worst:.2e} (generate(replay_start, hit) gives {naive})")
        print(line)
        if got != ref or worst >= LOGPROB_TOL:
            bad.append(line)
    assert not bad, "\n".join(bad)


def test_chat_completion(tiny_server):
    body = {"model": SERVED_NAME, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "system", "content": "You are a helpful assistant."},
                         {"role": "user", "content": "Tell me a short story about a fox."}]}
    status, out = post(tiny_server, "/v1/chat/completions", body)
    assert status == 200, out
    msg = out["choices"][0]["message"]
    assert msg["role"] == "assistant"
    assert msg["content"] and msg["content"].strip(), out
    assert out["choices"][0]["finish_reason"] == "length"
    u = out["usage"]
    assert u["completion_tokens"] == 16 and u["prompt_tokens"] > 10
    assert u["total_tokens"] == u["prompt_tokens"] + 16
    # a second turn that includes the answer
    body["messages"] += [{"role": "assistant", "content": msg["content"]},
                         {"role": "user", "content": "And then?"}]
    status, out2 = post(tiny_server, "/v1/chat/completions", body)
    assert status == 200, out2
    assert out2["choices"][0]["message"]["content"].strip()
    assert out2["usage"]["prompt_tokens"] > u["prompt_tokens"]


def test_streaming_completion(tiny_server):
    body = completion_body("Once upon a time", 12, stream_options={"include_usage": True})
    events = stream(tiny_server, "/v1/completions", body)
    chunks = [e for e in events if e.get("choices")]
    assert len(chunks) >= 2, events  # tokens arrive incrementally
    text = "".join(c["choices"][0].get("text") or "" for c in chunks)
    ids = [t for c in chunks for t in (c["choices"][0].get("token_ids") or [])]
    assert len(ids) == 12
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    usage = events[-1].get("usage")
    assert usage and usage["completion_tokens"] == 12, events[-1]
    # same greedy result as the non-streamed request
    status, out = post(tiny_server, "/v1/completions", completion_body("Once upon a time", 12))
    assert status == 200
    assert out["choices"][0]["token_ids"] == ids and out["choices"][0]["text"] == text
    assert usage["prompt_tokens"] == out["usage"]["prompt_tokens"]


def test_streaming_chat(tiny_server):
    body = {"model": SERVED_NAME, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Hello!"}],
            "stream_options": {"include_usage": True}}
    events = stream(tiny_server, "/v1/chat/completions", body)
    deltas = [e["choices"][0]["delta"] for e in events if e.get("choices")]
    content = "".join(d.get("content") or "" for d in deltas)
    assert content.strip(), events
    assert events[-1]["usage"]["completion_tokens"] == 8


MALFORMED = {
    "negative max_tokens": completion_body("hello", -5),
    "invalid JSON": b'{"model": "tiny", "prompt": "hello", "max_tokens": 4,',
    "prompt longer than max_model_len": completion_body([0] + [7] * 1100, 4),
    "token id out of vocabulary": completion_body([0, 5, 99999], 4),
    "messages not a list": {"model": SERVED_NAME, "messages": "hello", "max_tokens": 4},
}


def test_concurrent_requests_with_malformed_ones(tiny_server, tiny_model):
    n = 16
    prompts = [rand_prompt(2000 + i, L) for i, L in enumerate([20, 40, 60, 80, 100, 120, 140, 160])]
    bad_names = list(MALFORMED)
    spans = []

    def timed(*args):
        t = time.monotonic()
        res = post(*args)
        spans.append((t, time.monotonic()))
        return res

    t0 = time.monotonic()
    with ThreadPoolExecutor(len(prompts) + len(bad_names)) as ex:
        good = [ex.submit(timed, tiny_server, "/v1/completions", completion_body(p, n))
                for p in prompts]
        path = {"messages not a list": "/v1/chat/completions"}
        bad = [ex.submit(post, tiny_server, path.get(k, "/v1/completions"), MALFORMED[k])
               for k in bad_names]
        good = [f.result() for f in good]
        bad = [f.result() for f in bad]
    wall = time.monotonic() - t0
    assert max(a for a, _ in spans) < min(b for _, b in spans), "the 8 requests never overlapped"
    for name, (status, body) in zip(bad_names, bad):
        msg = assert_error(status, body, name)
        print(f"{name}: {status} {msg[:100]!r}")
    mismatches = []
    for p, (status, out) in zip(prompts, good):
        assert status == 200, out
        got = out["choices"][0]["token_ids"]
        assert len(got) == n and out["usage"]["completion_tokens"] == n
        assert out["usage"]["prompt_tokens"] == len(p)
        ref, _ = tiny_model.generate(p, n, prune=True)
        if got != ref:
            mismatches.append(f"prompt of {len(p)}: server {got} != reference {ref}")
    print(f"8 concurrent requests x {n} tokens + {len(bad)} malformed: {wall:.1f} s")
    assert not mismatches, "\n".join(mismatches)
    # still serving afterwards
    status, out = post(tiny_server, "/v1/completions", completion_body("still there?", 4))
    assert status == 200 and len(out["choices"][0]["token_ids"]) == 4


def test_out_of_vocabulary_token_ids_are_rejected(tiny_server, tiny_model):
    V = tiny_model.cfg.vocab_size
    for bad in ([0, 5, 99999], [0, V], [V + 1000]):
        status, body = post(tiny_server, "/v1/completions", completion_body(bad, 4))
        msg = assert_error(status, body, f"prompt {bad}")
        assert "vocab" in msg.lower(), msg
    status, body = post(tiny_server, "/v1/completions", completion_body([0, -1], 4))
    assert_error(status, body, "negative token id")
    # the largest valid id goes through, and the server is still up
    status, out = post(tiny_server, "/v1/completions", completion_body([0, 5, V - 1], 4))
    assert status == 200, out
    assert len(out["choices"][0]["token_ids"]) == 4
    assert all(0 <= t < V for t in out["choices"][0]["token_ids"])


def test_edge_prompts(tiny_server, tiny_model):
    """One-token prompts and a prompt that nearly fills the context are served; the long one
    matches the reference (pruned prefill)."""
    for p in ([0], [5]):
        status, out = post(tiny_server, "/v1/completions", completion_body(p, 4))
        assert status == 200, out
        assert len(out["choices"][0]["token_ids"]) == 4 and out["usage"]["prompt_tokens"] == 1
    p = rand_prompt(3000, 1000)
    status, out = post(tiny_server, "/v1/completions", completion_body(p, 24))
    assert status == 200, out
    got = out["choices"][0]["token_ids"]
    assert len(got) == 24 and out["usage"]["prompt_tokens"] == 1000
    ref, _ = tiny_model.generate(p, 24, prune=True)
    assert got == ref, f"1000-token prompt: server {got} != reference {ref}"
    # vLLM 0.32 clamps max_tokens to the context that is left (no error)
    status, out = post(tiny_server, "/v1/completions", completion_body(rand_prompt(3001, 1001), 100))
    assert status == 200, str(out)[:600]
    assert out["usage"]["completion_tokens"] == 1024 - 1001
    assert out["choices"][0]["finish_reason"] == "length"
