"""Two router replicas behind a real HAProxy (round robin per request) over emulated engines with
KV events: replicas agree on sessions and on new prefixes with no shared store, and a replica
killed mid-run loses only the requests it had in flight, quickly."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections import defaultdict
from collections.abc import Iterator

import httpx
import pytest
from haproxy_process import HAProxy
from router_harness import DEBUG, Engine, Router, running

from tandem.router.fallback_tokenizer import FALLBACK_TOKENIZER
from tandem.router.rendezvous import hrw_order

# The emulators tokenize with their fallback, so the routers' exact index meets their KV events.
FALLBACK_MODEL = ["--model", "llama-without-local-tokenizer"]


def _words(seed: int, count: int) -> str:
    rng = random.Random(seed)
    return " ".join(f"w{rng.randrange(5000)}" for _ in range(count))


class Replicas:
    def __init__(self, engines: list[Engine], routers: list[Router], balancer: HAProxy):
        self.engines, self.routers, self.balancer = engines, routers, balancer


pytestmark = pytest.mark.slow  # ~25 s on 2 shared cores, most of it starting 6 processes


@pytest.fixture(scope="module")
def replicas() -> Iterator[Replicas]:
    engines = [Engine(None, speedup=20.0, extra=FALLBACK_MODEL, kv_events=True) for _ in range(3)]
    with running(*engines):
        args = ["--tokenizer", FALLBACK_TOKENIZER, "--block-size", "16"]
        for e in engines:
            args += ["--worker", e.url, "--kv-events", f"{e.url}={e.events},{e.replay}"]
        routers = [Router(args), Router(args)]
        with running(*routers):
            balancer = HAProxy([r.port for r in routers], timeout_s=30)
            try:
                yield Replicas(engines, routers, balancer)
            finally:
                balancer.stop()


def _body(prompt: str, max_tokens: int = 4, stream: bool = False) -> dict[str, object]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": stream}


def _prefix(group: int) -> str:
    return f"#{group} " + _words(group, 120)


async def _post(
    client: httpx.AsyncClient, url: str, body: dict[str, object], headers: dict[str, str]
) -> httpx.Response:
    return await client.post(url + "/v1/completions", json=body, headers=DEBUG | headers)


def test_sessions_stay_on_their_rendezvous_engine_across_replicas(replicas: Replicas) -> None:
    url = replicas.balancer.url
    urls = [e.url for e in replicas.engines]
    landed: dict[str, set[str]] = defaultdict(set)
    with httpx.Client(timeout=15) as client:
        for session in (f"conversation-{i}" for i in range(8)):
            prompt = f"system: you help with {session}."
            for turn in range(4):  # consecutive turns alternate between the two replicas
                prompt += f"\nuser: turn {turn} " + _words(turn, 12) + "\nassistant: ok"
                response = client.post(
                    url + "/v1/completions",
                    json=_body(prompt),
                    headers=DEBUG | {"x-session-id": session},
                )
                assert response.status_code == 200, response.text
                landed[session].add(response.headers["x-tandem-decode-engine"])
    assert all(len(engines) == 1 for engines in landed.values()), landed
    # an idle pool: each session on the top of its HRW order, so the sessions spread out
    assert all(engines == {hrw_order(s, urls, str)[0]} for s, engines in landed.items())
    assert len(set().union(*landed.values())) > 1


def test_a_shared_prefix_burst_lands_on_one_engine_per_prefix(replicas: Replicas) -> None:
    """Each new prefix arrives as a burst that HAProxy splits between the replicas, so both meet
    it cold at the same moment: both send it to the first engine in its first block's rendezvous
    order. Two requests per replica, so no replica's load bound moves the second one; the pool
    settles between bursts (one scrape), so neither replica still counts the last burst."""
    url = replicas.balancer.url

    async def burst(group: int) -> set[str]:
        async with httpx.AsyncClient(timeout=15) as client:
            prompts = [f"{_prefix(group)}\nQ{i}: why?\nA:" for i in range(4)]
            responses = await asyncio.gather(*(_post(client, url, _body(p), {}) for p in prompts))
        assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
        return {r.headers["x-tandem-decode-engine"] for r in responses}

    landed = {}
    for group in range(100, 110):
        time.sleep(0.6)  # > metricsScrapeIntervalSeconds: the engines' scraped loads settle
        landed[group] = asyncio.run(burst(group))
    assert all(len(engines) == 1 for engines in landed.values()), landed


def test_a_killed_replica_loses_only_its_in_flight_requests(replicas: Replicas) -> None:
    url = replicas.balancer.url
    doomed = replicas.routers[1]
    outcomes: list[tuple[float, float, bool]] = []  # start, end, succeeded

    async def one(client: httpx.AsyncClient, body: dict[str, object]) -> None:
        start = time.monotonic()
        ok = False
        try:
            async with client.stream(
                "POST", url + "/v1/completions", json=body, headers=DEBUG
            ) as response:
                text = b"".join([chunk async for chunk in response.aiter_bytes()])
                ok = response.status_code == 200 and text.rstrip().endswith(b"data: [DONE]")
        except httpx.HTTPError:
            ok = False
        outcomes.append((start, time.monotonic(), ok))

    async def load(until: float) -> None:
        # bounded: at most 40 requests per worker and until `until`
        async with httpx.AsyncClient(timeout=httpx.Timeout(10.0)) as client:

            async def worker(w: int) -> None:
                for i in range(40):
                    if time.monotonic() >= until:
                        return
                    await one(client, _body(f"{w} load {i} {_words(i, 3)}", 300, stream=True))

            await asyncio.gather(*(worker(w) for w in range(6)))

    async def run() -> tuple[float, float]:
        begin = time.monotonic()
        task = asyncio.create_task(load(begin + 5.0))
        await asyncio.sleep(2.0)
        killed_at = time.monotonic()
        os.kill(doomed.proc.pid, signal.SIGKILL)
        # The signal is delivered when the kernel next schedules the process: until it has died,
        # the replica may still accept requests.
        await asyncio.to_thread(doomed.proc.wait, 5)
        dead_at = time.monotonic()
        await task
        return killed_at, dead_at

    killed_at, dead_at = asyncio.run(run())
    failed = [(s, e) for s, e, ok in outcomes if not ok]
    assert failed, "the killed replica had requests in flight"
    # every failure was in flight at the kill, and its client learnt it within 2 s
    assert all(s <= dead_at and killed_at <= e <= dead_at + 2.0 for s, e in failed), (
        killed_at,
        dead_at,
        failed,
    )
    in_flight = [o for o in outcomes if o[0] <= dead_at and killed_at <= o[1]]
    assert len(failed) <= len(in_flight) - 1  # the surviving replica's in-flight ones finished
    later = [ok for s, _, ok in outcomes if s > dead_at]
    print(
        f"{len(outcomes)} requests, {len(in_flight)} in flight at the kill, {len(failed)} failed;"
        f" the replica died {1000 * (dead_at - killed_at):.1f} ms after the signal"
    )
    assert len(later) >= 6
    assert all(later)
