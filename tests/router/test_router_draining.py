"""A request that reaches an engine draining after SIGTERM (`--shutdown-timeout`): the engine
refuses it with vLLM's 500 (docs/protocols.md §9) and the router sends it to another engine, while
the request the draining engine already holds runs to its end there.

In Kubernetes the router drops a terminating pod before its SIGTERM (preStop); here the router's
engines are static, so it keeps offering work to the draining one, which is the case under test.
"""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest
from router_harness import (
    SHORT,
    Engine,
    Router,
    metric,
    metrics,
    running,
    wait_until,
)

pytestmark = pytest.mark.timeout(120)


def test_a_draining_engines_refusal_goes_to_another_engine() -> None:
    draining = Engine(None, speedup=1.0, extra=["--shutdown-timeout", "60"])
    other = Engine(None, speedup=1.0)
    with running(draining, other):
        router = Router(["--worker", draining.url, "--worker", other.url])
        with running(router):
            held: dict[str, object] = {}

            def long_request() -> None:
                body = {"model": "tiny", "prompt": SHORT, "max_tokens": 300, "ignore_eos": True}
                answer = httpx.post(f"{draining.url}/v1/completions", json=body, timeout=60)
                held["answer"] = answer.json()["choices"][0]["finish_reason"]

            thread = threading.Thread(target=long_request, daemon=True)
            thread.start()
            wait_until(
                lambda: metric(metrics(draining.url), "vllm:num_requests_running") >= 1,
                timeout=30,
            )
            draining.proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            # Sessions spread over both engines by a hash of their id, whatever the load.
            statuses = [
                httpx.post(
                    f"{router.url}/v1/completions",
                    json={"model": "tiny", "prompt": f"{i} {SHORT}", "max_tokens": 2},
                    headers={"x-session-id": f"session-{i}"},
                    timeout=60,
                ).status_code
                for i in range(12)
            ]
            refused = metric(
                metrics(router.url),
                "tandem_router_upstream_errors_total",
                pool="decode",
                endpoint=draining.url,
                kind="draining",
            )
            thread.join(60)
    assert statuses == [200] * 12
    assert refused >= 1  # some went to the draining engine first
    assert held["answer"] == "length"  # what it held, it finished


def test_a_router_told_to_stop_finishes_the_streams_it_serves() -> None:
    """SIGTERM: the router stops listening at once and finishes what it serves
    (`timeouts.shutdownSeconds`), then exits."""
    engine = Engine(None, speedup=1.0)
    with running(engine):
        router = Router(["--worker", engine.url])
        with running(router):
            body = {
                "model": "tiny",
                "prompt": SHORT,
                "max_tokens": 200,
                "ignore_eos": True,
                "stream": True,
            }
            with httpx.stream(
                "POST", f"{router.url}/v1/completions", json=body, timeout=30
            ) as answer:
                lines = answer.iter_lines()
                assert next(line for line in lines if line.startswith("data: "))
                router.proc.send_signal(signal.SIGTERM)
                time.sleep(0.3)
                with pytest.raises(httpx.ConnectError):
                    httpx.get(f"{router.url}/livez", timeout=2)
                rest = [line for line in lines if line.startswith("data: ")]
            assert router.proc.wait(20) == 0
    assert rest[-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in rest[-2].replace(" ", "")
