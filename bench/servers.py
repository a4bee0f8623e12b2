"""Real servers on loopback for the tests and the benches: start one on a free port, wait until it is healthy,
stop it afterwards."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def server_process(argv_for_port, log_path: Path, env: dict, timeout: float, procs: list | None = None):
    """Start a server (`argv_for_port(port)`) on a free localhost port, wait until GET /health answers 200, yield
    its URL, and stop it afterwards. The server's log goes to `log_path` and into any failure message; its process
    is appended to `procs` where given (to read its memory, say)."""
    port = free_port()
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(
            argv_for_port(port), stdout=log_file, stderr=subprocess.STDOUT, env=dict(os.environ, **env)
        )
    if procs is not None:
        procs.append(proc)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited: {log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not healthy in {timeout}s: {log_path.read_text()[-3000:]}")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def transformers_serve(model: Path, log_path: Path, timeout: float = 90.0):
    """A real `transformers serve` (OpenAI-compatible), pinned to `model`."""

    def argv(port: int) -> list[str]:
        cli = [sys.executable, "-m", "transformers.cli.transformers", "serve", str(model)]
        return cli + ["--host", "127.0.0.1", "--port", str(port), "--device", "cpu"]

    # OMP_NUM_THREADS=1: a tiny model on 2 cores, threads only contend
    return server_process(argv, log_path, {"OMP_NUM_THREADS": "1"}, timeout)


def bare_target(tok=None):
    """The target as a client of servers whose model this process never reads sees it (a fake server's fleet, a
    bench of the client alone): its tokenizer (None: none), no template facts, no fingerprints."""
    from draftdata.model.target import Target

    return Target(tok, None, frozenset(), (), "", "", None, False)
