"""A throwaway Prometheus server (Debian's /usr/bin/prometheus) on a free 127.0.0.1 port for tests."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import yaml

from tandem.common.ports import free_port

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"


def static_job(name: str, targets: Sequence[tuple[str, Mapping[str, str]]]) -> dict[str, Any]:
    """A scrape job with one static group per target, each carrying its own labels."""
    return {
        "job_name": name,
        "static_configs": [
            {"targets": [address], "labels": dict(labels)} for address, labels in targets
        ],
    }


# The documented relabelling of engine pods (docs/autoscaling.md): keep prefill/decode pods' `http`
# port while Running, and copy namespace, pod name and the two tandem.dev labels onto every series.
ENGINE_POD_RELABELING: list[dict[str, Any]] = [
    {
        "source_labels": ["__meta_kubernetes_pod_label_tandem_dev_role"],
        "regex": "prefill|decode",
        "action": "keep",
    },
    {
        "source_labels": ["__meta_kubernetes_pod_container_port_name"],
        "regex": "http",
        "action": "keep",
    },
    {"source_labels": ["__meta_kubernetes_pod_phase"], "regex": "Running", "action": "keep"},
    {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
    {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
    {
        "source_labels": ["__meta_kubernetes_pod_label_tandem_dev_cluster"],
        "target_label": "tandem_dev_cluster",
    },
    {
        "source_labels": ["__meta_kubernetes_pod_label_tandem_dev_role"],
        "target_label": "tandem_dev_role",
    },
]


def engine_pods_job(http_sd_url: str) -> dict[str, Any]:
    """The engine-pod scrape job fed by an HTTP service-discovery endpoint that emits the same
    `__meta_kubernetes_*` labels as kubernetes_sd (Debian's Prometheus is built without it)."""
    return {
        "job_name": "tandem-engines",
        "http_sd_configs": [{"url": http_sd_url, "refresh_interval": "1s"}],
        "relabel_configs": ENGINE_POD_RELABELING,
    }


class PrometheusProcess:
    """One Prometheus with its own config and TSDB directory; `stop()` kills it and removes both."""

    def __init__(
        self,
        jobs: Sequence[Mapping[str, Any]],
        scrape_interval: str = "1s",
        rule_files: Sequence[Path] = (),
    ) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="tandem-prometheus-"))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config: dict[str, Any] = {
            "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
            "scrape_configs": [dict(job) for job in jobs],
        }
        if rule_files:
            config["rule_files"] = [str(path) for path in rule_files]
        (self.workdir / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))
        self.log = self.workdir / "prometheus.log"
        self._popen: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 30.0) -> PrometheusProcess:
        with self.log.open("wb") as log:
            self._popen = subprocess.Popen(
                [
                    PROMETHEUS,
                    f"--config.file={self.workdir / 'prometheus.yml'}",
                    f"--storage.tsdb.path={self.workdir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--storage.tsdb.retention.time=1h",
                    "--web.enable-lifecycle",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._popen.poll() is not None:
                raise RuntimeError(f"prometheus exited: {self.log.read_text()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/-/ready", timeout=1).status_code == 200:
                    return self
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("prometheus did not become ready")

    def targets(self) -> list[dict[str, Any]]:
        """Active scrape targets as /api/v1/targets reports them."""
        body = httpx.get(f"{self.url}/api/v1/targets", timeout=5).json()
        return list(body["data"]["activeTargets"])

    def wait_for_targets(self, count: int, timeout_s: float = 60.0) -> None:
        """Until `count` targets have been scraped successfully (discovery alone takes ~5 s)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            targets = self.targets()
            if len(targets) >= count and all(t["health"] == "up" for t in targets):
                return
            time.sleep(0.3)
        raise TimeoutError(f"{count} targets not up after {timeout_s}s: {self.targets()}")

    def stop(self) -> None:
        if self._popen is not None and self._popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._popen.pid, signal.SIGTERM)
            try:
                self._popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self._popen.pid, signal.SIGKILL)
                self._popen.wait(timeout=10)
        shutil.rmtree(self.workdir, ignore_errors=True)


@contextlib.contextmanager
def running_prometheus(
    jobs: Sequence[Mapping[str, Any]], scrape_interval: str = "1s", rule_files: Sequence[Path] = ()
) -> Iterator[PrometheusProcess]:
    server = PrometheusProcess(jobs, scrape_interval, rule_files).start()
    try:
        yield server
    finally:
        server.stop()
