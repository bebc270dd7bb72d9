"""The planner's PromQL against a real Prometheus scraping real emulator processes under a
prompt-heavy load: the inputs read back what was sent, and the plan grows prefill, not decode."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from load_generator import drive
from prometheus_process import PrometheusProcess, running_prometheus, static_job
from tandem_process import TandemProcess

from tandem.common.capacity import StepCost
from tandem.common.ports import free_port
from tandem.emulator.profile import load_profile
from tandem.operator.api import AutoscalingSpec
from tandem.operator.autoscaling.planner import PlannerMemory, plan
from tandem.operator.autoscaling.planner_loop import planner_policy
from tandem.operator.autoscaling.planner_queries import per_prompt_hit_rate, read_planner_signals
from tandem.operator.autoscaling.planner_signals import PlannerSignals
from tandem.operator.autoscaling.prometheus import PrometheusClient
from tandem.operator.autoscaling.queries import PoolSelector

pytestmark = [pytest.mark.timeout(90), pytest.mark.slow]

PROFILE = Path(__file__).with_name("small-gpu-profile.yaml")
PROMPT_WORDS = 256
MAX_TOKENS = 8


def start_emulator(pool: str) -> TandemProcess:
    port = free_port()
    args = ["emulate", "--model", "tiny", "--host", "127.0.0.1", "--port", str(port),
            "--timing-profile", str(PROFILE), "--log-level", "WARNING"]  # fmt: skip
    return TandemProcess(f"emulator-{pool}", args, port)


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[PrometheusProcess, dict[str, str]]]:
    processes = {pool: start_emulator(pool) for pool in ("prefill", "decode")}
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
            yield prometheus, {pool: p.url for pool, p in processes.items()}
    finally:
        for process in processes.values():
            process.stop()


async def test_planner_inputs_from_real_metrics_grow_prefill(
    engines: tuple[PrometheusProcess, dict[str, str]],
) -> None:
    prometheus, urls = engines
    # 3 req/s of 256-word prompts, about twice what one prefill engine of this profile takes;
    # the decode engine gets short requests with a few output tokens.
    loads = [
        asyncio.create_task(drive(urls["prefill"], "tiny", 3, 5, PROMPT_WORDS, 1, max_requests=15)),
        asyncio.create_task(drive(urls["decode"], "tiny", 2, 5, 16, MAX_TOKENS, max_requests=10)),
    ]
    selectors = [
        PoolSelector(namespace="serving", cluster="llama", pool=pool)
        for pool in ("prefill", "decode")
    ]
    # The busiest complete reading while the load runs: every input present, a prefill queue
    # standing (bounded generously: a loaded machine delays the emulators and the scrapes).
    signals: PlannerSignals | None = None
    async with PrometheusClient(prometheus.url) as client:
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline:
            reading = await read_planner_signals(client, *selectors, window_s=8)
            complete = (
                reading.prefill.waiting >= 1
                and reading.prompt_tokens_per_request is not None
                and reading.output_tokens_per_request is not None
                and reading.prefill.queue_s is not None
                and reading.decode.latency_s is not None
            )
            if complete and (
                signals is None or reading.prompt_tokens_per_s > signals.prompt_tokens_per_s
            ):
                signals = reading
            if signals is not None and signals.prompt_tokens_per_s > 250:
                break
            await asyncio.sleep(0.5)
    results = await asyncio.gather(*loads)
    assert all(r.failed == 0 for r in results)
    assert signals is not None

    assert (signals.prefill.engines, signals.decode.engines) == (1, 1)
    # Each prompt is "request N" plus 256 words: the tiny tokenizer makes ~one token a word.
    assert signals.prompt_tokens_per_request is not None
    assert PROMPT_WORDS <= signals.prompt_tokens_per_request <= 3 * PROMPT_WORDS
    assert signals.output_tokens_per_request == pytest.approx(MAX_TOKENS)
    assert signals.prefix_hit_rate is not None
    assert signals.prefix_hit_rate < 0.5  # prompts differ
    async with PrometheusClient(prometheus.url) as client:  # read per prompt, not per lookup
        per_prompt = await client.value(per_prompt_hit_rate(selectors[0], "60s"))
    assert per_prompt is not None
    assert per_prompt < 0.5
    assert signals.prefill.latency_s is not None
    assert signals.prefill.latency_s > 0
    assert signals.decode.latency_s is not None
    assert signals.decode.latency_s > 0

    spec = AutoscalingSpec.model_validate(
        {
            "enabled": True,
            "mode": "planner",
            "prefill": {"max": 8, "targetTTFTSeconds": 2.5},
            "decode": {"max": 8, "targetITLSeconds": 0.06},
            "planner": {"step": load_profile(str(PROFILE)).step.model_dump()},
        }
    )
    policy = planner_policy(spec, {}, {})
    assert policy.step == StepCost.model_validate(load_profile(str(PROFILE)).step.model_dump())
    result, _ = plan(policy, signals, {"prefill": 1, "decode": 1}, PlannerMemory(), now=0)
    prefill, decode = result.pools["prefill"], result.pools["decode"]
    # One engine of this profile prefills 1 / 2.4 ms = ~416 tokens/s.
    assert prefill.capacity_tokens_per_s == pytest.approx(416, rel=0.05)
    # Sized for the served rate plus the standing queue, at the target utilisation.
    assert prefill.replicas > signals.prompt_tokens_per_s / prefill.capacity_tokens_per_s
    assert prefill.replicas > 5 * decode.replicas, (prefill, decode)
    assert result.decisions["decode"].desired == 1, result.decisions["decode"].message
