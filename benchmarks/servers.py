"""A ``captioner serve`` (or any command taking ``--port``) on a free localhost port, for the benchmarks.

Shared by ``bench_serving.py`` and ``reliability.py``; benchmarks never import the ``tests`` package, which has its
own fixture for the same job.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_on_sigterm() -> None:
    """Make SIGTERM (what ``timeout`` sends) raise SystemExit in the main thread, so that the ``finally`` blocks
    that stop the servers run: by default the process dies at once and leaves its servers running."""
    def leave(signum, frame) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, leave)


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    """A field of ``/proc/PID/status`` in MiB (``VmRSS`` now, ``VmHWM`` the peak)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Server:
    """Starts ``command --port PORT`` with ``env`` added to this process's environment, logging to ``log``;
    ``params``: query parameters the load generator adds to each caption request (a client-side option)."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], log: Path, params: dict | None = None):
        self.name, self.port, self.params = name, free_port(), params or {}
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log, "w")
        self.proc = subprocess.Popen([*command, "--port", str(self.port)], cwd=ROOT, env={**os.environ, **env},
                                     stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float = 600) -> None:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {Path(self.log.name).read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready after {timeout_s} s")

    def cpu_seconds(self) -> float:
        """CPU time the server process has used so far (user + system, all its threads)."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def rss(self, field: str = "VmRSS") -> float:
        return rss_mib(self.proc.pid, field)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
