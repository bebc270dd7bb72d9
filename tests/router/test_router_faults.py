"""Recovery from faults against real emulator engines: a KV-event sequence gap healed through the
replay socket, and a stalled decode stream ended by the router's idle timeout."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest
import zmq
import zmq.asyncio
from router_harness import LONG, MODEL_DIR, Engine, Router, metric, metrics, running

from tandem.router.features import Featurizer
from tandem.router.index import PrefixIndex
from tandem.router.kv_events import EngineBlockMap, KvEventSubscriber, decode_payload
from tandem.router.metrics import RouterMetrics

pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.skipif(not MODEL_DIR.exists(), reason="golden model absent"),
]


class _LossySocket(zmq.asyncio.Socket):
    """A SUB socket that loses live frames on demand, as a slow subscriber past its high-water
    mark does. Only the loss is simulated: the frames come from a real engine's publisher."""

    async def recv_multipart(self, *args: Any, **kwargs: Any) -> list[bytes]:  # type: ignore[override]
        context = self.context
        assert isinstance(context, LossyContext)
        while True:
            frames: list[bytes] = await super().recv_multipart(*args, **kwargs)
            context.received += 1
            if context.drop_next and len(frames) >= 3 and decode_payload(frames[-1])[1]:
                context.drop_next = False
                context.dropped.append(int.from_bytes(frames[-2], "big", signed=True))
                continue
            return frames


class LossyContext(zmq.asyncio.Context):
    _socket_class = _LossySocket
    drop_next: bool = False
    received: int = 0
    dropped: list[int]


async def wait_for(condition: Any, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if condition():
            return True
        await asyncio.sleep(0.05)
    return bool(condition())


async def test_sequence_gap_is_replayed_into_the_index() -> None:
    engine = Engine(None, speedup=50, kv_events=True)
    context = LossyContext()
    context.dropped = []
    index = PrefixIndex()
    router_metrics = RouterMetrics()
    subscriber = KvEventSubscriber(
        EngineBlockMap(engine.url, index, 16),
        str(engine.events),
        engine.replay,
        context,
        router_metrics,
    )
    featurizer = Featurizer(16, str(MODEL_DIR))

    def cached(prompt: str) -> int:
        keys = featurizer.of_body({"prompt": prompt}, chat=False).keys
        return index.match(keys, [engine.url]).get(engine.url, 0) if keys else 0

    def full(prompt: str) -> int:
        return len(featurizer.of_body({"prompt": prompt}, chat=False).keys)

    with running(engine):
        subscriber.start()
        try:
            async with httpx.AsyncClient(base_url=engine.url, timeout=30) as client:

                async def complete(prompt: str) -> None:
                    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
                    assert (await client.post("/v1/completions", json=body)).status_code == 200

                first, lost, after = (f"{tag}: {LONG}" for tag in ("first", "lost", "after"))
                await complete(first)
                assert await wait_for(lambda: cached(first) == full(first))
                assert subscriber.replays == 1  # the replay on connect
                for attempt in range(20):  # until the SUB has joined (ZMQ's slow joiner)
                    if context.received:
                        break
                    await complete(f"warm-up {attempt}: {LONG}")
                    await asyncio.sleep(0.1)
                assert context.received
                await asyncio.sleep(0.3)  # let every earlier batch land before arming the loss

                context.drop_next = True
                await complete(lost)
                assert await wait_for(lambda: bool(context.dropped))
                await asyncio.sleep(0.2)
                assert cached(lost) == 0  # its BlockStored batch never reached the index

                await complete(after)  # the next batch reveals the gap
                assert await wait_for(lambda: cached(after) == full(after))
                assert subscriber.replays == 2
                assert cached(lost) == full(lost)  # recovered from the replay socket
                assert subscriber.last_seq is not None
                assert subscriber.last_seq > context.dropped[0]
                # live batches only: a replayed batch (the lost one, and the one that revealed
                # the gap, applied by the replay) is old by nature and not counted
                lag = router_metrics.child(router_metrics.kv_event_lag, engine.url)
                live = sum(lag.counts)
                assert 1 <= live <= subscriber.last_seq + 1 - 2
                assert 0 <= lag.sum < live * 1.0  # each within a second on loopback
        finally:
            await subscriber.stop()
            context.term()


def test_stalled_stream_ends_with_504_event_and_aborts_upstream() -> None:
    engine = Engine(None, speedup=50, extra=["--stall-after-tokens", "2"])
    idle_s = 1.0
    with running(engine):  # the router starts once the engine answers, so it starts healthy
        router = Router(["--worker", engine.url, "--decode-idle-seconds", str(idle_s)])
        with running(router):
            body = {"model": "tiny", "prompt": LONG, "max_tokens": 50, "stream": True}
            started = time.monotonic()
            with httpx.stream(
                "POST", router.url + "/v1/completions", json=body, timeout=30
            ) as reply:
                assert reply.status_code == 200
                events = [line for line in reply.iter_lines() if line.startswith("data: ")]
            elapsed = time.monotonic() - started
            assert idle_s <= elapsed < idle_s + 3
            assert events[-1] == "data: [DONE]"
            error = json.loads(events[-2].removeprefix("data: "))["error"]
            assert error["code"] == 504
            assert error["type"] == "GatewayTimeoutError"
            tokens = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
            assert len(tokens) == 2
            assert all("choices" in t for t in tokens)

            running_now = 1.0
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                text = metrics(engine.url)
                running_now = metric(text, "vllm:num_requests_running")
                if running_now == 0:
                    break
                time.sleep(0.05)
            assert running_now == 0
            assert metric(text, "vllm:request_success_total", finished_reason="abort") == 1
            text = metrics(router.url)
            assert metric(text, "tandem_router_upstream_errors_total", kind="timeout") == 1
            assert metric(text, "tandem_router_requests_total", status="504") == 1
