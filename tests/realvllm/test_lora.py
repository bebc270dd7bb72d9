"""LoRA adapters on real vLLM 0.32: a prefill/decode pair rendered from a ServingCluster with
`lora` (adapters made at test time, `tests/lora_adapter.py`), the router in front.

Checked against the engines themselves: the block hashes of an adapter request
(`tandem.common.block_hash` with the adapter's name and path), the router's exact-index
predictions against the decode engine's prefix hits for adapter and base requests, /v1/models
through the router, P/D with an adapter, `vllm:lora_requests_info` as the router reads it, and
runtime load/unload through the router on both pools.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq
from harness import (
    DEBUG,
    STARTUP_S,
    PDCluster,
    Router,
    assert_parity,
    measure,
    plan_tiny_cluster,
    stop_core_while_running,
    until,
)
from lora_adapter import make_adapter

from tandem.common.block_hash import BlockHasher
from tandem.router.lora import parse_lora_slots

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

BLOCK = 32
PROMPT = list(range(10, 10 + 3 * BLOCK))  # three full blocks of token ids


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: make_adapter(root / name, seed) for seed, name in enumerate(("ad1", "ad2"), 1)}


@pytest.fixture(scope="module")
def lora_pd(
    model_dir: Path, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PDCluster]:
    """The tiny example with ad1 loaded at start, runtime updates on, one adapter slot per batch
    and two in CPU memory, on both pools."""
    lora = {
        "adapters": [{"name": "ad1", "source": str(adapters["ad1"])}],
        "runtimeUpdates": True,
        "maxLoras": 1,
        "maxLoraRank": 8,
        "maxCpuLoras": 2,
    }
    run_dir = tmp_path_factory.mktemp("lora")
    plan = plan_tiny_cluster(model_dir, run_dir, [f"spec.lora={json.dumps(lora)}"])
    cluster = PDCluster(plan, run_dir)
    cluster.stop_others()  # at most two vLLM engines on this machine: the shared pair makes room
    try:
        for engine in (cluster.prefill, cluster.decode):
            engine.start()
        for engine in (cluster.prefill, cluster.decode):
            engine.wait_healthy(2 * STARTUP_S)  # LoRA adds to a start on a busy 2-core machine
        cluster.ensure_handshake()  # the pair's first pull is no test's (harness.PDCluster)
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def router(lora_pd: PDCluster) -> Router:
    router = lora_pd.router("lora-router")
    # the adapters come from each engine's /v1/models
    if until(lambda: all(e["adapters"] for e in router.engines()), 30, 0.2):
        return router
    raise TimeoutError(f"the router never read the engines' adapters: {router.engines()}")


def engine_key(pd: PDCluster) -> dict[str, str]:
    """The header an engine wants from a client other than the router (its API key)."""
    return {"authorization": f"Bearer {pd.plan.router_config.auth.engine_key}"}


def completion(model: str, prompt: list[int] | str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": 2, **extra}


def replayed_events(endpoint: str, timeout_s: float = 5.0) -> list[dict[str, Any]]:
    """Every event the engine still buffers, from its KV-event replay endpoint."""
    events: list[dict[str, Any]] = []
    with zmq.Context() as context, context.socket(zmq.DEALER) as dealer:
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(endpoint)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        while dealer.poll(int(timeout_s * 1000)):
            frames = dealer.recv_multipart()
            if len(frames) < 4 or frames[2] == (-1).to_bytes(8, "big", signed=True):
                return events
            events += msgspec.msgpack.decode(frames[3])[1]
    raise TimeoutError(f"no end of replay from {endpoint} after {len(events)} events")


def test_models_through_the_router_list_the_base_model_and_the_adapter(
    router: Router, adapters: dict[str, Path]
) -> None:
    models = httpx.get(f"{router.url}/v1/models", timeout=10).json()["data"]
    assert [(m["id"], m["parent"]) for m in models] == [("tiny", None), ("ad1", "tiny")]
    assert models[1]["root"] == str(adapters["ad1"])  # vLLM's root: the path it loaded


def test_an_adapter_request_is_prefilled_and_decoded_with_the_adapter(
    lora_pd: PDCluster, router: Router
) -> None:
    answer = httpx.post(
        f"{router.url}/v1/completions",
        json=completion("ad1", "Hello LoRA! " * 30, max_tokens=4),
        headers=DEBUG,
        timeout=120,
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == "ad1"
    assert answer.headers["x-tandem-route"] == "disaggregated"
    assert answer.headers["x-tandem-prefill-engine"] == lora_pd.prefill.url
    # Each engine ran the adapter: its prompt's blocks carry the adapter's name there.
    for engine in (lora_pd.prefill, lora_pd.decode):
        assert engine.spec.kv_events_replay is not None
        stored = [
            e
            for e in replayed_events(engine.spec.kv_events_replay)
            if e.get("type") == "BlockStored"
        ]
        assert any(e.get("lora_name") == "ad1" for e in stored), (engine.spec.name, stored)


def test_block_hashes_of_an_adapter_request_are_vllms(
    lora_pd: PDCluster, router: Router, adapters: dict[str, Path]
) -> None:
    """vLLM 0.32 keys every block of an adapter request with ("lora", name, path): recomputed
    here from the token ids, they equal the hashes in the engine's KV events; the base model's
    hashes of the same tokens differ."""
    salt = "lora-salt"
    for body in (completion("ad1", PROMPT), completion("ad1", PROMPT, cache_salt=salt)):
        answer = httpx.post(
            f"{lora_pd.decode.url}/v1/completions",
            json=body,
            headers=engine_key(lora_pd),
            timeout=120,
        )
        assert answer.status_code == 200, answer.text
    config = router.config
    hasher = BlockHasher(config.hash_algo, config.block_size, config.hash_seed)
    lora = ("ad1", str(adapters["ad1"]))
    assert lora_pd.decode.spec.kv_events_replay is not None
    chains = {
        (e["block_hashes"][0], tuple(e["token_ids"][:BLOCK]))
        for e in replayed_events(lora_pd.decode.spec.kv_events_replay)
        if e.get("type") == "BlockStored"
        and e.get("parent_block_hash") is None
        and e.get("lora_name") == "ad1"
    }
    plain = hasher.block_hashes(PROMPT, lora=lora)
    salted = hasher.block_hashes(PROMPT, cache_salt=salt, lora=lora)
    assert (plain[0], tuple(PROMPT[:BLOCK])) in chains, chains
    assert (salted[0], tuple(PROMPT[:BLOCK])) in chains, chains
    assert plain[0] != hasher.block_hashes(PROMPT)[0]
    assert plain[0] != salted[0]
    # the whole chain, against the events that continue it
    stored = {
        h
        for e in replayed_events(lora_pd.decode.spec.kv_events_replay)
        if e.get("type") == "BlockStored"
        for h in e["block_hashes"]
    }
    assert set(plain) <= stored
    assert set(salted) <= stored


def test_the_exact_index_predicts_vllms_hits_for_adapter_and_base_requests(
    lora_pd: PDCluster, router: Router
) -> None:
    """The same prompts for the base model and the adapter: each hits only its own blocks, and
    the router predicts the decode engine's hits within vLLM's one recomputed block."""
    shared = "Adapters keep their own prefix cache apart from the base model's blocks. " * 6
    bodies = [
        completion("tiny", shared + "First question?"),
        completion("ad1", shared + "First question?"),  # the base model's blocks do not count
        completion("ad1", shared + "Second question?"),  # the adapter's own blocks do
        completion("tiny", shared + "Second question?"),
        completion("ad1", shared + "First question?"),
    ]
    rows = measure(lora_pd, [router], "/v1/completions", bodies)
    assert_parity(rows, [router])
    assert rows[1][1] == 0, rows  # nothing of the base model's served the adapter request
    assert rows[2][1] >= 2, rows


def test_the_router_reads_the_adapter_slots_vllm_reports(
    lora_pd: PDCluster, router: Router
) -> None:
    """While an adapter request decodes, vllm:lora_requests_info names it running; the router's
    view of the engine follows. The engine's core is stopped once it runs the request (a quiet
    machine once finished 300 tokens before a poll saw them), so the router's monitor has all
    the time it needs to read the slots."""
    done = threading.Event()
    status: list[int] = []

    def long_request() -> None:
        try:
            answer = httpx.post(
                f"{lora_pd.decode.url}/v1/completions",
                json=completion("ad1", [7] * 40, max_tokens=1900, ignore_eos=True),
                headers=engine_key(lora_pd),
                timeout=180,
            )
            status.append(answer.status_code)
        finally:
            done.set()

    worker = threading.Thread(target=long_request)
    worker.start()
    engine = lora_pd.decode
    seen_router = None
    try:
        assert stop_core_while_running(engine, 1, ready=lambda: True, ended=done.is_set)
        try:
            slots = parse_lora_slots(httpx.get(f"{engine.url}/metrics", timeout=10).content)

            def router_sees_it() -> bool:
                nonlocal seen_router
                view = next(e for e in router.engines() if e["url"] == engine.url)
                if view["lora"] and "ad1" in view["lora"]["running"]:
                    seen_router = view["lora"]
                return seen_router is not None

            until(router_sees_it, 30, 0.1)
        finally:
            engine.resume_core()
    finally:
        worker.join(190)
    assert status == [200], status
    assert slots is not None
    assert "ad1" in slots.running, slots
    assert slots.max_loras == 1
    assert seen_router == {"max_loras": 1, "running": ["ad1"], "waiting": seen_router["waiting"]}


def test_runtime_load_and_unload_through_the_router(
    lora_pd: PDCluster, router: Router, adapters: dict[str, Path]
) -> None:
    load = {"lora_name": "ad2", "lora_path": str(adapters["ad2"])}
    url = router.url
    answer = httpx.post(f"{url}/v1/load_lora_adapter", json=load, timeout=60)
    assert answer.status_code == 200, answer.text
    assert "ad2" in [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]]
    # loaded on both pools: a P/D request for it works
    answer = httpx.post(
        f"{url}/v1/completions",
        json=completion("ad2", "Runtime adapters work too. " * 20),
        headers=DEBUG,
        timeout=120,
    )
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-tandem-route"] == "disaggregated"
    # vLLM's own refusals come back as sent
    again = httpx.post(f"{url}/v1/load_lora_adapter", json=load, timeout=60)
    assert again.status_code == 400, again.text
    assert "already been loaded" in again.json()["error"]["message"]
    missing = {"lora_name": "nowhere", "lora_path": "/nonexistent/adapter"}
    answer = httpx.post(f"{url}/v1/load_lora_adapter", json=missing, timeout=60)
    assert answer.status_code == 404, answer.text
    # unloaded everywhere: the router answers an unknown model as vLLM does
    answer = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "ad2"}, timeout=60)
    assert answer.status_code == 200, answer.text
    gone = httpx.post(f"{url}/v1/completions", json=completion("ad2", "x"), timeout=60)
    assert gone.status_code == 404, gone.text
    unknown = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "ad2"}, timeout=60)
    assert unknown.status_code == 404, unknown.text
