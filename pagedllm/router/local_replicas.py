"""``pagedllm serve --data-parallel-size N``: N replicas on this machine, each an
ordinary ``pagedllm serve`` on its own local port and its own share of the CPUs, kept
running (a replica that exits is started again on the same port, where the router
takes it back)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time

from pagedllm.engine.tensor_parallel.launch import free_port
from pagedllm.server.launcher import LOCALHOST

logger = logging.getLogger("pagedllm.router")

RESTART_DELAY_S = 1.0

_ROUTER_OPTIONS = (
    "--host", "--port", "--data-parallel-size", "--routing-policy", "--max-share",
    "--rendezvous", "--join-router", "--advertise-url",
)  # fmt: skip
"""``serve`` options that belong to the router, not to the replicas."""


def replica_argv(argv: list[str]) -> list[str]:
    """``serve``'s arguments without the router's options (each ``--opt value`` or
    ``--opt=value``)."""
    kept, skip = [], False
    for token in argv:
        if skip:
            skip = False
        elif token in _ROUTER_OPTIONS:
            skip = True
        elif not token.startswith(tuple(f"{option}=" for option in _ROUTER_OPTIONS)):
            kept.append(token)
    return kept


def split_cpus(count: int) -> list[list[int]]:
    """This process's CPUs in ``count`` contiguous groups (shared round-robin when there
    are fewer CPUs than groups)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < count:
        return [[cpus[i % len(cpus)]] for i in range(count)]
    size, extra = divmod(len(cpus), count)
    groups, start = [], 0
    for index in range(count):
        end = start + size + (index < extra)
        groups.append(cpus[start:end])
        start = end
    return groups


class LocalReplicas:
    """``count`` replica processes started with ``serve_args``; a context manager."""

    def __init__(self, serve_args: list[str], count: int, global_args: list[str] = ()) -> None:
        self.ports = [free_port() for _ in range(count)]
        self.urls = [f"http://{LOCALHOST}:{port}" for port in self.ports]
        self.cpus = split_cpus(count)
        self._serve_args = serve_args
        self._global_args = list(global_args)
        self._processes: list[subprocess.Popen | None] = [None] * count
        self._stopping = threading.Event()
        self._supervisor = threading.Thread(target=self._supervise, daemon=True)

    def _spawn(self, index: int) -> None:
        cpus = self.cpus[index]
        command = [sys.executable, "-m", "pagedllm.cli", *self._global_args, "serve"]
        command += ["--host", LOCALHOST, "--port", str(self.ports[index]), *self._serve_args]
        env = {**os.environ, "OMP_NUM_THREADS": str(len(cpus))}
        self._processes[index] = subprocess.Popen(
            command, env=env, preexec_fn=lambda: os.sched_setaffinity(0, cpus)
        )
        logger.info("replica %d: pid %d on CPUs %s", index, self._processes[index].pid, cpus)

    def _supervise(self) -> None:
        while not self._stopping.wait(0.5):
            for index, process in enumerate(self._processes):
                if process is not None and process.poll() is not None:
                    logger.warning(
                        "replica %d exited (%s); starting it again", index, process.returncode
                    )
                    time.sleep(RESTART_DELAY_S)
                    if not self._stopping.is_set():
                        self._spawn(index)

    def pid(self, index: int) -> int:
        return self._processes[index].pid

    def __enter__(self) -> LocalReplicas:
        for index in range(len(self.ports)):
            self._spawn(index)
        self._supervisor.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stopping.set()
        self._supervisor.join()
        for process in self._processes:
            if process is not None and process.poll() is None:
                process.terminate()
        for process in self._processes:
            if process is None:
                continue
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
