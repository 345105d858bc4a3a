"""A minimal streaming OpenAI-compatible completions server for testing
``vllm-dsv41-bench`` without a model.

It answers ``GET /v1/models`` and streaming ``POST /v1/completions`` with a
token-id prompt, returning exactly ``max_tokens`` tokens (vLLM's chunk format,
``return_token_ids`` and ``stream_options.include_usage`` honoured) after a
configurable per-token delay.  A toy block prefix cache reports
``usage.prompt_tokens_details.cached_tokens``.  Faults can be injected:
``fail_every`` (HTTP 500 on every n-th request), ``short_every`` (one token
too few on every n-th request).

    python -m vllm_dsv41.tools.bench_stub --port 8011 --token-delay 0.002

It binds to 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from dataclasses import dataclass, field

from aiohttp import web

_BLOCK = 16
STATE_KEY = web.AppKey("state", object)


@dataclass
class StubState:
    model: str = "stub-model"
    token_delay: float = 0.0
    chunk_size: int = 1
    fail_every: int = 0
    short_every: int = 0
    token_ids: bool = True  # honour return_token_ids
    requests: int = 0
    failed: int = 0
    blocks: set = field(default_factory=set)

    def cached_tokens(self, prompt: list[int]) -> int:
        n, h = 0, 0
        for i in range(0, len(prompt) - len(prompt) % _BLOCK, _BLOCK):
            h = hash((h, tuple(prompt[i:i + _BLOCK])))
            if h not in self.blocks:
                break
            n += _BLOCK
        return n

    def remember(self, tokens: list[int]) -> None:
        h = 0
        for i in range(0, len(tokens) - len(tokens) % _BLOCK, _BLOCK):
            h = hash((h, tuple(tokens[i:i + _BLOCK])))
            self.blocks.add(h)


def make_app(state: StubState | None = None) -> web.Application:
    st = state or StubState()

    async def models(_req: web.Request) -> web.Response:
        return web.json_response({"object": "list",
                                  "data": [{"id": st.model, "object": "model", "owned_by": "stub"}]})

    async def completions(req: web.Request) -> web.StreamResponse:
        try:
            body = await req.json()
        except ValueError:
            return web.json_response({"error": {"message": "invalid JSON"}}, status=400)
        prompt = body.get("prompt")
        max_tokens = body.get("max_tokens")
        if (not isinstance(prompt, list) or not prompt
                or not all(isinstance(t, int) for t in prompt)):
            return web.json_response({"error": {"message": "prompt must be a token-id list"}},
                                     status=400)
        if not isinstance(max_tokens, int) or max_tokens < 1:
            return web.json_response({"error": {"message": "max_tokens must be >= 1"}}, status=400)
        if body.get("model") != st.model:
            return web.json_response({"error": {"message": f"model {body.get('model')!r} not found"}},
                                     status=404)
        if not body.get("stream"):
            return web.json_response({"error": {"message": "stub only streams"}}, status=400)
        st.requests += 1
        n_req = st.requests
        if st.fail_every and n_req % st.fail_every == 0:
            st.failed += 1
            return web.json_response({"error": {"message": f"injected failure #{n_req}"}},
                                     status=500)
        n_out = max_tokens - 1 if (st.short_every and n_req % st.short_every == 0) else max_tokens
        want_ids = bool(body.get("return_token_ids")) and st.token_ids
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        cached = st.cached_tokens(prompt)
        rid = f"cmpl-stub-{n_req}"

        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(req)

        async def send(obj) -> None:
            await resp.write(f"data: {json.dumps(obj)}\n\n".encode())

        out_ids = [100 + (sum(prompt[-4:]) + 7 * i) % 800 for i in range(n_out)]
        sent = 0
        first = True
        while sent < n_out:
            k = min(st.chunk_size, n_out - sent)
            if st.token_delay:
                await asyncio.sleep(st.token_delay * k)
            ids = out_ids[sent:sent + k]
            sent += k
            choice = {"index": 0, "text": "".join(f" t{t}" for t in ids),
                      "finish_reason": "length" if sent == n_out else None}
            if want_ids:
                choice["token_ids"] = ids
                if first:
                    choice["prompt_token_ids"] = prompt
            first = False
            await send({"id": rid, "object": "text_completion", "created": int(time.time()),
                        "model": st.model, "choices": [choice]})
        st.remember(prompt + out_ids)
        if include_usage:
            await send({"id": rid, "object": "text_completion", "created": int(time.time()),
                        "model": st.model, "choices": [],
                        "usage": {"prompt_tokens": len(prompt), "completion_tokens": n_out,
                                  "total_tokens": len(prompt) + n_out,
                                  "prompt_tokens_details": {"cached_tokens": cached}}})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    app[STATE_KEY] = st
    return app


class StubServerThread:
    """Run the stub in a background thread on 127.0.0.1 and a free port.

        with StubServerThread(StubState(fail_every=5)) as srv:
            srv.url  # http://127.0.0.1:<port>
    """

    def __init__(self, state: StubState | None = None, host: str = "127.0.0.1") -> None:
        self.state = state or StubState()
        self.host = host
        self.port: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> "StubServerThread":
        self._thread = threading.Thread(target=self._run, name="bench-stub", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("stub server did not start")
        if self._error:
            raise RuntimeError(f"stub server failed: {self._error}")
        return self

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            self._runner = web.AppRunner(make_app(self.state), handle_signals=False)
            loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, self.host, 0)
            loop.run_until_complete(site.start())
            self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        except BaseException as exc:  # noqa: BLE001 - reported to the caller
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        loop.run_forever()
        loop.run_until_complete(self._runner.cleanup())
        loop.close()

    def __exit__(self, *exc) -> None:
        if self._loop is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(10)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vllm_dsv41.tools.bench_stub",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--model", default="stub-model")
    ap.add_argument("--token-delay", type=float, default=0.0, help="seconds per output token")
    ap.add_argument("--chunk-size", type=int, default=1, help="tokens per streamed chunk")
    ap.add_argument("--fail-every", type=int, default=0, help="HTTP 500 on every n-th request")
    ap.add_argument("--short-every", type=int, default=0,
                    help="return one token too few on every n-th request")
    ap.add_argument("--no-token-ids", action="store_true", help="ignore return_token_ids")
    a = ap.parse_args(argv)
    st = StubState(model=a.model, token_delay=a.token_delay, chunk_size=max(1, a.chunk_size),
                   fail_every=a.fail_every, short_every=a.short_every, token_ids=not a.no_token_ids)
    web.run_app(make_app(st), host=a.host, port=a.port, print=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
