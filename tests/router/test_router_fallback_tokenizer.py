"""The router's `tandem-fallback` tokenization equals the emulator's, so the exact KV-event index
works with emulated engines that have no tokenizer.json (as `tandem up` runs them)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from router_harness import Engine, Router, completion, metric, metrics, running

from tandem.emulator.tokenizer import fallback_encode
from tandem.router.fallback_tokenizer import FALLBACK_TOKENIZER, fallback_token_ids

TEXTS = [
    "",
    "Hello, world!",
    "a shared system prompt about routing requests\n\n to the engine 12345 holding it.",
    "supercalifragilisticexpialidocious antidisestablishmentarianism 3.14159265358979",
    "tabs\tand  double  spaces, ünïcödé wörds, emoji 🚀🚀 and CJK 你好世界",
    "user: what is P/D?\nassistant:",
]


@pytest.mark.parametrize("text", TEXTS)
def test_router_reproduces_the_emulators_fallback_token_ids(text: str) -> None:
    assert fallback_token_ids(text) == fallback_encode(text)


@pytest.fixture(scope="module")
def fallback_workers() -> Iterator[tuple[Engine, Engine]]:
    # A model name that is no directory: the emulators tokenize with their fallback.
    extra = ["--model", "llama-without-local-tokenizer"]
    a = Engine(None, extra=extra, kv_events=True)
    b = Engine(None, extra=extra, kv_events=True)
    with running(a, b):
        yield a, b


@pytest.mark.timeout(120)
def test_exact_index_meets_fallback_tokenized_kv_events(
    fallback_workers: tuple[Engine, Engine],
) -> None:
    a, b = fallback_workers
    router = Router(
        [
            *("--worker", a.url, "--worker", b.url),
            *("--tokenizer", FALLBACK_TOKENIZER, "--block-size", "16"),
            *("--kv-events", f"{a.url}={a.events},{a.replay}"),
            *("--kv-events", f"{b.url}={b.events},{b.replay}"),
        ]
    )
    with running(router):
        prompt = "every request of this tenant starts with the same long instructions. " * 8
        first = completion(router, prompt + "question one")
        assert first.status_code == 200
        owner = first.headers["x-tandem-decode-engine"]
        deadline = time.monotonic() + 10
        indexed = 0
        while time.monotonic() < deadline and not indexed:
            engines = {e["url"]: e for e in httpx.get(router.url + "/engines").json()}
            indexed = engines[owner]["indexed_blocks"]
            time.sleep(0.1)
        assert indexed > 0
        second = completion(router, prompt + "question two")
        assert second.headers["x-tandem-decode-engine"] == owner
        hit, total = map(int, second.headers["x-tandem-prefix-hit"].split("/"))
        assert hit > 0
        assert hit >= total - 2
        exact_hits = metric(
            metrics(router.url), "tandem_router_prefix_hit_blocks_total", index="exact"
        )
        assert exact_hits >= hit
