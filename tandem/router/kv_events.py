"""KV-event subscriber: one ZMQ SUB per engine feeding the exact prefix index, with replay.

Frames are `[topic, seq (8-byte big-endian), msgpack [ts, events, dp_rank]]`. On (re)connect and
whenever a sequence gap shows up, the DEALER replay socket asks for every buffered batch from the
first missing seq (`[b"", start]` -> `[b"", topic, seq, payload]`... `[b"", b"", -1, b""]`).
The SUB heartbeats its connection (ZMTP PING/PONG, which the engine's libzmq answers by itself): a
connection that stops carrying anything, such as a half-open TCP connection to an engine behind a
network partition, is dropped and dialled again instead of starving that engine's slice of the
index forever; the first batch after it reveals the gap, and the replay fills it.
The engine streams a replay through a ROUTER socket, which drops whatever overflows its send queue
(1,000 messages in vLLM) without a word, so a replay of a long buffer can arrive with holes or
without its end marker: the subscriber applies batches strictly in order and asks again from the
first one missing (or asks again, when a request goes unanswered), until the end marker arrives
after an unbroken run.
Events are mapped onto the router's own block keys (`blocks.py`): a BlockStored's token ids are
keyed in a chain continuing from its parent's key (a chain's first block from the seed of its
`lora_name` and cache salt), so request keys and event keys always agree.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from tandem.common.block_hash import BlockHasher
from tandem.router.blocks import block_keys, chain_seed
from tandem.router.index import PrefixIndex
from tandem.router.metrics import RouterMetrics

log = logging.getLogger("tandem.router.kv_events")
_END_SEQ = (-1).to_bytes(8, "big", signed=True)


class EngineBlockMap:
    """Applies one engine's KV events to the index; maps the engine's block hashes to our keys."""

    def __init__(
        self, engine: str, index: PrefixIndex, block_size: int, hasher: BlockHasher | None = None
    ):
        self.engine = engine
        self.index = index
        self.block_size = block_size
        self.hasher = hasher  # checks once that the engines hash the way the config says
        self._keys: OrderedDict[int, list[int]] = OrderedDict()  # engine hash -> [key, count]
        self._max = 2 * index.max_blocks_per_engine
        self.applied = 0
        self.hash_config_matches: bool | None = None
        self._warned_block_size = False

    def apply(self, events: list[Any]) -> None:
        for event in events:
            if not isinstance(event, dict):  # array-encoded events (older vLLM) are ignored
                continue
            kind = event.get("type")
            if kind == "BlockStored":
                self._stored(event)
            elif kind == "BlockRemoved":
                self._removed(event.get("block_hashes") or [])
            elif kind == "AllBlocksCleared":
                self.clear()
            self.applied += 1

    def clear(self) -> None:
        self.index.clear(self.engine)
        self._keys.clear()

    def _stored(self, event: dict[str, Any]) -> None:
        hashes: list[int] = event.get("block_hashes") or []
        tokens: list[int] = event.get("token_ids") or []
        size = int(event.get("block_size") or self.block_size)
        if size != self.block_size and not self._warned_block_size:
            log.warning(
                "engine %s uses block size %d, router %d: prefix hits will not match",
                self.engine,
                size,
                self.block_size,
            )
            self._warned_block_size = True
        parent_hash = event.get("parent_block_hash")
        if parent_hash is None:
            adapter = event.get("lora_name")
            adapter = adapter if isinstance(adapter, str) else None
            salt = first_block_salt((event.get("extra_keys") or [None])[0], adapter)
            parent = chain_seed(salt, adapter)
            if (
                self.hasher is not None
                and self.hash_config_matches is None
                and salt is None
                and adapter is None
                and hashes
            ):
                expected = self.hasher.block_hashes(tokens[:size])
                self.hash_config_matches = bool(expected) and expected[0] == hashes[0]
                if not self.hash_config_matches:
                    log.warning(
                        "engine %s hashes blocks with another algorithm or seed than the "
                        "router's hashAlgo/hashSeed; the index keys on token ids, so routing "
                        "is unaffected",
                        self.engine,
                    )
        else:
            entry = self._keys.get(parent_hash)
            if entry is None:
                return  # parent unknown (evicted from our bound): the chain cannot be keyed
            parent = entry[0]
        keys = block_keys(tokens, size, parent)
        for engine_hash, key in zip(hashes, keys, strict=False):
            entry = self._keys.get(engine_hash)
            if entry is None:
                self._keys[engine_hash] = [key, 1]
            else:
                entry[1] += 1
                self._keys.move_to_end(engine_hash)
        self.index.store(self.engine, keys[: len(hashes)])
        while len(self._keys) > self._max:
            self._keys.popitem(last=False)

    def _removed(self, hashes: list[int]) -> None:
        for engine_hash in hashes:
            entry = self._keys.get(engine_hash)
            if entry is None:
                continue
            self.index.remove(self.engine, (entry[0],))
            entry[1] -= 1
            if entry[1] <= 0:
                del self._keys[engine_hash]


def first_block_salt(extra: object, adapter: str | None) -> str | None:
    """The cache salt in block 0's untagged extra keys: after the adapter's name when the block
    belongs to an adapter (`[name, salt]`), else first (`[salt]`)."""
    if not isinstance(extra, list):
        return None
    values = extra[1:] if adapter is not None else extra
    return values[0] if values and isinstance(values[0], str) else None


_payload_decoder = msgspec.msgpack.Decoder()


def decode_payload(payload: bytes) -> tuple[float | None, list[Any]]:
    """The publication time (engine clock, seconds) and events of one msgpack batch
    `[ts, events, dp_rank]`."""
    batch = _payload_decoder.decode(payload)
    if isinstance(batch, list) and len(batch) >= 2 and isinstance(batch[1], list):
        ts = batch[0]
        return (float(ts) if isinstance(ts, int | float) else None), batch[1]
    return None, []


class KvEventSubscriber:
    """Keeps one engine's slice of the index in sync with its KV events until stopped.

    Nothing an engine sends ends it: an undecodable or inapplicable batch is logged, counted
    (`tandem_router_kv_event_errors_total{kind="batch"}`) and skipped; a failing subscription is
    counted (`kind="subscription"`), and the subscriber connects again after a backoff and asks
    for a replay from the first sequence number it has not applied.

    A live batch lost is found by the sequence gap the next one shows; a lost batch with none
    after it would stay out of the index until the engine publishes again (ZMQ drops what a
    subscription misses while it reconnects, as after an engine that stalled past the heartbeat
    timeout). So after `quiet_s` without a live batch the subscriber asks the replay endpoint once
    for anything after the last batch applied (`catch_ups` counts the times it brought some).
    """

    def __init__(
        self,
        block_map: EngineBlockMap,
        endpoint: str,
        replay_endpoint: str | None,
        context: zmq.asyncio.Context,
        metrics: RouterMetrics | None = None,
        replay_timeout_s: float = 2.0,
        replay_max_s: float = 10.0,
        max_backoff_s: float = 10.0,
        heartbeat_s: float = 5.0,
        quiet_s: float = 5.0,
    ):
        self.map = block_map
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.context = context
        self.metrics = metrics
        self.replay_timeout_s = replay_timeout_s
        self.replay_max_s = replay_max_s
        self.max_backoff_s = max_backoff_s
        self.heartbeat_s = heartbeat_s
        self.quiet_s = quiet_s
        self.last_seq: int | None = None
        # Set once the first replay after start has ended, whatever its outcome: the router
        # serves only after this (or its start-up bound), so it never predicts from an index that
        # has not yet heard what the engine already holds.
        self.caught_up = asyncio.Event()
        self.replays = 0
        self.replay_rounds = 0
        self.resubscribes = 0
        self.catch_ups = 0
        self.bad_batches = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"kv-events {self.endpoint}")

    async def stop(self) -> None:
        """Ends the subscription: cancelled until it is done (a cancellation can be lost where
        it meets an answer, so one is not trusted to land)."""
        task = self._task
        if task is None:
            return
        while not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=1.0)
        with contextlib.suppress(asyncio.CancelledError, Exception):
            task.result()

    def _count(self, kind: str) -> None:
        if self.metrics is not None:
            self.metrics.child(self.metrics.kv_event_errors, self.map.engine, kind).inc()

    def _accept(self, seq: int, payload: bytes, live: bool = False) -> None:
        """Applies one batch; a batch that cannot be applied is skipped (and counted). A live
        batch's lag, from its publication to now, feeds `tandem_router_kv_event_lag_seconds`:
        how far the exact index trails the engine."""
        try:
            ts, events = decode_payload(payload)
            self.map.apply(events)
            if live and ts is not None and self.metrics is not None:
                lag = max(time.time() - ts, 0.0)
                self.metrics.child(self.metrics.kv_event_lag, self.map.engine).observe(lag)
        except Exception as exc:  # anything an engine sends must not end the subscription
            self.bad_batches += 1
            self._count("batch")
            log.warning("KV-event batch seq %d from %s skipped: %r", seq, self.endpoint, exc)
        self.last_seq = seq

    async def _run(self) -> None:
        backoff = 0.25
        while True:
            try:
                await self._subscribe()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.caught_up.set()
                self.resubscribes += 1
                self._count("subscription")
                log.warning("KV events from %s failed (%r); subscribing again", self.endpoint, exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.max_backoff_s)

    async def _subscribe(self) -> None:
        sub = self.context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100000)
        # Silent for three heartbeats: the connection is gone whatever TCP still believes.
        sub.setsockopt(zmq.HEARTBEAT_IVL, int(self.heartbeat_s * 1000))
        sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(self.heartbeat_s * 3000))
        sub.connect(self.endpoint)
        try:
            await self._replay()
            self.caught_up.set()
            while True:
                try:
                    async with asyncio.timeout(self.quiet_s):
                        frames = await sub.recv_multipart()
                except TimeoutError:
                    await self._catch_up()
                    continue
                if len(frames) < 3 or len(frames[-2]) != 8:
                    self._count("batch")
                    continue
                await self._on_batch(int.from_bytes(frames[-2], "big", signed=True), frames[-1])
        finally:
            sub.close(0)

    async def _on_batch(self, seq: int, payload: bytes) -> None:
        last = self.last_seq
        if last is not None and seq <= last:
            if seq == 0 and last > 1:  # the engine restarted: start over
                self.map.clear()
                self.last_seq = None
            else:
                return
        elif seq > (0 if last is None else last + 1):
            # A gap, or (nothing applied yet) a replay on connect that went unanswered.
            await self._replay()
            if self.last_seq is not None and seq <= self.last_seq:
                return
        self._accept(seq, payload, live=True)

    async def _catch_up(self) -> None:
        """One replay round after a quiet spell (class docstring), logged only when it brought
        batches that never arrived live."""
        if not self.replay_endpoint:
            return
        before = self.last_seq
        await self._replay_round()
        if self.last_seq != before:
            self.catch_ups += 1
            log.info(
                "KV events from %s: batches %d to %d never arrived live; replayed",
                self.endpoint,
                0 if before is None else before + 1,
                self.last_seq,
            )

    async def _replay(self) -> None:
        """Applies the engine's buffered batches after the last one applied: rounds of
        `_replay_round` until one ends cleanly, for at most `replay_max_s`. A round that brings
        nothing is asked again as well: a busy engine, or this process still starting, can leave
        a request unanswered past `replay_timeout_s`, and a replay given up leaves its batches out
        of the index for good (for the first replay, everything the engine already held)."""
        if not self.replay_endpoint:
            return
        self.replays += 1
        started, rounds, first = time.monotonic(), self.replay_rounds, self.last_seq
        try:
            async with asyncio.timeout(self.replay_max_s):
                while True:
                    self.replay_rounds += 1
                    if await self._replay_round():
                        break
        except TimeoutError:
            log.warning(
                "KV-event replay from %s unfinished after %.0f s (%d rounds, last batch %s)",
                self.replay_endpoint,
                self.replay_max_s,
                self.replay_rounds - rounds,
                self.last_seq,
            )
            return
        log.info(
            "KV-event replay from %s: %s in %d rounds, %.2f s",
            self.replay_endpoint,
            "nothing new"
            if self.last_seq == first
            else f"batches {0 if first is None else first + 1} to {self.last_seq}",
            self.replay_rounds - rounds,
            time.monotonic() - started,
        )

    async def _replay_round(self) -> bool:
        """One request for every buffered batch after the last applied, on a connection of its
        own; True if it ended with the end marker after an unbroken run.

        Batches are applied only in order. The first may come later than asked for (the
        engine's buffer no longer reaches back that far, which no retry can change); after it,
        a batch out of order is a hole the engine's send queue made, and ends the round: the
        next asks again from the hole, and closing this connection discards the rest of the
        stream.
        """
        assert self.replay_endpoint is not None
        start = 0 if self.last_seq is None else self.last_seq + 1
        dealer = self.context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        # Take the stream as fast as it comes: whatever backs up here backs up into the engine's
        # send queue, which drops it.
        dealer.setsockopt(zmq.RCVHWM, 0)
        dealer.connect(self.replay_endpoint)
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            expected: int | None = None  # once a batch of this round is applied: the next one
            while True:
                try:
                    # not asyncio.wait_for: on Python 3.11 it can swallow a cancellation that
                    # meets the answer, and stop() would then wait on a subscription forever
                    async with asyncio.timeout(self.replay_timeout_s):
                        frames = await dealer.recv_multipart()
                except TimeoutError:
                    return False
                if len(frames) < 4 or frames[2] == _END_SEQ:
                    return True
                if len(frames[2]) != 8:
                    self._count("batch")
                    continue
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq < (start if expected is None else expected):
                    continue  # applied already
                if expected is not None and seq > expected:
                    return False
                if expected is None and seq > start:
                    log.info(
                        "KV-event replay from %s starts at batch %d, not %d: the engine's buffer "
                        "no longer holds the batches between",
                        self.replay_endpoint,
                        seq,
                        start,
                    )
                self._accept(seq, frames[3])
                expected = seq + 1
        finally:
            dealer.close(0)
