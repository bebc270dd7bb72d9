"""What a router first learns of an engine's cache comes from the engine's KV-event replay: it must
arrive whole, and before the router serves.

`ReplayServer` answers a replay request as vLLM's publisher does (`ZmqEventPublisher`, 0.32): a
ROUTER socket streams every buffered batch from the sequence number asked for, in a tight loop,
then the end marker; a ROUTER drops whatever overflows its send queue. The queue is made short
here so that the overflow is certain rather than a matter of timing; with vLLM's own queue of
1,000 it shows on long buffers (tests/realvllm/test_kv_replay.py asks vLLM's publisher itself).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
import zmq
import zmq.asyncio
from router_harness import DEBUG, LONG, MODEL_DIR, Engine, Router, running

from tandem.common.ports import free_port
from tandem.emulator.kv_events import END_OF_REPLAY_SEQ, encode_batch
from tandem.router.config import RouterConfig
from tandem.router.index import PrefixIndex
from tandem.router.kv_events import EngineBlockMap, KvEventSubscriber
from tandem.router.service import RouterService

pytestmark = pytest.mark.timeout(90)

TOPIC = b"kv-events"


def stored_batches(count: int) -> list[tuple[int, bytes]]:
    """`count` batches of one BlockStored each, every block a different one."""
    return [
        (
            seq,
            encode_batch(
                time.time(),
                [
                    {
                        "type": "BlockStored",
                        "block_hashes": [seq + 1],
                        "parent_block_hash": None,
                        "token_ids": [seq % 30000] * 16,
                        "block_size": 16,
                        "lora_id": None,
                        "medium": "GPU",
                    }
                ],
            ),
        )
        for seq in range(count)
    ]


class ReplayServer:
    """An engine's KV-event endpoints holding `batches`: a PUB that publishes nothing, and a
    replay ROUTER that leaves its first `unanswered` requests unanswered and answers the rest
    after `delay_s`, sending one batch every `interval_s` (0: in a tight loop, as vLLM does)
    through a send queue of `send_queue` messages."""

    def __init__(
        self,
        batches: list[tuple[int, bytes]],
        send_queue: int = 1000,
        delay_s: float = 0.0,
        interval_s: float = 0.0,
        unanswered: int = 0,
        events: str | None = None,
        replay: str | None = None,
    ) -> None:
        self.batches = batches
        self.delay_s, self.interval_s, self.unanswered = delay_s, interval_s, unanswered
        self.context = zmq.Context()
        self.pub = self.context.socket(zmq.PUB)
        self.router = self.context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.SNDHWM, send_queue)
        self.events = events or f"tcp://127.0.0.1:{free_port()}"
        self.replay = replay or f"tcp://127.0.0.1:{free_port()}"
        self.pub.bind(self.events)
        self.router.bind(self.replay)
        self.starts: list[int] = []  # the sequence number of each request, in order
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> ReplayServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self.pub.close(0)
        self.router.close(0)
        self.context.term()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(50):
                continue
            identity, _, start = self.router.recv_multipart()
            self.starts.append(int.from_bytes(start, "big"))
            if len(self.starts) <= self.unanswered:
                continue
            if self._stop.wait(self.delay_s):
                return
            for seq, payload in self.batches:
                if seq >= self.starts[-1]:
                    self.router.send_multipart(
                        (identity, b"", TOPIC, seq.to_bytes(8, "big"), payload)
                    )
                    if self.interval_s and self._stop.wait(self.interval_s):
                        return
            self.router.send_multipart((identity, b"", b"", END_OF_REPLAY_SEQ, b""))


@contextmanager
def subscribed(server: ReplayServer, replay_timeout_s: float = 2.0) -> Iterator[KvEventSubscriber]:
    context = zmq.asyncio.Context()
    subscriber = KvEventSubscriber(
        EngineBlockMap("http://engine", PrefixIndex(), 16),
        server.events,
        server.replay,
        context,
        replay_timeout_s=replay_timeout_s,
    )
    try:
        yield subscriber
    finally:
        context.term()


async def test_a_replay_the_engine_drops_batches_of_arrives_whole() -> None:
    batches = stored_batches(5000)
    with ReplayServer(batches, send_queue=100) as server, subscribed(server) as subscriber:
        subscriber.start()
        try:
            await asyncio.wait_for(subscriber.caught_up.wait(), 30)
        finally:
            await subscriber.stop()
    # Every batch applied once, in order: a batch is applied only right after the one before it.
    assert subscriber.last_seq == len(batches) - 1
    assert subscriber.map.applied == len(batches)
    # The first round lost batches to the short queue; each next one asked from its first hole.
    assert subscriber.replay_rounds > 1
    assert server.starts == sorted(set(server.starts))
    assert server.starts[0] == 0


async def test_a_replay_request_left_unanswered_is_asked_again() -> None:
    # A busy engine can sit on a request past the subscriber's wait; the batches it holds are
    # what the router must know before it serves.
    batches = stored_batches(50)
    with (
        ReplayServer(batches, unanswered=2) as server,
        subscribed(server, replay_timeout_s=0.3) as subscriber,
    ):
        subscriber.start()
        try:
            await asyncio.wait_for(subscriber.caught_up.wait(), 10)
        finally:
            await subscriber.stop()
    assert server.starts == [0, 0, 0]
    assert subscriber.last_seq == len(batches) - 1
    assert subscriber.replay_rounds == 3


async def test_a_replay_that_went_unanswered_is_asked_again_at_the_first_live_batch() -> None:
    events, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    batches = stored_batches(20)
    context = zmq.asyncio.Context()
    # Nothing listens yet when the subscriber connects and asks for its replay, nor for as
    # long as it keeps asking.
    subscriber = KvEventSubscriber(
        EngineBlockMap("http://engine", PrefixIndex(), 16),
        events,
        replay,
        context,
        replay_timeout_s=0.3,
        replay_max_s=1.0,
    )
    subscriber.start()
    try:
        await asyncio.wait_for(subscriber.caught_up.wait(), 5)
        assert subscriber.last_seq is None
        with ReplayServer(batches[:19], events=events, replay=replay) as server:
            seq, payload = batches[19]
            deadline = time.monotonic() + 10
            while subscriber.last_seq != seq and time.monotonic() < deadline:
                server.pub.send_multipart([TOPIC, seq.to_bytes(8, "big"), payload])
                await asyncio.sleep(0.1)
        assert subscriber.last_seq == seq
        assert subscriber.map.applied == 20  # the 19 published before it came from the replay
    finally:
        await subscriber.stop()
        context.term()


def accepts(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def service_config(server: ReplayServer, catch_up_s: float) -> RouterConfig:
    return RouterConfig.model_validate(
        {
            "host": "127.0.0.1",
            "port": free_port(),
            "servedModelName": "tiny",
            "tokenizer": str(MODEL_DIR),
            "catchUpSeconds": catch_up_s,
            "static": {
                "workers": [
                    {
                        "url": "http://127.0.0.1:9",
                        "kvEvents": server.events,
                        "kvEventsReplay": server.replay,
                    }
                ]
            },
        }
    )


async def serving_after(config: RouterConfig) -> tuple[RouterService, float]:
    """A router service started from `config`, and the seconds until its port accepted; checks
    that the port is not bound while start-up runs."""
    service = RouterService(config)
    started = time.monotonic()
    task = asyncio.create_task(service.start())
    while not task.done():
        assert not accepts(config.port)
        await asyncio.sleep(0.05)
    await task
    assert accepts(config.port)
    return service, time.monotonic() - started


async def test_the_router_serves_once_the_engines_kv_events_are_in() -> None:
    batches = stored_batches(2000)
    with ReplayServer(batches, delay_s=1.0) as server:
        service, waited = await serving_after(service_config(server, catch_up_s=15))
        try:
            assert waited >= 1.0
            assert service.subscribers["http://127.0.0.1:9"].last_seq == len(batches) - 1
        finally:
            await service.stop()


async def test_the_router_serves_after_catch_up_seconds_whatever_the_replay(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A replay trickling in, one batch every 0.2 s: it would take 40 s.
    with ReplayServer(stored_batches(200), interval_s=0.2) as server:
        with caplog.at_level(logging.WARNING, logger="tandem.router"):
            service, waited = await serving_after(service_config(server, catch_up_s=1.0))
        try:
            assert 1.0 <= waited < 5.0
            assert "without the KV events of http://127.0.0.1:9 caught up" in caplog.text
        finally:
            await service.stop()


@pytest.mark.timeout(120)
def test_a_new_router_predicts_what_the_engine_held_before_it_started() -> None:
    """End to end: an engine that has served a prompt, a router started afterwards whose replay
    is slow to answer (1 s, as a busy engine's can be), and a client that sends the same prompt
    the moment the router's port opens: the prediction is the engine's whole cached prefix."""
    engine = Engine(None, speedup=50, kv_events=True)
    prompt = f"asked before the router started: {LONG}"
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
    with running(engine):
        assert httpx.post(f"{engine.url}/v1/completions", json=body, timeout=30).status_code == 200
        batches = buffered(str(engine.replay))
        assert batches
        with ReplayServer(batches, delay_s=1.0) as server:
            router = Router(
                [
                    *("--worker", engine.url, "--tokenizer", str(MODEL_DIR)),
                    *("--kv-events", f"{engine.url}={engine.events},{server.replay}"),
                ]
            )
            try:
                answer = first_answer(router, body)
            finally:
                router.stop()
    assert answer.status_code == 200, answer.text
    hit, total = map(int, answer.headers["x-tandem-prefix-hit"].split("/"))
    assert total > 4
    assert hit == total


def buffered(replay: str) -> list[tuple[int, bytes]]:
    """Every batch an engine's replay endpoint holds."""
    with zmq.Context() as context, context.socket(zmq.DEALER) as dealer:
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(replay)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        batches = []
        while dealer.poll(5000):
            frames = dealer.recv_multipart()
            if frames[2] == END_OF_REPLAY_SEQ:
                return batches
            batches.append((int.from_bytes(frames[2], "big"), frames[3]))
    raise TimeoutError(f"{replay} did not finish its replay")


def first_answer(router: Router, body: dict[str, object]) -> httpx.Response:
    """The answer to `body` sent the moment the router accepts connections."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            return httpx.post(f"{router.url}/v1/completions", json=body, headers=DEBUG, timeout=30)
        except httpx.ConnectError:
            time.sleep(0.02)
    raise TimeoutError(f"router never accepted: {router.output()}")
