"""The driver's CPU and memory on the sweep's parent run (`DriverMetrics`), through the recorder's outbox."""
from __future__ import annotations

import threading
import time

from pipelines.recording.outbox import PARENT


class DriverMetrics:
    """The driver's system metrics on the parent run (MLflow's own collectors and names, ``system/...``, so the UI's
    system-metrics charts show them), sampled every `SAMPLE_S` and logged every `LOG_S` through the outbox: the one
    writer, where MLflow's `SystemMetricsMonitor` would be a second one. The actors' GPU utilisation is Ray's (the Ray
    dashboard's node metrics, `ray_node_gpus_utilization`), not repeated here."""

    SAMPLE_S, LOG_S = 10.0, 60.0

    def __init__(self, out):
        from mlflow.system_metrics.metrics.cpu_monitor import CPUMonitor

        self.out, self.key, self.monitor = out, PARENT, CPUMonitor()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="driver-metrics", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        step, last = 0, time.monotonic()
        while not self.done.wait(self.SAMPLE_S):
            self.monitor.collect_metrics()
            if time.monotonic() - last >= self.LOG_S:
                self._log(step)
                step, last = step + 1, time.monotonic()

    def _log(self, step: int) -> None:
        values = self.monitor.aggregate_metrics()
        self.monitor.clear_metrics()
        self.out.submit("metrics", self.key, metrics={f"system/{k}": v for k, v in values.items()}, step=step)

    def stop(self) -> None:
        self.done.set()
        self.thread.join(timeout=5)
