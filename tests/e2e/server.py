"""A real vLLM OpenAI server over the tiny checkpoint, for end-to-end tests.

``tiny_server`` (session scope) starts ``python -m vllm.entrypoints.openai.api_server`` (``vllm serve``
crashes on the CPU wheel) on 127.0.0.1 and a free port, in its own process group, with its output in a
log file; it waits for ``GET /v1/models`` (failing fast, with the log tail, if the process dies) and
kills the whole group at the end of the session.  It yields a :class:`ServerURL`: the base URL as a
``str`` (``http://127.0.0.1:PORT``) that also carries the process, the log path and helpers.

Use it from any test module with::

    from tests.e2e.server import tiny_server  # noqa: F401

Every module (or conftest) that imports the fixture gets its own pytest definition of it; the server
itself is shared through a reference-counted registry here, so one session starts one server per
(checkpoint, arguments) however many modules import the fixture.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

HOST = "127.0.0.1"
SERVED_NAME = "tiny"
STARTUP_TIMEOUT_S = float(os.environ.get("DSV41_TEST_SERVER_TIMEOUT", "180"))
# The tiny model's server: eager, fp32, a short context.  --enable-prompt-tokens-details makes
# usage.prompt_tokens_details.cached_tokens (prefix-cache hits) visible to clients.
TINY_SERVER_ARGS = ("--enforce-eager", "--dtype", "float32", "--max-model-len", "1024",
                    "--served-model-name", SERVED_NAME, "--enable-prompt-tokens-details")


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((HOST, port)) == 0


def _set_parent_death_signal() -> None:  # runs in the child between fork and exec
    """Have the kernel SIGTERM the server if the test process dies without tearing it down."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class ServerURL(str):
    """The base URL of a running server (a ``str``) plus its process and log."""

    proc: subprocess.Popen
    log_path: Path
    port: int
    startup_s: float

    def __new__(cls, url: str, proc: subprocess.Popen, log_path: Path, port: int):
        self = super().__new__(cls, url)
        self.proc, self.log_path, self.port, self.startup_s = proc, log_path, port, 0.0
        return self

    @property
    def url(self) -> str:
        return str(self)

    def log_text(self, start: int = 0) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(start)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def log_size(self) -> int:
        try:
            return self.log_path.stat().st_size
        except OSError:
            return 0

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def assert_alive(self) -> None:
        rc = self.proc.poll()
        if rc is not None:
            raise AssertionError(f"the server process exited with code {rc}; log {self.log_path}:\n"
                                 f"{self.log_tail()}")

    def _group_alive(self) -> bool:
        from vllm_dsv41.tools.bench import process_group_alive

        return process_group_alive(self.proc.pid)

    def stop(self, grace_s: float = 20.0) -> float:
        """SIGTERM the process group, SIGKILL what is left after ``grace_s``; returns the seconds it
        took.  Raises if anything of the group survives SIGKILL or the port stays open."""
        t0 = time.monotonic()
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            if not self._group_alive():
                break
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                self.proc.poll()  # reap the leader
                if not self._group_alive():
                    break
                time.sleep(0.1)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        if self._group_alive():
            raise RuntimeError(f"server process group {self.proc.pid} survived SIGKILL")
        if port_open(self.port):
            raise RuntimeError(f"port {self.port} still open after the server was stopped")
        return time.monotonic() - t0


def get_json(url: str, timeout: float = 5.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def start_server(model: str, log_path: Path, *, args=TINY_SERVER_ARGS, env: dict | None = None,
                 timeout_s: float = STARTUP_TIMEOUT_S) -> ServerURL:
    """Start the OpenAI server for ``model`` on 127.0.0.1 and wait until ``/v1/models`` answers."""
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--host", HOST, "--port", str(port), *args]
    full_env = dict(os.environ)
    # In-process model executor (the API server still runs its engine core in a child process):
    # ~16 s to ready on the 2-core box instead of ~27 s with a separate worker, same throughput.
    full_env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
                    PYTHONUNBUFFERED="1")
    full_env.pop("VLLM_DSV41_EXACT", None)  # the server runs in the default (pruning/replay) mode
    full_env.update(env or {})
    log_path = Path(log_path)
    log = open(log_path, "ab")
    log.write(("$ " + " ".join(cmd) + "\n").encode())
    log.flush()
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                            env=full_env, start_new_session=True,
                            preexec_fn=_set_parent_death_signal)
    log.close()
    srv = ServerURL(f"http://{HOST}:{port}", proc, log_path, port)
    last = ""
    while True:
        rc = proc.poll()
        if rc is not None:
            srv.stop()
            raise RuntimeError(f"the server exited with code {rc} before it came up; "
                               f"log {log_path}:\n{srv.log_tail()}")
        try:
            models = get_json(srv + "/v1/models", timeout=5.0)
            if any(m.get("id") for m in models.get("data", [])):
                break
            last = f"/v1/models listed no model: {models}"
        except (urllib.error.URLError, ConnectionError, OSError, ValueError) as exc:
            last = repr(exc)
        if time.monotonic() - t0 > timeout_s:
            tail = srv.log_tail()
            srv.stop()
            raise RuntimeError(f"the server was not ready after {timeout_s:g} s ({last}); "
                               f"log {log_path}:\n{tail}")
        time.sleep(0.5)
    srv.startup_s = time.monotonic() - t0
    return srv


# one server per (model, args), shared by every definition of the fixture: {key: [server, refs]}
_SERVERS: dict[tuple, list] = {}


@contextlib.contextmanager
def shared_server(model: str, log_dir: Path, args=TINY_SERVER_ARGS):
    key = (model, tuple(args))
    entry = _SERVERS.get(key)
    if entry is None or not entry[0].alive():
        log_path = Path(log_dir) / "server.log"
        srv = start_server(model, log_path, args=args)
        print(f"\n[tiny_server] {srv} ready in {srv.startup_s:.1f} s (log {log_path})", flush=True)
        entry = _SERVERS[key] = [srv, 0]
    entry[1] += 1
    try:
        yield entry[0]
    finally:
        entry[1] -= 1
        if entry[1] == 0:
            srv = entry[0]
            del _SERVERS[key]
            died = srv.proc.poll()
            took = srv.stop()
            print(f"\n[tiny_server] {srv} stopped in {took:.1f} s", flush=True)
            if died is not None:
                raise RuntimeError(f"the server had exited by itself (code {died}) before the end "
                                   f"of the session; log {srv.log_path}:\n{srv.log_tail()}")


@pytest.fixture(scope="session")
def tiny_server(tiny_ckpt, tmp_path_factory):
    """The tiny checkpoint served on 127.0.0.1 (default mode: pruning and prefix replay on)."""
    try:
        cm = shared_server(tiny_ckpt, tmp_path_factory.mktemp("tiny_server"))
        srv = cm.__enter__()
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)
    try:
        yield srv
    finally:
        cm.__exit__(None, None, None)
