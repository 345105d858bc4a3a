"""Streaming OpenAI ``/v1/completions`` client for ``vllm-dsv41-bench``.

One call of :func:`stream_completion` sends one token-id prompt with exact
output length (``max_tokens`` = ``min_tokens``, ``ignore_eos``), times every
streamed chunk, verifies the token counts reported in ``usage`` and returns a
flat per-request record.  Failures never raise: they come back as records with
``status="failed"`` and a one-line ``error``.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from vllm_dsv41.tools.bench_stats import median, request_interactivity, tokens_itls

BODY_HEAD = 300  # characters of an error body kept in the record


class ServerUnreachable(RuntimeError):
    """The server could not be contacted at all (connection refused, DNS, ...)."""


@dataclass
class ClientConfig:
    base_url: str
    model: str
    api_key: str | None = None
    request_timeout: float = 1800.0
    temperature: float = 0.0
    return_token_ids: bool = True
    continuous_usage_stats: bool = False
    save_itls: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)

    @property
    def completions_url(self) -> str:
        return self.base_url.rstrip("/") + "/v1/completions"

    def headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h


def normalize_base_url(url: str) -> str:
    """Accept ``http://h:p``, ``http://h:p/`` and ``http://h:p/v1``."""
    u = url.strip().rstrip("/")
    if u.endswith("/v1"):
        u = u[: -len("/v1")]
    if "://" not in u:
        u = "http://" + u
    return u


async def list_models(session: aiohttp.ClientSession, base_url: str,
                      api_key: str | None = None, timeout: float = 10.0) -> list[str]:
    """Model ids from ``GET /v1/models``.

    Raises :class:`ServerUnreachable` when nothing answers, ``RuntimeError``
    with the HTTP status and body head when the server answers with an error."""
    url = base_url.rstrip("/") + "/v1/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with session.get(url, headers=headers,
                               timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            body = await resp.text()
            if resp.status != 200:
                raise RuntimeError(f"GET {url} returned HTTP {resp.status}: {_head(body)}")
    except (aiohttp.ClientConnectionError, asyncio.TimeoutError, OSError) as exc:
        raise ServerUnreachable(_exc_text(exc)) from exc
    try:
        data = json.loads(body)
        return [m["id"] for m in data.get("data", [])]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise RuntimeError(f"GET {url} returned an unexpected body: {_head(body)}") from exc


def _head(text: str) -> str:
    t = " ".join(str(text).split())
    return t[:BODY_HEAD] + ("..." if len(t) > BODY_HEAD else "")


def _exc_text(exc: BaseException) -> str:
    s = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {s}" if type(exc).__name__ not in s else s


