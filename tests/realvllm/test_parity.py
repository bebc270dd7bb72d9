"""Per-request prefix-hit parity: the blocks the router predicts a request will hit on the decode
engine it picks (`x-tandem-prefix-hit: HIT/TOTAL`, from the engines' KV events and the model's
tokenizer) against the blocks that engine's own prefix cache then hits
(`vllm:prefix_cache_hits_total` tokens / block size). vLLM always recomputes a prompt's last token,
so a prompt of whole blocks hits one block fewer than it has: ±1 block. Chat runs through a
Llama-3-style template (bos_token, header special tokens), which the router must render and
tokenize as vLLM does."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness import BLOCK, DEBUG, PDCluster, Router, metrics_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SYSTEM = "You answer questions about the prefix cache of a disaggregated serving stack. " * 8


@pytest.fixture(scope="module")
def router(pd_cluster: PDCluster, model_dir: Path) -> Iterator[Router]:
    pd_cluster.ensure_engines()
    router = pd_cluster.router("router-exact", tokenizer=str(model_dir))
    yield router
    router.stop()


def measure(
    pd: PDCluster, router: Router, path: str, bodies: list[dict[str, Any]]
) -> list[tuple[int, int, int]]:
    """(predicted hit blocks, engine hit blocks, prompt blocks) per request, sent one at a time,
    each after the KV events of the one before have reached the router."""
    rows = []
    for body in bodies:
        seqs = router.kv_seqs()
        before = metrics_of(pd.decode.url)["vllm:prefix_cache_hits_total"]
        answer = httpx.post(f"{router.url}{path}", json=body, headers=DEBUG, timeout=120)
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-tandem-decode-engine"] == pd.decode.url
        predicted, total = map(int, answer.headers["x-tandem-prefix-hit"].split("/"))
        hit_tokens = metrics_of(pd.decode.url)["vllm:prefix_cache_hits_total"] - before
        rows.append((predicted, int(hit_tokens) // BLOCK, total))
        router.wait_kv_events_settled(seqs)
    print(f"{path} prefix-hit parity (predicted, engine, prompt blocks): {json.dumps(rows)}")
    return rows


def assert_parity(rows: list[tuple[int, int, int]]) -> None:
    assert all(abs(predicted - hit) <= 1 for predicted, hit, _ in rows), rows
    assert sum(hit for _, hit, _ in rows) >= 2 * len(rows), f"too few hits to mean anything: {rows}"


def completion(prompt: str) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 2}


def chat(messages: list[dict[str, str]]) -> dict[str, Any]:
    return {"model": "tiny", "messages": messages, "max_tokens": 2}


def conversation(question: str, *earlier: str) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": SYSTEM}]
    for turn in earlier:
        messages += [{"role": "user", "content": turn}, {"role": "assistant", "content": "Noted."}]
    return [*messages, {"role": "user", "content": question}]


def test_completions_prefix_hits_match_the_engine_per_request(
    pd: PDCluster, router: Router
) -> None:
    questions = [f" Question {i}: how many blocks does request {i} share? " * 3 for i in range(4)]
    bodies = [completion(SYSTEM + q) for q in questions]
    bodies += [completion(SYSTEM + questions[0] + " and a follow-up that extends it." * 4)]
    bodies += [completion(SYSTEM + questions[1])]  # an exact repeat
    assert_parity(measure(pd, router, "/v1/completions", bodies))


def test_chat_prefix_hits_match_the_engine_per_request_with_a_llama3_template(
    pd: PDCluster, router: Router
) -> None:
    bodies = [chat(conversation(f"Question {i}: what is cached?")) for i in range(3)]
    bodies += [chat(conversation("And now?", "Question 0: what is cached?"))]
    bodies += [chat(conversation("Question 1: what is cached?"))]  # an exact repeat
    assert_parity(measure(pd, router, "/v1/chat/completions", bodies))
