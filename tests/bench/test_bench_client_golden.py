"""The streaming client and the metrics reader on real vLLM 0.32 output (tests/fixtures/vllm-0.32).

A small aiohttp server replays the captured SSE bodies byte for byte, so the client meets exactly
what vLLM sent, including tokens whose text is empty and chunks carrying several tokens.
"""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families
from tandem_process import GOLDEN

from tandem.bench.client import RequestResult, send
from tandem.bench.sampler import KEPT_BUCKETS, KEPT_BY_LABEL, flatten

STREAMS = {
    "/v1/completions": GOLDEN / "single" / "07_completions_stream.sse",
    "/v1/chat/completions": GOLDEN / "single" / "08_chat_completions_stream.sse",
    "/pd/v1/completions": GOLDEN / "pd" / "main" / "02_decode_stream.sse",
}


async def replay(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
    await response.prepare(request)
    for event in STREAMS[request.path].read_bytes().split(b"\n\n"):
        if event.strip():
            await response.write(event + b"\n\n")
    return response


@pytest.mark.parametrize(
    ("path", "body", "chunks", "tokens"),
    [
        ("/v1/completions", {"prompt": "x"}, 5, 5),
        ("/v1/chat/completions", {"messages": []}, 5, 5),  # every token's text is empty here
        ("/pd/v1/completions", {"prompt": "x"}, 4, 8),  # one chunk carries three tokens
    ],
)
async def test_client_reads_real_vllm_streams(
    path: str, body: dict[str, object], chunks: int, tokens: int
) -> None:
    app = web.Application()
    for route in STREAMS:
        app.router.add_post(route, replay)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with aiohttp.ClientSession() as session:
            result = RequestResult(0, "default", "steady", 0.0)
            await send(session, f"http://127.0.0.1:{port}{path}", body, result, timeout_s=10)
    finally:
        await runner.cleanup()
    assert result.ok, result.error
    assert result.ttft_s is not None
    assert len(result.itl_s) == chunks - 1
    assert result.output_tokens == tokens


@pytest.mark.parametrize("name", ["03_prefill_metrics.txt", "04_decode_metrics.txt"])
def test_line_scan_of_metrics_matches_the_prometheus_parser(name: str) -> None:
    text = (GOLDEN / "pd" / "main" / name).read_text()
    expected: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith(("vllm:", "tandem_")):
            for sample in family.samples:
                name = sample.name
                if name in KEPT_BUCKETS:
                    name = f"{name}{{le={sample.labels['le']}}}"
                elif name in KEPT_BY_LABEL:
                    label = KEPT_BY_LABEL[name]
                    name = f"{name}{{{label}={sample.labels[label]}}}"
                elif name.endswith(("_bucket", "_created")):
                    continue
                expected[name] = expected.get(name, 0.0) + sample.value
    assert flatten(text) == expected
    assert "vllm:num_requests_running" in expected
    assert "vllm:prompt_tokens_by_source_total{source=local_compute}" in expected
