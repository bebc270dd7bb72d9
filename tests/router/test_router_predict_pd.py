"""The predictive policy's P/D decision over real sockets: emulator engines of known speeds (and,
with one decode engine and no prefill pool, no decision at all).

The decode engine's timing profile charges 0.2 ms per prefill token on top of the H200 profile,
so a long prompt misses its TTFT target there while a KV handoff to it does not; a fast prefill
engine meets the target, so the router learns to disaggregate; a slow one (the prefill pool
behind) is a predicted wait that misses it too, and the router keeps prefilling locally. The
seeds are optimistic (1 ms per 1,000 tokens), so an engine is tried before it is known.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from router_harness import DEBUG, Engine, Router, metric, metrics, running, wait_all_healthy
from tandem_process import MODEL_DIR

from tandem.bench.main import main as bench
from tandem.bench.records import BenchRecord
from tandem.emulator.profile import PROFILES_DIR, default_profile_name

pytestmark = pytest.mark.timeout(180)

# about 2,300 of the tiny model's tokens: ~0.5 s of prefill on the decode engine
PROMPT_WORDS = 800
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "router",
    "cache",
    "engine",
    "token",
    "prefill",
    "decode",
]
TTFT_TARGET_MS = 250
REQUESTS = 8


def predictive_config(tmp_path: Path, **predictive: object) -> Path:
    path = tmp_path / "router.yaml"
    seeds = {
        "prefillBaseMs": 1.0,
        "prefillMsPerKiloToken": 1.0,
        "handoffBaseMs": 1.0,
        "handoffMsPerKiloToken": 0.1,
    }
    config = {
        "servedModelName": "tiny",
        "static": {},
        "scoring": {"policy": "predictive", "predictive": {**seeds, **predictive}},
    }
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def decode(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    profile = yaml.safe_load((PROFILES_DIR / f"{default_profile_name()}.yaml").read_text())
    profile["step"]["per_prefill_token_s"] = 2e-4
    path = tmp_path_factory.mktemp("profile") / "slow-prefill.yaml"
    path.write_text(yaml.safe_dump(profile))
    engine = Engine("decode", speedup=1.0, extra=["--timing-profile", str(path)])
    with running(engine):
        yield engine


def routes(router: Router, tag: str, ttft_target_ms: int = TTFT_TARGET_MS) -> list[str]:
    """The route of each of REQUESTS sequential long prompts with a TTFT target, none of which
    the decode engine (shared by the tests) has cached."""
    seen = []
    for i in range(REQUESTS):
        rng = random.Random(f"{tag}{i}")
        prompt = f"{tag} {i} " + " ".join(rng.choice(WORDS) for _ in range(PROMPT_WORDS))
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "stream": True}
        headers = {**DEBUG, "x-slo-ttft-ms": str(ttft_target_ms)}
        with httpx.stream(
            "POST", router.url + "/v1/completions", json=body, headers=headers, timeout=60
        ) as response:
            assert response.status_code == 200
            events = [line for line in response.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]"
            seen.append(response.headers["x-tandem-route"])
    return seen


def start_router(prefill: Engine, decode: Engine, tmp_path: Path) -> Router:
    config = predictive_config(tmp_path)
    return Router(["--config", str(config), "--prefill", prefill.url, "--decode", decode.url])


def test_a_fast_prefill_pool_is_used_once_local_is_known_to_miss(
    decode: Engine, tmp_path: Path
) -> None:
    prefill = Engine("prefill", speedup=20.0)
    router = start_router(prefill, decode, tmp_path)
    with running(prefill, router):
        # local (~0.5 s) misses this target by far; P/D keeps room for a loaded machine
        seen = routes(router, "fast", ttft_target_ms=350)
        text = metrics(router.url)
    # both predicted to meet at first: local (no hop); then local is known to miss its target
    assert seen[0] == "local"
    assert seen[-5:] == ["disaggregated"] * 5, seen
    assert metric(text, "tandem_router_prediction_error_ratio_count", quantity="ttft") == REQUESTS
    assert metric(text, "tandem_router_prediction_error_ratio_count", quantity="prefill") >= 5


def test_requests_to_a_lone_decode_engine_go_out_unpredicted_and_are_predicted_after(
    decode: Engine, tmp_path: Path
) -> None:
    """One decode engine, no prefill pool, no sheddable class: no prediction could change where a
    request goes, so it is sent before its predictions are made (`placement.decided_alone`).
    They are made all the same, as of its plan: each streamed answer's first token is predicted
    and scored, one after another and in a burst whose plans settle each other's tickets."""
    router = Router(["--config", str(predictive_config(tmp_path)), "--decode", decode.url])
    url = router.url + "/v1/completions"

    def body(prompt: str) -> dict[str, object]:
        return {"model": "tiny", "prompt": prompt, "max_tokens": 8, "stream": True}

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            sent = (client.post(url, json=body(f"burst {i}"), headers=DEBUG) for i in range(8))
            return await asyncio.gather(*sent)

    with running(router):
        one_by_one = [
            httpx.post(url, json=body(f"alone {i}"), headers=DEBUG, timeout=60)
            for i in range(REQUESTS)
        ]
        together = asyncio.run(burst())
        text = metrics(router.url)
    for response in (*one_by_one, *together):
        assert response.status_code == 200
        assert response.headers["x-tandem-route"] == "local"
        assert float(response.headers["x-tandem-predicted-ttft-ms"]) > 0.0
    scored = metric(text, "tandem_router_prediction_error_ratio_count", quantity="ttft")
    assert scored == REQUESTS + 8
    assert metric(text, "tandem_router_prediction_error_ratio_count", quantity="tpot") > 0


