"""A real `mlflow server` on loopback that tests can stop and start again (the same SQLite store and artifact folder),
for the tests of a tracking store that goes down mid-sweep."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """``with MlflowServer(tmp) as server: ... server.stop(); ... server.start()``; ``server.uri``."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.port = _free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 180) -> "MlflowServer":
        mlflow = str(Path(sys.executable).parent / "mlflow")
        self.proc = subprocess.Popen(
            [mlflow, "server", "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
             "--backend-store-uri", f"sqlite:///{self.folder / 'mlflow.db'}",
             "--artifacts-destination", str(self.folder / "artifacts")],
            stdout=open(self.folder / "server.log", "a"), stderr=subprocess.STDOUT, start_new_session=True,
            # no job runner: MLflow 3's server otherwise starts about ten huey consumer processes (~4 s of CPU
            # each, ~40 s per start on 2 cores) for GenAI jobs these tests never submit
            env={**os.environ, "MLFLOW_TRACKING_URI": "", "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited: {(self.folder / 'server.log').read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        else:
            self.stop()
            raise RuntimeError(f"mlflow server did not answer on {self.uri} within {timeout_s:g}s")
        while time.monotonic() < deadline:  # its first tracking request (the store opened) answered: warm
            try:
                search = urllib.request.Request(f"{self.uri}/api/2.0/mlflow/experiments/search", method="POST",
                                                data=b'{"max_results": 1}',
                                                headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(search, timeout=30) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"mlflow server did not answer on {self.uri} within {timeout_s:g}s")

    def stop(self) -> None:
        if self.proc is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(timeout=10)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        self.proc = None

    def __enter__(self) -> "MlflowServer":
        return self.start()

    def __exit__(self, *exc) -> bool:
        self.stop()
        return False
