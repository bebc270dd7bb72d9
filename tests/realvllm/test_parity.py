"""Per-request prefix-hit parity: the blocks the router predicts a request will hit on the decode
engine it picks (`x-tandem-prefix-hit: HIT/TOTAL`, from the engines' KV events and the model's
tokenizer) against the blocks that engine's own prefix cache then hits
(`vllm:prefix_cache_hits_total` tokens / block size). vLLM always recomputes a prompt's last token,
so a prompt of whole blocks hits one block fewer than it has: ±1 block. Chat runs through a
Llama-3-style template (bos_token, header special tokens), which the router must render and
tokenize as vLLM does."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import (
    SYSTEM,
    PDCluster,
    Router,
    assert_parity,
    chat,
    completion,
    conversation,
    measure,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def router(pd_cluster: PDCluster, model_dir: Path) -> Iterator[Router]:
    pd_cluster.ensure_engines()
    router = pd_cluster.router("router-exact", tokenizer=str(model_dir))
    yield router
    router.stop()


def test_completions_prefix_hits_match_the_engine_per_request(
    pd: PDCluster, router: Router
) -> None:
    questions = [f" Question {i}: how many blocks does request {i} share? " * 3 for i in range(4)]
    bodies = [completion(SYSTEM + q) for q in questions]
    bodies += [completion(SYSTEM + questions[0] + " and a follow-up that extends it." * 4)]
    bodies += [completion(SYSTEM + questions[1])]  # an exact repeat
    assert_parity(measure(pd, [router], "/v1/completions", bodies), [router])


def test_chat_prefix_hits_match_the_engine_per_request_with_a_llama3_template(
    pd: PDCluster, router: Router
) -> None:
    bodies = [chat(conversation(f"Question {i}: what is cached?")) for i in range(3)]
    bodies += [chat(conversation("And now?", "Question 0: what is cached?"))]
    bodies += [chat(conversation("Question 1: what is cached?"))]  # an exact repeat
    assert_parity(measure(pd, [router], "/v1/chat/completions", bodies), [router])