def test_a_prefill_pool_behind_is_a_predicted_wait_and_requests_stay_local(
    decode: Engine, tmp_path: Path
) -> None:
    prefill = Engine("prefill", speedup=0.05)  # ~1.4 s per long prompt: far behind the target
    router = start_router(prefill, decode, tmp_path)
    with running(prefill, router):
        seen = routes(router, "behind")
        text = metrics(router.url)
    # tried once while its speed was unknown, then predicted to miss: local from there on
    assert seen.count("disaggregated") <= 1, seen
    assert seen[-6:] == ["local"] * 6, seen
    assert metric(text, "tandem_router_decisions_total", decision="disaggregated") <= 1


def test_a_bursty_trace_replay_stays_local_while_the_prefill_pool_is_behind(
    decode: Engine, tmp_path: Path
) -> None:
    """`tandem bench --trace` replays a Mooncake-format trace through the router: three bursts of
    four long prompts, no prefix shared, every request under the default SLO class's TTFT target.
    The prefill engine is far behind (a twentieth of the H200 pace), so after at most one try the
    predicted wait there keeps every request on the decode engine, bursts included."""
    rows = [
        {
            "timestamp": 1000 * burst,
            "input_length": 2000,
            "output_length": 4,
            "hash_ids": [1000 * burst + 10 * i + k for k in range(4)],
        }
        for burst in range(3)
        for i in range(4)
    ]
    trace = tmp_path / "bursts.jsonl"
    trace.write_text("".join(json.dumps(row) + "\n" for row in rows))
    classes = [{"minPriority": -100, "ttftMs": TTFT_TARGET_MS * 4}]
    prefill = Engine("prefill", speedup=0.05)
    router = Router(
        [
            "--config",
            str(predictive_config(tmp_path, sloClasses=classes)),
            "--prefill",
            prefill.url,
            "--decode",
            decode.url,
        ]
    )
    with running(prefill, router):
        wait_all_healthy(router)
        out = tmp_path / "bench"
        args = [router.url, "--trace", str(trace), "--tokenizer", str(MODEL_DIR), "--warmup", "0",
                "--trace-block-tokens", "512", "--quiet", "--no-plots", "--out", str(out)]  # fmt: skip
        assert bench(args) == 0
        text = metrics(router.url)
    record = BenchRecord.load(out / "A.json")
    assert record.summary.ok == len(rows)
    disaggregated = metric(text, "tandem_router_decisions_total", decision="disaggregated")
    local = metric(text, "tandem_router_decisions_total", decision="local")
    assert disaggregated <= 1, text
    assert local >= len(rows) - 1, text
    assert metric(text, "tandem_router_prediction_error_ratio_count", quantity="ttft") == len(rows)


def test_a_sheddable_request_that_cannot_meet_its_target_is_refused(
    decode: Engine, tmp_path: Path
) -> None:
    path = tmp_path / "router.yaml"
    classes = [
        {"minPriority": -100, "ttftMs": 60000},
        {"minPriority": 10, "ttftMs": 1, "sheddable": True},  # no prefill is that fast
    ]
    config = {
        "servedModelName": "tiny",
        "static": {},
        "scoring": {"policy": "predictive", "predictive": {"sloClasses": classes}},
    }
    path.write_text(yaml.safe_dump(config))
    router = Router(["--config", str(path), "--decode", decode.url])
    body = {"model": "tiny", "prompt": "shed me " * 200, "max_tokens": 2}
    with running(router):
        shed = httpx.post(
            router.url + "/v1/completions",
            json=body,
            headers={**DEBUG, "x-priority": "10"},
            timeout=30,
        )
        served = httpx.post(router.url + "/v1/completions", json=body, headers=DEBUG, timeout=30)
        text = metrics(router.url)
    assert shed.status_code == 429
    assert int(shed.headers["retry-after"]) >= 1
    assert served.status_code == 200
    assert metric(text, "tandem_router_rejected_total", reason="slo") == 1
