"""The router over real HTTP in front of colocated emulator engines: errors, disconnects, overload,
KV-event index, engine removal."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest
from router_harness import (
    DEBUG,
    MODEL_DIR,
    SHORT,
    Engine,
    Router,
    completion,
    metric,
    metrics,
    running,
    wait_until,
)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def workers() -> Iterator[tuple[Engine, Engine]]:
    a, b = Engine(None, kv_events=True), Engine(None, kv_events=True)
    with running(a, b):
        yield a, b


def test_openai_errors(workers: tuple[Engine, Engine]) -> None:
    a, _ = workers
    router = Router(["--worker", a.url, "--api-key", "k1"])
    auth = {"authorization": "Bearer k1"}
    with running(router):
        url = router.url + "/v1/completions"
        assert httpx.post(url, json={"model": "tiny", "prompt": "x"}).status_code == 401
        bad = httpx.post(url, content=b"{nope", headers=auth)
        assert bad.status_code == 400
        assert set(bad.json()["error"]) == {"message", "type", "param", "code"}
        missing = httpx.post(url, json={"model": "other", "prompt": "x"}, headers=auth)
        assert missing.status_code == 404
        assert missing.json()["error"]["type"] == "NotFoundError"
        assert httpx.post(url, json={"model": "tiny"}, headers=auth).status_code == 400
        huge = httpx.post(
            url, content=b'{"prompt":"' + b"a" * (9 * 1024 * 1024) + b'"}', headers=auth
        )
        assert huge.status_code == 413
        engine_error = httpx.post(
            url, json={"model": "tiny", "prompt": "x", "max_tokens": -1}, headers=auth
        )
        assert engine_error.status_code == 400  # the engine's own validation passes through
        models = httpx.get(router.url + "/v1/models", headers=auth).json()
        assert models["data"][0]["id"] == "tiny"
        assert httpx.get(router.url + "/nope").status_code == 404


async def test_client_disconnect_aborts_engine_request(workers: tuple[Engine, Engine]) -> None:
    a, _ = workers
    router = Router(["--worker", a.url])
    with running(router):
        async with httpx.AsyncClient(timeout=30) as client:
            body = {
                "model": "tiny",
                "prompt": SHORT,
                "max_tokens": 3000,
                "stream": True,
                "ignore_eos": True,
            }
            async with client.stream("POST", router.url + "/v1/completions", json=body) as response:
                assert response.status_code == 200
                async for _ in response.aiter_lines():
                    break
            running_now = 1.0
            for _ in range(100):
                await asyncio.sleep(0.05)
                running_now = metric(
                    (await client.get(a.url + "/metrics")).text, "vllm:num_requests_running"
                )
                if running_now == 0:
                    break
            assert running_now == 0
            text = (await client.get(a.url + "/metrics")).text
            assert metric(text, "vllm:request_success_total", finished_reason="abort") >= 1


async def test_overload_answers_429_with_retry_after(workers: tuple[Engine, Engine]) -> None:
    a, b = workers
    router = Router(
        ["--worker", a.url, "--worker", b.url, "--max-in-flight", "2", "--max-queue", "2"]
    )
    with running(router):
        async with httpx.AsyncClient(timeout=60) as client:
            body = {"model": "tiny", "prompt": SHORT, "max_tokens": 200, "ignore_eos": True}
            responses = await asyncio.gather(
                *(client.post(router.url + "/v1/completions", json=body) for _ in range(8))
            )
        codes = sorted(r.status_code for r in responses)
        assert codes.count(200) >= 4
        assert 429 in codes
        rejected = next(r for r in responses if r.status_code == 429)
        assert int(rejected.headers["retry-after"]) >= 1
        assert rejected.json()["error"]["code"] == 429


def test_exact_prefix_index_from_kv_events(workers: tuple[Engine, Engine]) -> None:
    a, b = workers
    router = Router(
        [
            "--worker",
            a.url,
            "--worker",
            b.url,
            "--tokenizer",
            str(MODEL_DIR),
            "--block-size",
            "16",
            "--kv-events",
            f"{a.url}={a.events},{a.replay}",
            "--kv-events",
            f"{b.url}={b.events},{b.replay}",
        ]
    )
    with running(router):
        prompt = (
            "a shared system prompt about routing requests to the engine holding their prefix. " * 6
        )
        first = completion(router, prompt + "question one")
        assert first.status_code == 200
        owner = first.headers["x-tandem-decode-engine"]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            engines = {e["url"]: e for e in httpx.get(router.url + "/engines").json()}
            if engines[owner]["indexed_blocks"] > 0:
                break
            time.sleep(0.1)
        assert engines[owner]["indexed_blocks"] > 0
        second = completion(router, prompt + "question two")
        assert second.headers["x-tandem-decode-engine"] == owner
        hit, total = map(int, second.headers["x-tandem-prefix-hit"].split("/"))
        assert hit >= total - 2
        assert hit > 0
        assert (
            metric(metrics(router.url), "tandem_router_prefix_hit_blocks_total", index="exact")
            >= hit
        )


def test_engine_removed_mid_traffic(workers: tuple[Engine, Engine]) -> None:
    _, survivor = workers
    doomed = Engine(None)
    with running(doomed):
        router = Router(["--worker", doomed.url, "--worker", survivor.url])
        with running(router):
            assert all(completion(router, f"{i} {SHORT}").status_code == 200 for i in range(4))
            doomed.kill()
            codes = [completion(router, f"{i} {SHORT}").status_code for i in range(8)]
            assert codes == [200] * 8

            def health() -> dict[str, bool]:
                engines = httpx.get(router.url + "/engines").json()
                return {e["url"]: e["healthy"] for e in engines}

            # a request sent to it finds it gone at once; if all eight went to the survivor, the
            # health check (every 2 s) finds it
            wait_until(lambda: health()[doomed.url] is False)
            assert health()[survivor.url] is True


def test_session_affinity_keeps_a_session_on_one_engine(workers: tuple[Engine, Engine]) -> None:
    a, b = workers
    router = Router(["--worker", a.url, "--worker", b.url])
    with running(router):
        seen = set()
        for i in range(6):  # unrelated prompts: only the session header ties them together
            response = httpx.post(
                router.url + "/v1/completions",
                headers={"x-session-id": "s-1", **DEBUG},
                json={"model": "tiny", "prompt": f"{i} unrelated {i * 7}", "max_tokens": 2},
            )
            assert response.status_code == 200
            seen.add(response.headers["x-tandem-decode-engine"])
        assert len(seen) == 1


def test_engine_dying_mid_stream_ends_the_stream_cleanly() -> None:
    doomed = Engine(None, speedup=2.0)
    with running(doomed):
        router = Router(["--worker", doomed.url])
        with running(router):
            body = {
                "model": "tiny",
                "prompt": SHORT,
                "max_tokens": 2000,
                "ignore_eos": True,
                "stream": True,
            }
            with httpx.stream(
                "POST", router.url + "/v1/completions", json=body, timeout=30
            ) as response:
                assert response.status_code == 200
                lines = response.iter_lines()
                assert next(line for line in lines if line.startswith("data: "))
                doomed.kill()
                rest = [line for line in lines if line.startswith("data: ")]
            assert '"error"' in rest[-2]
            assert rest[-1] == "data: [DONE]"