def build_payload(cfg: ClientConfig, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    stream_options: dict[str, Any] = {"include_usage": True}
    if cfg.continuous_usage_stats:
        stream_options["continuous_usage_stats"] = True
    payload: dict[str, Any] = {
        "model": cfg.model,
        "prompt": prompt,
        "max_tokens": int(max_tokens),
        "min_tokens": int(max_tokens),
        "ignore_eos": True,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": stream_options,
    }
    if cfg.return_token_ids:
        payload["return_token_ids"] = True
    payload.update(cfg.extra_body)
    return payload


@dataclass
class _StreamState:
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    saw_token_ids: bool = False
    saw_continuous_usage: bool = False
    last_usage_completion: int = 0
    usage: dict[str, Any] | None = None
    error: str | None = None
    done: bool = False

    def on_event(self, data: str, now: float) -> None:
        if data == "[DONE]":
            self.done = True
            return
        try:
            obj = json.loads(data)
        except ValueError:
            self.error = f"unparseable stream event: {_head(data)}"
            return
        if not isinstance(obj, dict):
            self.error = f"unexpected stream event: {_head(data)}"
            return
        if obj.get("error"):
            err = obj["error"]
            msg = err.get("message", err) if isinstance(err, dict) else err
            self.error = f"error in stream: {_head(str(msg))}"
            return
        usage = obj.get("usage")
        choices = obj.get("choices") or []
        n_tok = 0
        for ch in choices:
            ids = ch.get("token_ids")
            if ids is not None:
                self.saw_token_ids = True
                self.token_ids.extend(ids)
                n_tok += len(ids)
            elif usage and usage.get("completion_tokens") is not None:
                self.saw_continuous_usage = True
                n_tok += max(0, int(usage["completion_tokens"]) - self.last_usage_completion)
            elif ch.get("text"):
                n_tok += 1  # heuristic; rescaled against usage at the end
        if usage:
            self.usage = usage
            if usage.get("completion_tokens") is not None:
                self.last_usage_completion = int(usage["completion_tokens"])
        if n_tok > 0:
            if self.chunk_times and self.chunk_times[-1] == now:
                # several events in one network read reached the user together:
                # one chunk, so the gap is shared by all its tokens
                self.chunk_tokens[-1] += n_tok
            else:
                self.chunk_times.append(now)
                self.chunk_tokens.append(n_tok)


async def stream_completion(session: aiohttp.ClientSession, cfg: ClientConfig,
                            prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """Send one streaming completion and return its record (see module doc).

    Keys: ``status`` (ok|failed), ``error``, ``http_status``, ``prompt_tokens``
    (sent), ``max_tokens``, ``output_tokens`` (streamed), ``usage_prompt_tokens``,
    ``usage_completion_tokens``, ``cached_tokens``, ``ttft_s``, ``e2e_s``,
    ``tpot_s``, ``itl_median_s``, ``interactivity``, ``itls_s`` (when saved),
    ``token_count_source`` and, internally, ``_output_ids``.  Cancellation
    (Ctrl-C) propagates as ``asyncio.CancelledError``."""
    rec: dict[str, Any] = {
        "status": "failed", "error": None, "http_status": None,
        "prompt_tokens": len(prompt), "max_tokens": int(max_tokens), "output_tokens": 0,
        "usage_prompt_tokens": None, "usage_completion_tokens": None, "cached_tokens": None,
        "ttft_s": None, "e2e_s": None, "tpot_s": None, "itl_median_s": None,
        "interactivity": None, "token_count_source": None,
    }
    st = _StreamState()
    payload = build_payload(cfg, prompt, max_tokens)
    t0 = time.perf_counter()
    try:
        async with session.post(cfg.completions_url, json=payload, headers=cfg.headers(),
                                timeout=aiohttp.ClientTimeout(total=cfg.request_timeout)) as resp:
            rec["http_status"] = resp.status
            if resp.status != 200:
                body = await resp.text(errors="replace")
                rec["error"] = f"HTTP {resp.status}: {_head(body)}"
                rec["e2e_s"] = time.perf_counter() - t0
                return rec
            buf = b""
            async for data in resp.content.iter_any():
                now = time.perf_counter()
                buf += data
                while True:
                    nl = buf.find(b"\n")
                    if nl < 0:
                        break
                    line, buf = buf[:nl].strip(), buf[nl + 1:]
                    if line.startswith(b"data:"):
                        st.on_event(line[5:].strip().decode("utf-8", "replace"), now)
                        if st.error:
                            break
                if st.error or st.done:
                    break
            if not st.error and not st.done and buf.strip().startswith(b"data:"):
                st.on_event(buf.strip()[5:].strip().decode("utf-8", "replace"), time.perf_counter())
    except asyncio.TimeoutError:
        rec["error"] = f"timeout after {cfg.request_timeout:g}s"
    except aiohttp.ClientConnectionError as exc:
        rec["error"] = f"connection error: {_exc_text(exc)}"
    except aiohttp.ClientError as exc:
        rec["error"] = f"client error: {_exc_text(exc)}"
    t_end = time.perf_counter()
    rec["e2e_s"] = t_end - t0
    _finish(rec, st, t0, cfg.save_itls)
    return rec


def _finish(rec: dict[str, Any], st: _StreamState, t0: float, save_itls: bool) -> None:
    """Derive timing metrics and check the token counts."""
    streamed = sum(st.chunk_tokens)
    exact = st.saw_token_ids or st.saw_continuous_usage
    rec["token_count_source"] = ("token_ids" if st.saw_token_ids else
                                 "continuous_usage" if st.saw_continuous_usage else "chunks")
    u = st.usage or {}
    up, uc = u.get("prompt_tokens"), u.get("completion_tokens")
    rec["usage_prompt_tokens"], rec["usage_completion_tokens"] = up, uc
    details = u.get("prompt_tokens_details") or {}
    if isinstance(details, dict) and details.get("cached_tokens") is not None:
        rec["cached_tokens"] = int(details["cached_tokens"])
    rec["output_tokens"] = int(uc) if (uc is not None and not exact) else streamed
    if st.saw_token_ids:
        rec["_output_ids"] = st.token_ids

    if st.chunk_times:
        rec["ttft_s"] = st.chunk_times[0] - t0
        itls = tokens_itls(st.chunk_times, st.chunk_tokens)
        n_out = rec["output_tokens"]
        if not exact and uc is not None and len(st.chunk_times) > 1 and int(uc) > 1:
            # text chunks may carry several tokens: spread each gap evenly
            scale = (len(st.chunk_times) - 1) / (int(uc) - 1)
            itls = [x * scale for x in itls]
        if n_out > 1:
            rec["tpot_s"] = (st.chunk_times[-1] - st.chunk_times[0]) / (n_out - 1)
        rec["itl_median_s"] = median(itls)
        rec["interactivity"] = request_interactivity(itls)
        if save_itls:
            rec["itls_s"] = [round(x, 7) for x in itls]

    if rec["error"] is None:
        rec["error"] = st.error
    if rec["error"] is None and not st.done and st.usage is None:
        rec["error"] = "stream ended without [DONE] or usage"
    if rec["error"] is None:
        if st.usage is None:
            rec["error"] = "no usage in stream (server ignored stream_options.include_usage)"
        elif up != rec["prompt_tokens"]:
            rec["error"] = f"prompt token mismatch: sent {rec['prompt_tokens']}, usage says {up}"
        elif uc != rec["max_tokens"]:
            rec["error"] = f"completion token mismatch: requested {rec['max_tokens']}, usage says {uc}"
        elif exact and streamed != rec["max_tokens"]:
            rec["error"] = f"streamed {streamed} tokens, requested {rec['max_tokens']}"
        elif not st.chunk_times:
            rec["error"] = "no tokens streamed"
    rec["status"] = "ok" if rec["error"] is None else "failed"
