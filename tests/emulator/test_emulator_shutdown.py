"""SIGTERM as vLLM 0.32 handles it (docs/protocols.md §9; the real engine's side is
tests/realvllm/test_shutdown.py): `--shutdown-timeout 0` leaves what the engine holds
unanswered, `--shutdown-timeout N` finishes it, refuses new work and keeps a prefill's KV until
it is pulled."""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

import httpx
import pytest
from emu_harness import TINY_ARGS, Emulator, emulator, metric_value
from test_emulator_pd_nixl import do_decode, do_prefill, pd_engines

from tandem.emulator.shutdown import REFUSAL

pytestmark = pytest.mark.timeout(120)

LONG = 400
# Simulated time runs 20x faster (TINY_ARGS); this slows the steps down again so that a request
# of LONG tokens takes a few seconds.
SLOW = ["--speedup", "1"]


def _sigterm(engine: Emulator) -> float:
    engine.proc.send_signal(signal.SIGTERM)
    return time.monotonic()


def _running(engine: Emulator) -> float:
    text = httpx.get(f"{engine.url}/metrics", timeout=10).text
    return metric_value(text, "vllm:num_requests_running{")


def _body(stream: bool) -> dict[str, Any]:
    return {
        "model": "tiny",
        "prompt": "a request still running when the engine is told to stop",
        "max_tokens": LONG,
        "ignore_eos": True,
        "stream": stream,
    }


class Flight:
    """A streamed and a plain request in threads: their last finish_reason and token counts."""

    def __init__(self, engine: Emulator) -> None:
        self.results: dict[str, tuple[str | None, int]] = {}
        self.streaming = threading.Event()
        self.threads = [
            threading.Thread(target=self._stream, args=(engine.url,), daemon=True),
            threading.Thread(target=self._plain, args=(engine.url,), daemon=True),
        ]
        for thread in self.threads:
            thread.start()

    def _stream(self, url: str) -> None:
        finish, tokens = None, 0
        with httpx.stream("POST", f"{url}/v1/completions", json=_body(True), timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    choice = httpx.Response(200, content=line[6:]).json()["choices"][0]
                    tokens += 1
                    finish = choice.get("finish_reason") or finish
                    if tokens == 3:
                        self.streaming.set()
        self.results["stream"] = (finish, tokens)

    def _plain(self, url: str) -> None:
        answer = httpx.post(f"{url}/v1/completions", json=_body(False), timeout=60).json()
        self.results["plain"] = (
            answer["choices"][0]["finish_reason"],
            answer["usage"]["completion_tokens"],
        )

    def join(self) -> dict[str, tuple[str | None, int]]:
        for thread in self.threads:
            thread.join(60)
        return self.results


def test_default_shutdown_leaves_in_flight_requests_unanswered_until_the_client_leaves() -> None:
    """`--shutdown-timeout 0`: the engine stops where it is and the port closes; a stream gets
    nothing more and the process waits for its client (a kubelet's SIGKILL ends it sooner)."""
    with emulator([*TINY_ARGS, *SLOW]) as engine:
        with httpx.stream(
            "POST", f"{engine.url}/v1/completions", json=_body(True), timeout=2
        ) as answer:
            lines = answer.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            _sigterm(engine)
            with pytest.raises(httpx.ReadTimeout):
                for _ in lines:
                    pass
            assert engine.proc.poll() is None
            with pytest.raises(httpx.ConnectError):
                httpx.get(f"{engine.url}/health", timeout=2)
        assert engine.proc.wait(10) == 0  # the client left: the server could finish


def test_shutdown_timeout_finishes_in_flight_requests_and_refuses_new_ones() -> None:
    with emulator([*TINY_ARGS, *SLOW, "--shutdown-timeout", "30"]) as engine:
        flight = Flight(engine)
        assert flight.streaming.wait(30)
        # both requests in the engine before the signal (the plain one's thread may start late)
        deadline = time.monotonic() + 30
        while _running(engine) < 2:
            assert time.monotonic() < deadline, "the plain request never reached the engine"
            time.sleep(0.05)
        sent = _sigterm(engine)
        time.sleep(0.3)
        refused = httpx.post(f"{engine.url}/v1/completions", json=_body(False), timeout=10)
        health = httpx.get(f"{engine.url}/health", timeout=10).status_code
        results = flight.join()
        assert engine.proc.wait(30) == 0
        exited = time.monotonic() - sent
    assert results["stream"][0] == "length"
    assert results["plain"] == ("length", LONG)
    assert refused.status_code == 500, refused.text
    assert refused.json()["error"]["message"] == REFUSAL
    assert health == 200
    assert exited < 30


def test_a_draining_prefill_engine_keeps_its_kv_until_the_decode_engine_pulls_it() -> None:
    with pd_engines(["--shutdown-timeout", "30"]) as (prefill, decode):
        do_prefill(prefill, "warm up the NIXL handshake " * 8)
        params = do_prefill(prefill)["kv_transfer_params"]
        sent = _sigterm(prefill)
        time.sleep(1.0)
        assert prefill.proc.poll() is None  # still holding the lease
        answer = do_decode(decode, params, stream=False)
        assert answer.status_code == 200, answer.text
        assert prefill.proc.wait(10) == 0
        assert time.monotonic() - sent < 10  # well before the 30 s timeout: the pull ended it
        pulls = httpx.get(f"{decode.url}/metrics").text
    assert "vllm:nixl_num_failed_transfers_total" not in pulls or (
        'vllm:nixl_num_failed_transfers_total{engine="0",model_name="tiny"} 0.0' in pulls
    )
