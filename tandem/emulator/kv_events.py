"""KV events over ZMQ as vLLM publishes them: PUB [topic, seq, msgpack batch] plus a ROUTER replay."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from pydantic import BaseModel, ConfigDict

log = logging.getLogger("tandem.emulator.kv_events")

END_OF_REPLAY_SEQ = (-1).to_bytes(8, "big", signed=True)
_encoder = msgspec.msgpack.Encoder()


class KVEventsConfig(BaseModel):
    """`--kv-events-config` (vLLM's KVEventsConfig fields; unknown keys are kept and ignored)."""

    model_config = ConfigDict(extra="allow")
    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""


def encode_batch(ts: float, events: list[dict[str, Any]], data_parallel_rank: int = 0) -> bytes:
    """The msgpack payload: [ts, [event maps...], data_parallel_rank]."""
    return _encoder.encode([ts, events, data_parallel_rank])


def should_bind(endpoint: str) -> bool:
    """vLLM binds when the endpoint has a wildcard host or is ipc/inproc, otherwise it connects."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def resolve_endpoint(endpoint: str, bind_host: str | None) -> tuple[str, bool]:
    """(address, bind?) for an endpoint; with `bind_host` a tcp endpoint is bound on that host."""
    if bind_host and endpoint.startswith("tcp://"):
        port = endpoint.rsplit(":", 1)[1]
        host = f"[{bind_host}]" if ":" in bind_host and bind_host != "*" else bind_host
        return f"tcp://{host}:{port}", True
    return endpoint, should_bind(endpoint)


class KVEventPublisher:
    """Publishes one batch per engine step that produced events; keeps the last batches for replay."""

    def __init__(
        self, config: KVEventsConfig, bind_host: str | None = None, dp_rank: int = 0
    ) -> None:
        self.config = config
        self.topic = config.topic.encode()
        self.dp_rank = dp_rank
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self.ctx = zmq.asyncio.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, config.hwm)
        self.pub.setsockopt(zmq.LINGER, 0)
        address, bind = resolve_endpoint(config.endpoint, bind_host)
        (self.pub.bind if bind else self.pub.connect)(address)
        self.pub_address = address
        self.replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        if config.replay_endpoint:
            address, bind = resolve_endpoint(config.replay_endpoint, bind_host)
            self.replay = self.ctx.socket(zmq.ROUTER)
            self.replay.setsockopt(zmq.LINGER, 0)
            (self.replay.bind if bind else self.replay.connect)(address)

    def start(self) -> None:
        if self.replay is not None and self._replay_task is None:
            self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay())

    def publish(self, events: list[dict[str, Any]]) -> None:
        if not events:
            return
        payload = encode_batch(time.time(), events, self.dp_rank)
        seq = self.seq.to_bytes(8, "big")
        self.buffer.append((self.seq, payload))
        self.seq += 1
        with contextlib.suppress(zmq.Again):
            self.pub.send_multipart((self.topic, seq, payload), flags=zmq.NOBLOCK, copy=False)

    async def _serve_replay(self) -> None:
        assert self.replay is not None
        while True:
            try:
                frames = await self.replay.recv_multipart()
            except (asyncio.CancelledError, zmq.ZMQError):
                return
            if len(frames) < 3:
                continue
            identity, start = frames[0], int.from_bytes(frames[-1], "big")
            for seq, payload in list(self.buffer):
                if seq >= start:
                    await self.replay.send_multipart(
                        (identity, b"", self.topic, seq.to_bytes(8, "big"), payload)
                    )
            await self.replay.send_multipart((identity, b"", b"", END_OF_REPLAY_SEQ, b""))

    async def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
        self.pub.close(0)
        if self.replay is not None:
            self.replay.close(0)
        self.ctx.term()
