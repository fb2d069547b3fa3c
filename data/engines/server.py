"""A serving engine's process: started on a free loopback port in a session of its own, waited
for until its /health answers, and stopped with its whole process group.

llama.cpp's `llama-server` (data/engines/llama_cpp.py) and vLLM's `vllm serve`
(data/engines/vllm.py) are both a `ServerProcess`: each names its command line, its environment
and how patiently it is stopped; the start, the wait, the stop and the log are here.

    class MyServer(ServerProcess):
        name = "my-server"
        def command(self, port): return ["my-server", "--port", str(port)]

    with MyServer() as server:           # started, healthy
        server.post("/v1/completions", {...})

The server runs in its own session, so a terminal's Ctrl-C reaches Python alone, which stops it
(`__exit__`, and at interpreter exit for one left running); on Linux the kernel also sends it
SIGTERM if its parent dies outright. Its output goes to a temporary log file, whose last lines
every error quotes. A server that fails to start, dies, or refuses a request raises
`EngineError`, which the command lines print as one line (exit status 2).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from data.errors import DraftsmithError


class EngineError(DraftsmithError, RuntimeError):
    """A serving engine is missing, failed to start, died, or refused a request."""


_LIVE: set[ServerProcess] = set()


def _stop_all() -> None:
    for server in list(_LIVE):
        server.stop()


atexit.register(_stop_all)


def _die_with_parent() -> None:
    """In the child before exec: on Linux, ask for SIGTERM when the parent dies, so a server is
    not left running (and holding the CPU) after its Python process is killed outright."""
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except OSError:
            pass


class ServerProcess:
    """One server process on a free loopback port; a context manager (start on enter, stop on
    exit). A kind of server sets the class attributes and `command`; `env` and `describe` are
    optional."""

    name = "server"  # how messages name the program
    log_prefix = "server-"  # the temporary log file's name starts so
    health_route = "/health"  # answers 200 once the server takes requests
    poll_s = 0.2  # how often the start polls the health route
    log_lines = 20  # how much of the log an error quotes
    # the stop: each signal in turn to the whole session, then up to that many seconds' wait
    stop_plan: tuple[tuple[int, float], ...] = ((signal.SIGTERM, 10), (signal.SIGKILL, 10))

    def __init__(self, startup_timeout_s: float = 120.0) -> None:
        self.startup_timeout_s = startup_timeout_s
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self._log_file = None

    # ---- what a kind of server says ----------------------------------------------------------

    def command(self, port: int) -> list[str]:
        """The program and its arguments, listening on 127.0.0.1:`port`."""
        raise NotImplementedError

    def env(self) -> dict[str, str] | None:
        """The server's environment (None: this process's)."""
        return None

    def describe(self) -> str:
        """What it serves, for messages (e.g. its model)."""
        return ""

    def setup_hint(self) -> str:
        """How to get a program that runs, for a command that cannot be executed."""
        return "check the engine's installation"

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self):
        """Start the server and wait until it is healthy; on any failure (or Ctrl-C while
        waiting) it is stopped again before the error propagates."""
        cmd = self.command(port := free_port())
        env = self.env()
        self.port = port
        self._log_file = tempfile.NamedTemporaryFile(  # noqa: SIM115 (closed in stop)
            prefix=self.log_prefix, suffix=".log", delete=False
        )
        try:  # its own session: a terminal's Ctrl-C reaches Python, which stops it (stop())
            self.proc = subprocess.Popen(
                cmd,
                stdout=self._log_file,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        except OSError as e:  # not a program this machine runs (a broken or foreign build)
            self._log_file.close()
            raise EngineError(f"cannot run {cmd[0]}: {e.strerror}; {self.setup_hint()}.") from None
        _LIVE.add(self)
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EngineError(
                    f"{self.name} exited with code {self.proc.returncode} while starting "
                    f"({self.describe()}); its log {self._log_file.name} ends:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + self.health_route, timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(self.poll_s)
        raise EngineError(
            f"{self.name} was not healthy after {self.startup_timeout_s:.0f} s "
            f"({self.describe()}); its log ends:\n{self.log_tail()}"
        )

    def stop(self) -> None:
        """Stop the server and wait until it is gone: `stop_plan`'s signals in turn to its
        session, then SIGKILL to whatever of the session is left (a child process may outlive
        the one started). Safe to call twice."""
        if self.proc is not None and self.proc.poll() is None:
            for sig, wait_s in self.stop_plan:
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:  # gone already
                    break
                try:
                    self.proc.wait(timeout=wait_s)
                    break
                except subprocess.TimeoutExpired:
                    if sig == signal.SIGKILL:
                        raise
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        _LIVE.discard(self)
        if self._log_file is not None:
            self._log_file.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- talking to it -------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, lines: int | None = None) -> str:
        if self._log_file is None:
            return "(no log)"
        text = Path(self._log_file.name).read_text(errors="replace")
        return "\n".join(text.strip().splitlines()[-(lines or self.log_lines) :])

    def post(self, route: str, body: dict, timeout_s: float = 600) -> dict:
        """POST JSON to the server; a server that died or did not answer is an EngineError
        quoting its log."""
        try:
            return post_json(self.url + route, body, timeout_s)
        except ConnectionError as e:
            state = "died" if self.proc and self.proc.poll() is not None else "did not answer"
            raise EngineError(
                f"{self.name} {state} on {route} ({e}); its log ends:\n{self.log_tail()}"
            ) from None


def post_json(url: str, body: dict, timeout_s: float = 600) -> dict:
    """POST `body` as JSON and return the JSON answer. A server that answers with an error is
    an EngineError quoting it; one that cannot be reached raises ConnectionError (the caller
    knows what to add: a server's log, or a hint to start it)."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:500]
        raise EngineError(f"{url} refused the request ({e.code}): {detail}") from None
    except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
        raise ConnectionError(str(e)) from None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
