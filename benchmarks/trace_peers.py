"""The peers of the trace comparison that take more than a command line: SMG's package, and llm-d's
router (its EPP, standalone, behind Envoy with the ext_proc filter, as llm-d's standalone chart
wires them). Neither binary is built here: the benchmark takes them by path (docs/bench.md)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from router_bench import MODEL, PEERS, Proc

from tandem.common.ports import free_port
from tandem.router.epp.envoy_config import gateway_config

SMG_PACKAGE = "smg==1.13.0"


def ensure_smg() -> None:
    """SMG 1.13.0 as `bin/smg`. sglang-router installs a `bin/smg` of its own (sglang-router
    under another name), so the file's presence proves nothing: its version decides, and the
    package is reinstalled over sglang-router's script when it is not SMG's."""
    smg = PEERS / "bin" / "smg"
    version = SMG_PACKAGE.split("==")[1]
    if smg.exists():
        shown = subprocess.run([str(smg), "--version"], capture_output=True, text=True)
        if shown.stdout.split() == ["smg", version]:
            return
    pip = [str(PEERS / "bin" / "pip"), "install", "-q", "--force-reinstall"]
    subprocess.run([*pip, SMG_PACKAGE], check=True)


# -- llm-d: the EPP behind Envoy -----------------------------------------------------------------


def epp_config(endpoints_file: Path) -> dict[str, Any]:
    """The EPP's EndpointPickerConfig: endpoints from a file, vLLM metrics scraped from each
    engine's /metrics, and the default profile of llm-d's chart (queue 2, KV-cache utilization 2,
    prefix cache 3) picked by maximum score. The approximate prefix producer's block is 128 tokens
    (the trace's blocks after scaling; it clamps anything below 64 up to 64)."""
    return {
        "apiVersion": "llm-d.ai/v1alpha1",
        "kind": "EndpointPickerConfig",
        "plugins": [
            {"name": "file-discovery", "type": "file-discovery",
             "parameters": {"path": str(endpoints_file), "watchFile": False}},
            {"type": "metrics-data-source",
             "parameters": {"scheme": "http", "path": "/metrics"}},
            {"type": "core-metrics-extractor"},
            {"type": "single-profile-handler"},
            {"type": "approx-prefix-cache-producer",
             "parameters": {"autoTune": False, "blockSizeTokens": 128,
                            "lruCapacityPerServer": 31250}},
            {"type": "prefix-cache-scorer",
             "parameters": {"prefixMatchInfoProducerName": "approx-prefix-cache-producer"}},
            {"type": "kv-cache-utilization-scorer"},
            {"type": "queue-scorer"},
            {"type": "max-score-picker"},
        ],
        "dataLayer": {
            "discovery": {"pluginRef": "file-discovery"},
            "sources": [{"pluginRef": "metrics-data-source",
                         "extractors": [{"pluginRef": "core-metrics-extractor"}]}],
        },
        "schedulingProfiles": [{"name": "default", "plugins": [
            {"pluginRef": "queue-scorer", "weight": 2},
            {"pluginRef": "kv-cache-utilization-scorer", "weight": 2},
            {"pluginRef": "prefix-cache-scorer", "weight": 3},
            {"pluginRef": "max-score-picker"},
        ]}],
    }  # fmt: skip


class LlmdRouter:
    """The EPP and the Envoy in front of it, started and stopped together; `url` is Envoy's."""

    def __init__(self, epp: Path, envoy: Path, ports: list[int]) -> None:
        self.scratch = Path(tempfile.mkdtemp(prefix="tandem-llmd-"))
        endpoints = self.scratch / "endpoints.yaml"
        entries = [
            {"name": f"engine-{i}", "address": "127.0.0.1", "port": str(port)}
            for i, port in enumerate(ports)
        ]
        endpoints.write_text(json.dumps({"endpoints": entries}))
        config = self.scratch / "epp.yaml"
        config.write_text(json.dumps(epp_config(endpoints)))
        grpc_port = free_port()
        self.epp = Proc("llmd-epp", [
            str(epp), "--config-file", str(config), "--pool-name", "tandem-trace",
            "--pool-namespace", "default", "--grpc-port", str(grpc_port),
            "--grpc-health-port", str(free_port()), "--metrics-port", str(free_port()),
            "--secure-serving=false", "--health-checking=false", "--enable-pprof=false",
            "--ha-enable-leader-election=false", "--zap-log-level", "error",
        ], grpc_port)  # fmt: skip
        port = free_port()
        envoy_file = self.scratch / "envoy.json"
        # Envoy as llm-d's standalone chart configures it, and as Tandem's own picker is tested
        config = gateway_config(
            port,
            free_port(),
            ("127.0.0.1", grpc_port),
            message_timeout_s=600,
            response_headers=True,
        )
        envoy_file.write_text(json.dumps(config))
        self.envoy = Proc("llmd-envoy", [
            str(envoy), "-c", str(envoy_file), "--disable-hot-restart", "--log-level", "warn",
        ], port)  # fmt: skip
        self.url = self.envoy.url

    async def wait_ready(self, limit_s: float = 90.0) -> None:
        """One completion through Envoy and the EPP (the EPP answers 503 until its first scrape
        of the engines' metrics)."""
        await first_completion(self.url, [self.epp, self.envoy], limit_s)

    def cpu_seconds(self) -> float:
        return self.epp.cpu_seconds() + self.envoy.cpu_seconds()

    def stop(self) -> None:
        self.envoy.stop()
        self.epp.stop()


async def first_completion(url: str, procs: list[Proc], limit_s: float) -> None:
    """Wait until a one-token completion through `url` answers 200."""
    body = {"model": MODEL, "prompt": "ready?", "max_tokens": 1}
    deadline = time.monotonic() + limit_s
    status, text = 0, ""
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            for proc in procs:
                if proc.proc.poll() is not None:
                    raise RuntimeError(f"{proc.name} exited: {proc.log_path.read_text()[-2000:]}")
            try:
                async with session.post(
                    url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=10)
                ) as r:
                    status, text = r.status, await r.text()
                    if status == 200:
                        return
            except (aiohttp.ClientError, TimeoutError) as exc:
                text = repr(exc)
            await asyncio.sleep(0.5)
    logs = "\n".join(p.log_path.read_text()[-1500:] for p in procs)
    raise TimeoutError(f"{url} not serving ({status} {text[:300]}): {logs}")
