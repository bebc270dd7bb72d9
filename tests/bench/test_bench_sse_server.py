"""`tandem bench` end to end against a small OpenAI-style SSE server on 127.0.0.1.

The server here is written for this test (rather than the emulator) so that its timing is exact
and known: a fixed time to first token and a fixed gap between tokens, router-style breakdown
headers and a /metrics page. That pins down what the client must measure; the test against the
emulator (test_bench_emulator.py) covers a real engine.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from tandem.bench.main import main
from tandem.bench.records import BenchRecord

TTFT_S = 0.05
GAP_S = 0.01


def make_app() -> web.Application:
    state = {"running": 0, "served": 0}

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    async def metrics(_: web.Request) -> web.Response:
        text = (
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{model_name="tiny"}} {state["running"]}\n'
            "# TYPE vllm:request_queue_time_seconds histogram\n"
            f'vllm:request_queue_time_seconds_bucket{{le="+Inf",model_name="tiny"}} {state["served"]}\n'
            f'vllm:request_queue_time_seconds_count{{model_name="tiny"}} {state["served"]}\n'
            f'vllm:request_queue_time_seconds_sum{{model_name="tiny"}} {0.02 * state["served"]}\n'
        )
        return web.Response(text=text, content_type="text/plain")

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body.get("model") != "tiny":
            return web.json_response({"error": {"message": "no such model"}}, status=404)
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "x-tandem-queue-ms": "20.5",
                "X-Tandem-Prefill-Ms": "7",
                "x-tandem-route": "local",
            }
        )
        await response.prepare(request)
        state["running"] += 1
        await asyncio.sleep(TTFT_S)
        for i in range(body["max_tokens"]):
            if i:
                await asyncio.sleep(GAP_S)
            chunk = {"choices": [{"index": 0, "text": f" w{i}", "finish_reason": None}]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        usage = {
            "prompt_tokens": len(body["prompt"].split()),
            "completion_tokens": body["max_tokens"],
        }
        await response.write(
            f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode()
        )
        state["running"] -= 1
        state["served"] += 1
        return response

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/completions", completions)
    return app


@pytest.fixture
def server() -> Iterator[str]:
    """The SSE server on its own thread and loop, so the bench CLI can run its own loop."""
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(make_app())
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = runner.addresses[0][1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}"
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(5)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


def test_bench_measures_stream_timing_headers_and_metrics(server: str, tmp_path: Path) -> None:
    args = [
        server,
        "--num-requests",
        "30",
        "--qps",
        "40",
        "--output",
        "8",
        "--input",
        "32",
        "--warmup",
        "3",
        "--quiet",
        "--seed",
        "3",
    ]
    assert main([*args, "--out", str(tmp_path / "run1")]) == 0
    record = BenchRecord.load(tmp_path / "run1" / "A.json")
    assert record.model == "tiny"
    assert (record.summary.ok, record.summary.failed) == (30, 0)
    # The server sleeps exactly these times, so they bound the measurements from below; the upper
    # margins are wide because the machine running the suite is shared and often busy.
    assert TTFT_S * 1000 <= record.summary.ttft_ms.p50 < TTFT_S * 1000 + 80  # type: ignore[operator]
    assert GAP_S * 1000 * 0.5 <= record.summary.itl_ms.p50 < GAP_S * 1000 + 25  # type: ignore[operator]
    assert record.summary.itl_ms.count == 30 * 7
    assert all(r.output_tokens == 8 and r.prompt_tokens == 32 for r in record.requests)
    assert record.summary.breakdown_ms["queue"].mean == pytest.approx(20.5)
    assert record.summary.breakdown_ms["prefill"].p50 == pytest.approx(7)
    assert all(r.tags == {"route": "local"} for r in record.requests)
    # Warm-up requests are not in the record, nor in the engine counters' window.
    assert record.engine.queue_ms_per_request == pytest.approx(20.0)
    assert record.queue_share is not None
    assert 0.05 < record.queue_share < 0.95
    assert any(s.values.get("vllm:num_requests_running", 0) >= 1 for s in record.samples)
    assert {p.name for p in (tmp_path / "run1").glob("*.png")} == {
        "latency_cdf.png",
        "timeseries.png",
        "breakdown.png",
    }
    assert record.config["metrics_sources"] == ["endpoint"]

    # The same workload against its first run: the comparison runs and, within a tolerance wider
    # than any noise of this shared machine, flags nothing; a negative tolerance flags every
    # metric. (Which losses count as regressions is pinned down in test_bench_stats_baseline.)
    assert (
        main(
            [
                *args,
                "--out",
                str(tmp_path / "run2"),
                "--no-plots",
                "--compare",
                str(tmp_path / "run1" / "A.json"),
                "--tolerance",
                "100",
            ]
        )
        == 0
    )
    assert (
        main(
            [
                *args,
                "--out",
                str(tmp_path / "run3"),
                "--no-plots",
                "--compare",
                str(tmp_path / "run1"),
                "--tolerance",
                "-0.5",
            ]
        )
        == 1
    )


def test_ab_run_writes_one_record_per_endpoint(server: str, tmp_path: Path) -> None:
    args = [
        server,
        server,
        "--label",
        "left",
        "--label",
        "right",
        "--num-requests",
        "10",
        "--qps",
        "50",
    ]
    assert (
        main(
            [
                *args,
                "--output",
                "4",
                "--warmup",
                "0",
                "--quiet",
                "--out",
                str(tmp_path),
                "--no-plots",
            ]
        )
        == 0
    )
    assert {p.name for p in tmp_path.glob("*.json")} == {"left.json", "right.json"}


def test_unreachable_endpoint_is_reported_not_raised(tmp_path: Path) -> None:
    assert main(["http://127.0.0.1:9", "--quiet", "--model", "m", "--out", str(tmp_path)]) == 3


def test_wrong_model_fails_warm_up_with_the_server_message(
    server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([server, "--quiet", "--model", "other", "--out", str(tmp_path)]) == 3
    assert "no such model" in capsys.readouterr().err
