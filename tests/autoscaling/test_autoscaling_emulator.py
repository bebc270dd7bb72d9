"""A real Prometheus scraping real emulator processes under load; the client and the decision scale the loaded pool."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from load_generator import drive
from prometheus_process import PrometheusProcess, running_prometheus, static_job
from tandem_process import TandemProcess

from tandem.common.ports import free_port
from tandem.operator.autoscaling.decision import ScalingMemory, decide
from tandem.operator.autoscaling.policy import pool_policies
from tandem.operator.autoscaling.prometheus import PrometheusClient
from tandem.operator.autoscaling.queries import PoolSelector, read_pool_signals

pytestmark = [pytest.mark.timeout(90), pytest.mark.slow]

PROFILE = Path(__file__).with_name("small-gpu-profile.yaml")
POLICIES = pool_policies(
    {
        "enabled": True,
        "prefill": {"min": 1, "max": 4, "targetTTFTSeconds": 0.5},
        "decode": {"min": 1, "max": 4, "targetITLSeconds": 0.05, "maxKVUsage": 0.85},
        "metricsWindowSeconds": 6,
        "scaleDownStabilizationSeconds": 30,
    }
)


def start_emulator(pool: str) -> TandemProcess:
    port = free_port()
    args = ["emulate", "--model", "tiny", "--host", "127.0.0.1", "--port", str(port),
            "--timing-profile", str(PROFILE), "--log-level", "WARNING"]  # fmt: skip
    return TandemProcess(f"emulator-{pool}", args, port)


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[PrometheusProcess, dict[str, str]]]:
    processes = {pool: start_emulator(pool) for pool in ("prefill", "decode")}
    urls = {pool: process.url for pool, process in processes.items()}
    targets = [
        (
            f"127.0.0.1:{process.port}",
            {"namespace": "serving", "tandem_dev_cluster": "llama", "tandem_dev_role": pool},
        )
        for pool, process in processes.items()
    ]
    try:
        for process in processes.values():
            process.wait_ready(timeout=20)
        with running_prometheus([static_job("engines", targets)]) as prometheus:
            prometheus.wait_for_targets(2)
            yield prometheus, urls
    finally:
        for process in processes.values():
            process.stop()


async def test_prefill_overload_scales_prefill_and_not_decode(
    engines: tuple[PrometheusProcess, dict[str, str]],
) -> None:
    prometheus, urls = engines
    # Prefill engine: 3 req/s of 256-token prompts is about twice what one engine prefills.
    # Decode engine: light traffic, well inside its ITL and KV targets.
    prefill_load = asyncio.create_task(
        drive(urls["prefill"], "tiny", 3, 4, 256, 1, max_requests=12)
    )
    decode_load = asyncio.create_task(drive(urls["decode"], "tiny", 2, 4, 16, 32, max_requests=8))
    # Until Prometheus has scraped the prefill queue and both pools' latencies, while the load
    # runs (bounded generously: a loaded machine delays the emulators and the scrapes).
    async with PrometheusClient(prometheus.url) as client:
        deadline = time.monotonic() + 30
        while True:
            prefill = await read_pool_signals(
                client,
                PoolSelector(namespace="serving", cluster="llama", pool="prefill"),
                POLICIES["prefill"],
            )
            decode = await read_pool_signals(
                client,
                PoolSelector(namespace="serving", cluster="llama", pool="decode"),
                POLICIES["decode"],
            )
            overloaded = (prefill.latency_s or 0) > 0.5 and prefill.waiting > 0
            if (overloaded and decode.latency_s is not None) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
    results = await asyncio.gather(prefill_load, decode_load)
    assert all(r.failed == 0 for r in results)

    assert prefill.engines == 1
    assert prefill.latency_s is not None
    assert prefill.latency_s > 0.5, prefill
    assert prefill.waiting > 0, prefill
    assert decode.latency_s is not None
    assert decode.latency_s < 0.05, decode

    grow, _ = decide(POLICIES["prefill"], prefill, current=1, ready=1, state=ScalingMemory(), now=0)
    assert grow.reason == "ScaledUp"
    assert grow.desired >= 2
    keep, _ = decide(POLICIES["decode"], decode, current=1, ready=1, state=ScalingMemory(), now=0)
    assert keep.desired == 1
