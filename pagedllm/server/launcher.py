"""Start ``pagedllm serve`` as a child process on a free local port and wait until it
answers ``/health``; used by the server tests and the serving benchmark."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from types import TracebackType

import httpx

from pagedllm.engine.tensor_parallel.launch import free_port

LOCALHOST = "127.0.0.1"


class ServerProcess:
    """A ``pagedllm serve`` child on ``127.0.0.1``; a context manager.

    ``serve_args``: options after ``serve`` (engine and HTTP options, not host/port).
    ``entry``: the command that runs pagedllm's CLI (default: this Python with
    ``-m pagedllm.cli``); ``subcommand``: ``serve``, or ``router``. The child's output
    goes to a temporary log, shown when start-up fails.
    """

    def __init__(
        self,
        serve_args: list[str],
        startup_timeout_s: float = 300.0,
        entry: list[str] | None = None,
        subcommand: str = "serve",
        port: int | None = None,
    ) -> None:
        """``port``: the local port to serve on (default: a free one)."""
        self.port = free_port() if port is None else port
        self._subcommand = subcommand
        self.base_url = f"http://{LOCALHOST}:{self.port}"
        self._args = serve_args
        self._entry = entry or [sys.executable, "-m", "pagedllm.cli"]
        self._startup_timeout_s = startup_timeout_s
        self._log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed in __exit__)
        self.process: subprocess.Popen | None = None

    def start(self) -> ServerProcess:
        command = [*self._entry, self._subcommand, "--host", LOCALHOST]
        command += ["--port", str(self.port), *self._args]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
        self.process = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, env=env
        )
        deadline = time.monotonic() + self._startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited during start-up:\n{self.log()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(
            f"the server did not start in {self._startup_timeout_s} s:\n{self.log()}"
        )

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGINT (graceful shutdown), then SIGKILL after ``timeout_s``; the exit code."""
        if self.process is None:
            return 0
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def log(self) -> str:
        self._log.flush()
        self._log.seek(0)
        return self._log.read()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()
        self._log.close()
