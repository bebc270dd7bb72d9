"""vLLM's sleep mode and a GPU shared by two engines, over real sockets against emulator processes.

Real vLLM cannot answer these here: its CPU build refuses --enable-sleep-mode at start ("Sleep
mode is not supported on current platform.", tests/realvllm/test_sleep_mode.py), so the shapes
follow vLLM 0.32's sources (entrypoints/serve/dev/sleep) and the costs docs/findings.md's H200
measurement.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
from emu_harness import TINY_ARGS, emulator, metric_value

from tandem.emulator.profile import load_profile

DEV = {"VLLM_SERVER_DEV_MODE": "1"}
SLEEPY = [*TINY_ARGS, "--enable-sleep-mode"]
PROMPT = "the quick brown fox jumps over the lazy dog " * 12


def complete(url: str, max_tokens: int = 4, timeout: float = 30) -> dict[str, object]:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=timeout)
    assert r.status_code == 200, r.text
    data: dict[str, object] = r.json()
    return data


def metrics(url: str) -> str:
    return httpx.get(url + "/metrics", timeout=10).text


def test_sleep_level1_frees_weights_empties_the_prefix_cache_and_holds_requests() -> None:
    profile = load_profile()
    with emulator(SLEEPY, env=DEV) as proc:
        url = proc.url
        assert httpx.get(url + "/is_sleeping").json() == {"is_sleeping": False}
        complete(url)
        complete(url)
        text = metrics(url)
        hits_before = metric_value(text, "vllm:prefix_cache_hits_total")
        assert hits_before > 0
        used_awake = metric_value(text, "DCGM_FI_DEV_FB_USED")

        r = httpx.post(url + "/sleep", params={"level": 1}, timeout=30)
        assert r.json() == {"status": "sleeping", "level": 1}
        assert httpx.get(url + "/is_sleeping").json() == {"is_sleeping": True}
        text = metrics(url)
        assert (
            'vllm:engine_sleep_state{engine="0",model_name="tiny",sleep_state="awake"} 0.0' in text
        )
        assert (
            'vllm:engine_sleep_state{engine="0",model_name="tiny",sleep_state="weights_offloaded"}'
            " 1.0" in text
        )
        used_asleep = metric_value(text, "DCGM_FI_DEV_FB_USED")
        memory = profile.gpu_memory()
        assert used_asleep == memory.non_torch_bytes // 2**20
        assert used_awake - used_asleep >= memory.weights_bytes // 2**20

        async def held_then_woken() -> tuple[bool, float]:
            async with httpx.AsyncClient(timeout=30) as client:
                body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "ignore_eos": True}
                pending = asyncio.ensure_future(client.post(url + "/v1/completions", json=body))
                await asyncio.sleep(0.5)
                held = not pending.done()
                start = time.monotonic()
                woke = await client.post(url + "/wake_up")
                wake_s = time.monotonic() - start
                assert woke.json() == {"status": "awake", "tags": None}
                assert (await pending).status_code == 200
                return held, wake_s

        held, wake_s = asyncio.run(held_then_woken())
        assert held, "a request sent to a sleeping engine must wait for the wake-up"
        weights = memory.weights_bytes
        emulated = (profile.sleep.wake_weights_seconds(1, weights) + profile.sleep.map_s) / 20
        assert wake_s >= 0.9 * emulated
        text = metrics(url)
        # the repeated prompt found nothing: level 1 discards the KV cache
        assert metric_value(text, "vllm:prefix_cache_hits_total") == hits_before
        assert 'sleep_state="awake"} 1.0' in text
        assert metric_value(text, "DCGM_FI_DEV_FB_USED") >= used_awake - 1


def at_speedup(args: list[str], speedup: str) -> list[str]:
    args = list(args)
    args[args.index("--speedup") + 1] = speedup
    return args


def test_sleep_aborts_running_requests_by_default_and_waits_in_wait_mode() -> None:
    # a 300-token answer takes about 1 s at speed-up 2; level 0 pauses without memory costs
    with emulator(at_speedup(SLEEPY, "2"), env=DEV) as proc:
        url = proc.url

        async def sleep_during(mode: str) -> str:
            async with httpx.AsyncClient(timeout=60) as client:
                body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 300, "ignore_eos": True}
                pending = asyncio.ensure_future(client.post(url + "/v1/completions", json=body))
                await asyncio.sleep(0.3)
                r = await client.post(url + "/sleep", params={"level": 0, "mode": mode})
                assert r.status_code == 200, r.text
                answer = (await pending).json()
                await client.post(url + "/wake_up")
                reason: str = answer["choices"][0]["finish_reason"]
                assert answer["usage"]["completion_tokens"] < 300 or reason == "length"
                return reason

        assert asyncio.run(sleep_during("abort")) == "abort"
        assert asyncio.run(sleep_during("wait")) == "length"
        assert httpx.get(url + "/is_sleeping").json() == {"is_sleeping": False}


def test_partial_wake_keeps_scheduling_paused_until_both_tags_are_back() -> None:
    with emulator(SLEEPY, env=DEV) as proc:
        url = proc.url
        httpx.post(url + "/sleep", params={"level": 2}, timeout=30)
        text = metrics(url)
        assert 'sleep_state="discard_all"} 1.0' in text
        r = httpx.post(url + "/wake_up", params={"tags": "weights"}, timeout=30)
        assert r.json() == {"status": "sleeping", "tags": ["weights"]}
        assert httpx.get(url + "/is_sleeping").json() == {"is_sleeping": True}
        r = httpx.post(url + "/wake_up", params={"tags": "kv_cache"}, timeout=30)
        assert r.json() == {"status": "awake", "tags": ["kv_cache"]}
        complete(url)


def test_sleep_endpoints_need_dev_mode_the_flag_and_a_valid_level() -> None:
    with emulator(SLEEPY) as proc:
        assert httpx.post(proc.url + "/sleep").status_code == 404
        assert httpx.get(proc.url + "/is_sleeping").status_code == 404
    with emulator(TINY_ARGS, env=DEV) as proc:
        r = httpx.post(proc.url + "/sleep")
        assert r.status_code == 500
        assert "--enable-sleep-mode" in r.json()["error"]["message"]
    with emulator(SLEEPY, env=DEV) as proc:
        r = httpx.post(proc.url + "/sleep", params={"level": 3})
        assert r.status_code == 422
        assert r.json()["detail"][0]["loc"] == ["query", "level"]
        r = httpx.post(proc.url + "/sleep", params={"mode": "later"})
        assert r.status_code == 422


def stats(url: str) -> dict[str, float]:
    data: dict[str, float] = httpx.get(url + "/emulator/stats", timeout=10).json()
    return data


def test_two_engines_on_one_shared_gpu_take_turns(tmp_path: Path) -> None:
    """Both engines saturated: their simulated GPU time together fits in the wall time (no
    step of one overlaps a step of the other), and each waited for the other's steps."""
    shared = [*at_speedup(TINY_ARGS, "1"), "--shared-gpu", str(tmp_path / "gpu0.lock")]
    with emulator(shared) as first, emulator(shared) as second:

        async def load() -> float:
            async with httpx.AsyncClient(timeout=60) as client:
                body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 150, "ignore_eos": True}
                start = time.monotonic()
                sends = [
                    client.post(proc.url + "/v1/completions", json=body)
                    for proc in (first, second)
                    for _ in range(4)
                ]
                for r in await asyncio.gather(*sends):
                    assert r.status_code == 200
                return time.monotonic() - start

        before = [stats(p.url) for p in (first, second)]
        wall = asyncio.run(load())
        after = [stats(p.url) for p in (first, second)]
    busy = sum(a["simulated_s"] - b["simulated_s"] for a, b in zip(after, before, strict=True))
    assert busy <= wall * 1.05, (busy, wall)
    for a, b in zip(after, before, strict=True):
        assert a["shared_gpu_wait_s"] - b["shared_gpu_wait_s"] > 0.1 * (
            a["simulated_s"] - b["simulated_s"]
        )
