"""LoRA adapters through the router over real sockets, with emulated engines serving them as real
vLLM 0.32 does (tests/emulator/test_emulator_lora.py): /v1/models lists the adapters, a request
for an adapter goes where it already runs and a request for another adapter where a slot is free,
the exact index keeps an adapter's blocks apart from the base model's, runtime load/unload reaches
every engine, and P/D serves an adapter on both pools."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from lora_adapter import make_adapter
from router_harness import DEBUG, LONG, Engine, Router, running, wait_until
from tandem_process import MODEL_DIR

pytestmark = pytest.mark.timeout(120)

RUNTIME = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
LORA = ["--enable-lora", "--max-loras", "1", "--lora-modules", "a1=/adapters/a1", "a2=/adapters/a2"]


def models(url: str) -> list[str]:
    return [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]]


def post(router: Router, model: str, prompt: str, max_tokens: int = 2) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    return httpx.post(f"{router.url}/v1/completions", json=body, headers=DEBUG, timeout=60)


@pytest.fixture(scope="module")
def workers() -> Iterator[tuple[Router, list[Engine]]]:
    # A tenth of the H200 profile's speed: a long request outlasts the requests sent beside it.
    engines = [
        Engine(None, speedup=0.1, extra=LORA, kv_events=True, extra_env=RUNTIME) for _ in range(2)
    ]
    args = ["--tokenizer", str(MODEL_DIR)]
    for engine in engines:
        args += [
            "--worker",
            engine.url,
            "--kv-events",
            f"{engine.url}={engine.events},{engine.replay}",
        ]
    router = Router(args)
    with running(*engines, router):
        wait_until(lambda: models(router.url) == ["tiny", "a1", "a2"], timeout=20)
        yield router, engines


def test_models_through_the_router_list_the_adapters(
    workers: tuple[Router, list[Engine]],
) -> None:
    router, _ = workers
    data = httpx.get(f"{router.url}/v1/models", timeout=10).json()["data"]
    assert [(m["id"], m["root"], m["parent"]) for m in data] == [
        ("tiny", "tiny", None),
        ("a1", "/adapters/a1", "tiny"),
        ("a2", "/adapters/a2", "tiny"),
    ]
    unknown = post(router, "a9", "hello")
    assert unknown.status_code == 404
    assert unknown.json()["error"]["type"] == "NotFoundError"


def test_an_adapter_goes_where_it_runs_and_another_where_a_slot_is_free(
    workers: tuple[Router, list[Engine]],
) -> None:
    """One adapter slot per engine: while a long a1 request runs on one engine, the other a1
    requests join it there and the a2 requests go to the other engine, whatever their prompts.
    The long request streams and is held open until the others are answered, so it still runs
    however slowly a loaded machine serves them."""
    router, _ = workers
    body = {
        "model": "a1",
        "prompt": f"the long one {LONG}",
        "max_tokens": 1500,
        "ignore_eos": True,
        "stream": True,
    }
    url = f"{router.url}/v1/completions"
    with httpx.stream("POST", url, json=body, headers=DEBUG, timeout=60) as long:
        assert long.status_code == 200
        first = long.headers["x-tandem-decode-engine"]
        lines = long.iter_lines()  # kept: closing this iterator would close the stream
        next(lines)  # the engine has admitted it: a1 occupies first's slot
        same = [post(router, "a1", f"question {i}: {LONG[: 40 * (i + 1)]}") for i in range(4)]
        other = [post(router, "a2", f"other {i}: {LONG[: 30 * (i + 1)]}") for i in range(4)]
        still_running = httpx.get(f"{router.url}/engines").json()
        assert any(e["url"] == first and e["in_flight"] for e in still_running), still_running
    assert all(r.status_code == 200 for r in same + other)
    assert {r.headers["x-tandem-decode-engine"] for r in same} == {first}
    assert first not in {r.headers["x-tandem-decode-engine"] for r in other}


def test_the_index_keeps_an_adapters_blocks_apart(workers: tuple[Router, list[Engine]]) -> None:
    router, _ = workers
    prompt = f"cached for the adapter only: {LONG}"
    assert post(router, "a2", prompt).status_code == 200

    def hit(model: str) -> tuple[int, int]:
        answer = post(router, model, prompt)
        assert answer.status_code == 200, answer.text
        done, total = map(int, answer.headers["x-tandem-prefix-hit"].split("/"))
        return done, total

    wait_until(lambda: hit("a2")[0] > 0, timeout=10)  # once the engine's KV events arrived
    assert hit("tiny")[0] == 0
    assert hit("a1")[0] == 0


def test_runtime_load_and_unload_reach_every_engine(
    workers: tuple[Router, list[Engine]], tmp_path: Path
) -> None:
    router, engines = workers
    path = str(make_adapter(tmp_path / "a3", seed=3))
    load = httpx.post(
        f"{router.url}/v1/load_lora_adapter", json={"lora_name": "a3", "lora_path": path}
    )
    assert (load.status_code, load.text) == (200, "Success: LoRA adapter 'a3' added successfully.")
    assert all("a3" in models(e.url) for e in engines)
    assert "a3" in models(router.url)
    assert post(router, "a3", "hello adapter three").status_code == 200
    twice = httpx.post(
        f"{router.url}/v1/load_lora_adapter", json={"lora_name": "a3", "lora_path": path}
    )
    assert twice.status_code == 400
    assert "already been loaded" in twice.json()["error"]["message"]
    unload = httpx.post(f"{router.url}/v1/unload_lora_adapter", json={"lora_name": "a3"})
    assert unload.status_code == 200, unload.text
    assert not any("a3" in models(e.url) for e in engines)
    assert post(router, "a3", "hello again").status_code == 404
    refused = Router(["--worker", engines[0].url], trust_all=False)
    with running(refused):
        answer = httpx.post(
            f"{refused.url}/v1/load_lora_adapter", json={"lora_name": "a4", "lora_path": path}
        )
    assert answer.status_code == 403


def test_an_engine_restarted_without_a_runtime_adapter_gets_it_back(tmp_path: Path) -> None:
    """An adapter loaded through the router is loaded again on an engine that comes back without
    it (a restarted pod, a scale-up), while the other engine still serves it; once unloaded it is
    not brought back."""
    engines = [Engine(None, speedup=20, extra=LORA, extra_env=RUNTIME) for _ in range(2)]
    router = Router([arg for e in engines for arg in ("--worker", e.url)])
    path = str(make_adapter(tmp_path / "a4", seed=4))
    with running(*engines, router):
        load = httpx.post(
            f"{router.url}/v1/load_lora_adapter", json={"lora_name": "a4", "lora_path": path}
        )
        assert load.status_code == 200, load.text
        engines[1].restart()  # it starts with its --lora-modules only
        engines[1].wait_ready()
        wait_until(lambda: "a4" in models(engines[1].url), timeout=20)
        unload = httpx.post(f"{router.url}/v1/unload_lora_adapter", json={"lora_name": "a4"})
        assert unload.status_code == 200, unload.text
        engines[1].restart()
        engines[1].wait_ready()
        time.sleep(5)  # more than two of the router's health passes (2 s): nothing is replayed
        assert "a4" not in models(engines[1].url)


def test_pd_serves_an_adapter_on_both_pools() -> None:
    prefill = Engine("prefill", speedup=20, extra=LORA)
    decode = Engine("decode", speedup=20, extra=LORA)
    router = Router(
        ["--prefill", prefill.url, "--decode", decode.url, "--disaggregation", "always"]
    )
    with running(prefill, decode, router):

        def ready() -> bool:
            engines = httpx.get(f"{router.url}/engines", timeout=5).json()
            return all(e["healthy"] and "a1" in (e["adapters"] or {}) for e in engines)

        # the router started beside the engines: both healthy again and read before P/D
        wait_until(ready, timeout=20)
        answer = post(router, "a1", f"disaggregated with an adapter: {LONG}", 4)
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == "a1"
        assert answer.headers["x-tandem-route"] == "disaggregated"
        for engine in (prefill, decode):
            stats = httpx.get(f"{engine.url}/emulator/stats", timeout=5).json()
            assert stats["lora_swap_ins"] == 1, (engine.name, stats)  # each ran the adapter
