"""Router replicas and router processes in front of real vLLM, with nothing shared between them.

Each replica (and each process of a router of several) subscribes to the engines' KV events on its
own and keeps its own copy of the exact index. A conversation whose turns alternate between two
replicas must then be predicted by each replica as the engine's own prefix cache reports it
(`x-tandem-prefix-hit` against `vllm:prefix_cache_hits_total`, within one block, as in
test_parity), through a Llama-3-style chat template. A router of two processes must predict the
same way whichever process a connection lands on, and both processes must hold the same index.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import PDCluster, Router, assert_parity, chat, conversation, measure

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

QUESTIONS = [f"Turn {i}: which blocks of this conversation are cached by now?" for i in range(4)]


def turns(lead: str = "") -> list[dict[str, object]]:
    """A conversation of four turns, each extending the one before; each new question starts with
    `lead`."""
    return [chat(conversation(lead + q, *QUESTIONS[:i])) for i, q in enumerate(QUESTIONS)]


@pytest.fixture(scope="module")
def two_replicas(pd_cluster: PDCluster, model_dir: Path) -> Iterator[list[Router]]:
    pd_cluster.ensure_engines()
    replicas = [pd_cluster.router(f"replica-{i}", tokenizer=str(model_dir)) for i in range(2)]
    yield replicas
    for replica in replicas:
        replica.stop()


def test_a_conversation_alternating_between_two_replicas_is_predicted_by_both(
    pd: PDCluster, two_replicas: list[Router]
) -> None:
    # Turn i goes through replica i % 2: every turn after the first extends what the other
    # replica sent, which this one learnt only from the engines' KV events.
    assert_parity(measure(pd, two_replicas, "/v1/chat/completions", turns()), two_replicas)


def test_a_router_of_two_processes_predicts_from_either_process(
    pd: PDCluster, model_dir: Path
) -> None:
    router = pd.router("two-processes", tokenizer=str(model_dir), processes=2)
    try:
        # Each request opens a connection of its own; the kernel spreads them over the processes.
        assert_parity(measure(pd, [router], "/v1/chat/completions", turns("Again: ")), [router])
        for engine in router.engines():
            seen = engine["processes"]
            assert sorted(seen) == ["0", "1"], engine
            assert seen["0"]["indexed_blocks"] == seen["1"]["indexed_blocks"], engine
            assert seen["0"]["kv_events_last_seq"] == seen["1"]["kv_events_last_seq"], engine
    finally:
        router.stop()
