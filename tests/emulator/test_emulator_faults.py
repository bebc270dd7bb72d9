"""Failure injection: start-up delay, error rate, crash after N requests, slow and stalled tokens."""

from __future__ import annotations

import socket
import time

import httpx
import pytest
from emu_harness import TINY_ARGS, emulator

pytestmark = pytest.mark.timeout(60)
BODY = {"model": "tiny", "prompt": "hello world", "max_tokens": 4}


def test_startup_delay_keeps_the_port_closed() -> None:
    started = time.monotonic()
    with emulator([*TINY_ARGS, "--startup-delay", "1.5"], ready=False) as proc:
        with pytest.raises(httpx.ConnectError):
            httpx.get(proc.url + "/health", timeout=0.5)
        proc.wait_ready()
        assert time.monotonic() - started >= 1.5


def test_error_rate_answers_500s_and_crash_after_requests_exits() -> None:
    args = [*TINY_ARGS, "--error-rate", "0.5", "--fault-seed", "7", "--crash-after-requests", "12"]
    with emulator(args) as proc:
        statuses = [
            httpx.post(proc.url + "/v1/completions", json=BODY).status_code for _ in range(12)
        ]
        assert set(statuses) == {200, 500}
        assert proc.proc.wait(5) == 1  # crashed after the 12th request


def test_slow_tokens_stretch_the_step() -> None:
    args = [
        *TINY_ARGS,
        "--speedup",
        "1",
        "--slow-token-probability",
        "1",
        "--slow-token-delay",
        "0.1",
    ]
    with emulator(args) as proc:
        started = time.monotonic()
        r = httpx.post(proc.url + "/v1/completions", json=BODY, timeout=10)
        assert r.status_code == 200
        assert time.monotonic() - started >= 0.4  # 4 steps of at least 0.1 s


def test_stalled_stream_stops_until_the_client_leaves() -> None:
    with emulator([*TINY_ARGS, "--stall-after-tokens", "3"]) as proc:
        body = b'{"model": "tiny", "prompt": "hello world", "max_tokens": 50, "stream": true}'
        with socket.create_connection(("127.0.0.1", proc.port)) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            sock.settimeout(1.0)
            received = b""
            stalled = False
            while not stalled:
                try:
                    data = sock.recv(65536)
                except TimeoutError:
                    stalled = True  # no byte for a second: the stream stalled
                    continue
                assert data, "stream ended"
                received += data
            assert received.count(b"data: {") == 3
            assert b"[DONE]" not in received
        deadline = time.monotonic() + 5
        while True:
            text = httpx.get(proc.url + "/metrics").text
            if 'finished_reason="abort",model_name="tiny"} 1.0' in text:
                break
            assert time.monotonic() < deadline
            time.sleep(0.05)
