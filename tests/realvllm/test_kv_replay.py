"""The KV-event replay against vLLM's own publisher: a buffer filled to vLLM's default depth
(10,000 batches) is replayed whole, in order, into fresh subscribers asking at once, as the
processes of a new router (or new replicas) do when they start.

vLLM streams a replay through a ROUTER socket with a send queue of 1,000 messages and drops what
overflows it; the subscriber asks again from the first hole it sees (`KvEventSubscriber`).
"""

from __future__ import annotations

import asyncio
import subprocess
import textwrap

import pytest
import zmq.asyncio
from harness import VLLM_PYTHON

from tandem.common.ports import free_port
from tandem.router.index import PrefixIndex
from tandem.router.kv_events import EngineBlockMap, KvEventSubscriber

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

BATCHES = 10_000
SUBSCRIBERS = 4

# vLLM's publisher, filled with one BlockStored batch per step, then held until stdin closes.
PUBLISHER = textwrap.dedent(
    """
    import sys, time
    from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher

    events, replay, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    publisher = ZmqEventPublisher(0, endpoint=events, replay_endpoint=replay)
    for seq in range(count):
        block = BlockStored(
            block_hashes=[seq + 1], parent_block_hash=None, token_ids=[seq % 30000] * 16,
            block_size=16, lora_id=None, medium="GPU", lora_name=None,
        )
        publisher.publish(KVEventBatch(ts=time.time(), events=[block]))
    publisher._event_queue.join()  # every batch sent and buffered
    print("buffered", flush=True)
    sys.stdin.read()
    publisher.shutdown()
    """
)


async def replay_into_fresh_subscribers(events: str, replay: str) -> list[KvEventSubscriber]:
    context = zmq.asyncio.Context()
    subscribers = [
        KvEventSubscriber(EngineBlockMap(f"engine-{i}", PrefixIndex(), 16), events, replay, context)
        for i in range(SUBSCRIBERS)
    ]
    for subscriber in subscribers:
        subscriber.start()
    try:
        await asyncio.wait_for(
            asyncio.gather(*(s.caught_up.wait() for s in subscribers)), timeout=60
        )
    finally:
        for subscriber in subscribers:
            await subscriber.stop()
        context.term()
    return subscribers


def test_vllms_full_replay_buffer_reaches_every_new_subscriber_whole() -> None:
    events, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    publisher = subprocess.Popen(
        [VLLM_PYTHON, "-c", PUBLISHER, events, replay, str(BATCHES)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert publisher.stdout is not None
        for line in publisher.stdout:
            if line.startswith("buffered"):
                break
        else:
            pytest.fail(f"vLLM's publisher exited with {publisher.wait()}")
        subscribers = asyncio.run(replay_into_fresh_subscribers(events, replay))
    finally:
        publisher.communicate(timeout=30)
    rounds = [s.replay_rounds for s in subscribers]
    print(f"replay rounds per subscriber ({SUBSCRIBERS} at once, {BATCHES} batches): {rounds}")
    for subscriber in subscribers:
        assert subscriber.last_seq == BATCHES - 1
        assert subscriber.map.applied == BATCHES
