"""Recovery from faults against real emulator engines: a KV-event sequence gap healed through the
replay socket, a KV-event connection that went silent redialled by its heartbeat, and a stalled
decode stream ended by the router's idle timeout."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
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

pytestmark = pytest.mark.timeout(90)


class _LossySocket(zmq.asyncio.Socket):
    """A SUB socket that loses live frames on demand, as a slow subscriber past its high-water
    mark does. Only the loss is simulated: the frames come from a real engine's publisher."""

    async def recv_multipart(self, *args: Any, **kwargs: Any) -> list[bytes]:  # type: ignore[override]
        context = self.context
        assert isinstance(context, LossyContext)
        while True:
            frames: list[bytes] = await super().recv_multipart(*args, **kwargs)
            dropping = context.drop_next or context.drop_all
            if dropping and len(frames) >= 3 and decode_payload(frames[-1])[1]:
                context.drop_next = False
                context.dropped.append(int.from_bytes(frames[-2], "big", signed=True))
                continue
            return frames


class LossyContext(zmq.asyncio.Context):
    _socket_class = _LossySocket
    drop_next: bool = False
    drop_all: bool = False  # every live batch with events, until cleared
    dropped: list[int]


async def wait_for(condition: Any, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if condition():
            return True
        await asyncio.sleep(0.05)
    return bool(condition())


class IndexProbe:
    """How many of a prompt's blocks the index holds for `engine`, against how many it has."""

    def __init__(self, engine: Engine, index: PrefixIndex) -> None:
        self.engine, self.index = engine, index
        self.featurizer = Featurizer(16, str(MODEL_DIR))

    def keys(self, prompt: str) -> list[Any]:
        return list(self.featurizer.of_body({"prompt": prompt}, chat=False).keys)

    def cached(self, prompt: str) -> int:
        keys = self.keys(prompt)
        return self.index.match(keys, [self.engine.url]).get(self.engine.url, 0) if keys else 0

    def full(self, prompt: str) -> bool:
        return self.cached(prompt) == len(self.keys(prompt))


async def complete(client: httpx.AsyncClient, prompt: str) -> None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
    assert (await client.post("/v1/completions", json=body)).status_code == 200


@contextlib.asynccontextmanager
async def lossy_subscription(
    metrics: RouterMetrics | None = None, **options: Any
) -> AsyncIterator[tuple[Engine, LossyContext, KvEventSubscriber, IndexProbe]]:
    """An emulated engine publishing KV events, and a subscriber keeping an index of them over a
    LossyContext, started; stopped after the block."""
    engine = Engine(None, speedup=50, kv_events=True)
    context = LossyContext()
    context.dropped = []
    index = PrefixIndex()
    subscriber = KvEventSubscriber(
        EngineBlockMap(engine.url, index, 16), str(engine.events), engine.replay, context,
        metrics, **options,
    )  # fmt: skip
    with running(engine):
        subscriber.start()
        try:
            yield engine, context, subscriber, IndexProbe(engine, index)
        finally:
            await subscriber.stop()
            context.term()


async def test_sequence_gap_is_replayed_into_the_index() -> None:
    router_metrics = RouterMetrics()
    async with (
        lossy_subscription(router_metrics) as (engine, context, subscriber, probe),
        httpx.AsyncClient(base_url=engine.url, timeout=30) as client,
    ):
        first, lost, after = (f"{tag}: {LONG}" for tag in ("first", "lost", "after"))
        await complete(client, first)
        assert await wait_for(lambda: probe.full(first))
        assert subscriber.replays >= 1  # the replay on connect
        lag = router_metrics.child(router_metrics.kv_event_lag, engine.url)
        # until a batch is applied live: the SUB has joined (ZMQ's slow joiner), and the
        # replay on connect, which may deliver the same batches first, is behind it
        for attempt in range(20):
            if sum(lag.counts):
                break
            await complete(client, f"warm-up {attempt}: {LONG}")
            await asyncio.sleep(0.1)
        assert sum(lag.counts)
        await asyncio.sleep(0.3)  # let every earlier batch land before arming the loss
        replays = subscriber.replays

        context.drop_next = True
        await complete(client, lost)
        assert await wait_for(lambda: bool(context.dropped))
        await asyncio.sleep(0.2)
        assert probe.cached(lost) == 0  # its BlockStored batch never reached the index

        await complete(client, after)  # the next batch reveals the gap
        assert await wait_for(lambda: probe.full(after))
        assert subscriber.replays == replays + 1
        assert probe.full(lost)  # recovered from the replay socket
        assert subscriber.last_seq is not None
        assert subscriber.last_seq > context.dropped[0]
        # live batches only: a replayed batch (the lost one, and the one that revealed
        # the gap, applied by the replay) is old by nature and not counted
        live = sum(lag.counts)
        assert 1 <= live <= subscriber.last_seq + 1 - 2
        assert 0 <= lag.sum < live * 1.0  # each within a second on loopback


async def test_a_lost_last_batch_is_replayed_once_the_engine_is_quiet() -> None:
    """No batch follows the lost one to show the gap: after `quiet_s` without a live batch the
    subscriber asks the replay endpoint, and the lost blocks reach the index."""
    async with (
        lossy_subscription(quiet_s=1.5) as (engine, context, subscriber, probe),
        httpx.AsyncClient(base_url=engine.url, timeout=30) as client,
    ):
        await complete(client, f"first: {LONG}")
        assert await wait_for(lambda: probe.full(f"first: {LONG}"))
        await asyncio.sleep(2.0)  # quiet: a catch-up that finds nothing is not counted
        assert subscriber.catch_ups == 0
        replays = subscriber.replays
        context.drop_all = True  # every batch of the next request: no gap shows
        lost = f"lost: {LONG}"
        await complete(client, lost)
        assert await wait_for(lambda: bool(context.dropped))
        await asyncio.sleep(0.2)
        context.drop_all = False  # the replay's own frames must pass
        assert probe.cached(lost) == 0
        assert await wait_for(lambda: probe.full(lost), within_s=5.0)
        assert subscriber.catch_ups == 1
        assert subscriber.replays == replays  # no gap was seen: the quiet spell did it
        assert subscriber.last_seq == context.dropped[-1]


class BlackHoleRelay:
    """A TCP relay to a port whose open connections can be made to swallow everything, both
    ways, while staying open: a network partition that neither end's TCP notices. Connections
    opened afterwards are relayed again."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.connections = 0
        self._generation = 0
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return f"tcp://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    def swallow_open_connections(self) -> None:
        self._generation += 1

    async def stop(self) -> None:
        for writer in self._writers:
            writer.close()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        generation = self._generation
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._writers += [writer, up_writer]

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            while data := await source.read(65536):
                if generation == self._generation:
                    sink.write(data)
                    await sink.drain()
            sink.close()

        await asyncio.gather(
            pipe(reader, up_writer), pipe(up_reader, writer), return_exceptions=True
        )


async def test_a_kv_event_connection_gone_silent_is_redialled_by_its_heartbeat() -> None:
    engine = Engine(None, speedup=50, kv_events=True)
    assert engine.events is not None
    relay = BlackHoleRelay(int(engine.events.rsplit(":", 1)[1]))
    context = zmq.asyncio.Context()
    index = PrefixIndex()
    with running(engine):
        subscriber = KvEventSubscriber(
            EngineBlockMap(engine.url, index, 16),
            await relay.start(),
            engine.replay,
            context,
            heartbeat_s=0.2,
        )
        probe = IndexProbe(engine, index)
        subscriber.start()
        try:
            async with httpx.AsyncClient(base_url=engine.url, timeout=30) as client:
                live = f"live: {LONG}"
                for attempt in range(20):  # until a live batch arrives (ZMQ's slow joiner)
                    await complete(client, f"{attempt} {live}")
                    if await wait_for(lambda a=attempt: probe.full(f"{a} {live}"), 0.5):
                        break
                assert subscriber.last_seq is not None

                relay.swallow_open_connections()
                lost = f"lost: {LONG}"
                await complete(client, lost)
                await asyncio.sleep(0.2)
                assert probe.cached(lost) == 0  # swallowed on the way
                # three silent heartbeats later the SUB hangs up and dials again
                assert await wait_for(lambda: relay.connections >= 2, 5.0), relay.connections
                for attempt in range(20):  # a batch on the new connection reveals the gap
                    await complete(client, f"after {attempt}: {LONG}")
                    if await wait_for(lambda: probe.full(lost), 0.5):
                        break
                assert probe.full(lost)  # replayed
                assert subscriber.replays >= 2
                assert subscriber.resubscribes == 0  # ZMQ redialled under the same socket
        finally:
            await subscriber.stop()
            await relay.stop()
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
