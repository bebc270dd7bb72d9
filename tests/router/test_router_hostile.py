"""The router's HTTP limits and trust rules against a hostile client, over real sockets.

The engine behind the router is a silent TCP listener (it accepts and never answers), so a
request stays in flight as long as a test needs; no behaviour of the router is mocked.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq
import zmq.asyncio
from router_harness import SHORT, Engine, Router, free_port, running

from tandem.router.index import PrefixIndex
from tandem.router.kv_events import EngineBlockMap, KvEventSubscriber
from tandem.router.metrics import RouterMetrics

pytestmark = pytest.mark.timeout(120)


@contextlib.contextmanager
def silent_engine() -> Iterator[str]:
    """An engine that passes health checks and never answers a completion."""
    done = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("content-length", "0")
            self.end_headers()

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length", 0)))
            done.wait(60)
            self.close_connection = True

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        done.set()
        server.shutdown()
        server.server_close()


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def exchange(port: int, data: bytes, wait_s: float = 5.0) -> tuple[bytes, float]:
    """Sends `data`, reads until the router closes; (what came back, seconds until closed)."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(wait_s)
        with contextlib.suppress(OSError):
            sock.sendall(data)
        chunks = []
        with contextlib.suppress(OSError):
            while chunk := sock.recv(65536):
                chunks.append(chunk)
    return b"".join(chunks), time.monotonic() - t0


@pytest.fixture(scope="module")
def guarded() -> Iterator[Router]:
    with silent_engine() as url:
        router = Router(
            ["--worker", url, "--header-timeout", "1", "--body-timeout", "1",
             "--idle-timeout", "2", "--max-connections", "40", "--decode-idle-seconds", "30"],
            trust_all=False,
        )  # fmt: skip
        with running(router):
            yield router


def test_slow_head_and_slow_body_get_408(guarded: Router) -> None:
    answer, took = exchange(guarded.port, b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert took < 4
    body_head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{"
    answer, took = exchange(guarded.port, body_head)
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert took < 4


def test_idle_keep_alive_connection_is_closed(guarded: Router) -> None:
    answer, took = exchange(guarded.port, b"GET /livez HTTP/1.1\r\nhost: x\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200")
    assert 1.5 < took < 5  # kept alive, then closed by the idle timeout


def test_header_limits_answer_431_fast(guarded: Router) -> None:
    many = b"".join(b"x-a: b\r\n" for _ in range(40_000))
    answer, took = exchange(
        guarded.port, b"GET /v1/models HTTP/1.1\r\nhost: x\r\n" + many + b"\r\n"
    )
    assert answer.startswith(b"HTTP/1.1 431"), answer[:80]
    assert took < 3
    big = b"x-big: " + b"a" * (4 << 20) + b"\r\n"
    answer, _ = exchange(guarded.port, b"GET /v1/models HTTP/1.1\r\nhost: x\r\n" + big + b"\r\n")
    assert answer.startswith(b"HTTP/1.1 431"), answer[:80]
    assert b'"code":431' in answer


def test_content_length_over_the_limit_is_413_before_the_body(guarded: Router) -> None:
    head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 999999999\r\n\r\n"
    answer, took = exchange(guarded.port, head)  # no body byte sent at all
    assert answer.startswith(b"HTTP/1.1 413"), answer
    assert took < 3


def test_connection_cap(guarded: Router) -> None:
    held = [socket.create_connection(("127.0.0.1", guarded.port)) for _ in range(40)]
    try:
        time.sleep(0.3)
        answer, _ = exchange(guarded.port, b"GET /livez HTTP/1.1\r\nhost: x\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 503"), answer
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.3)
    answer, _ = exchange(
        guarded.port, b"GET /livez HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
    )
    assert answer.startswith(b"HTTP/1.1 200")


def test_pipelined_bodies_wait_in_the_kernel(guarded: Router) -> None:
    """150 x 1 MiB requests pipelined behind one that is in flight: the router keeps reading
    only the first, so its memory stays flat (it grew by 160 MB before read pausing)."""
    before = rss_mb(guarded.proc.pid)
    body = json.dumps({"model": "tiny", "prompt": "a" * (1 << 20)}).encode()
    request = (
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%b" % (len(body), body)
    )
    sent = 0
    with socket.create_connection(("127.0.0.1", guarded.port)) as sock:
        sock.settimeout(2.0)
        with contextlib.suppress(TimeoutError):
            for _ in range(150):
                sock.sendall(request)
                sent += 1
        grown = rss_mb(guarded.proc.pid) - before
    assert sent < 150  # the kernel's buffers filled: the router stopped reading
    assert grown < 24, f"router grew {grown:.1f} MiB"


def test_livez_while_no_engine_is_ready() -> None:
    router = Router(["--worker", f"http://127.0.0.1:{free_port()}"])  # nothing listens there
    with running(router):
        assert httpx.get(router.url + "/livez").status_code == 200  # alive: keep the pod
        deadline = time.monotonic() + 10
        while httpx.get(router.url + "/health").status_code != 503:  # not ready: no traffic
            assert time.monotonic() < deadline
            time.sleep(0.2)


@contextlib.contextmanager
def behind_router(
    engines: list[Engine], args: list[str], trust_all: bool = True
) -> Iterator[Router]:
    """The engines, ready, then a router in front of them (so its first health check passes)."""
    with running(*engines):
        router = Router(args, trust_all=trust_all)
        with running(router):
            yield router


def test_untrusted_clients_get_no_engine_addresses_or_priority() -> None:
    worker = Engine(None)
    admin_port = free_port()
    args = ["--worker", worker.url, "--admin-port", str(admin_port), "--admin-key", "boss"]
    with behind_router([worker], args, trust_all=False) as router:
        body = {"model": "tiny", "prompt": SHORT, "max_tokens": 2}
        debug = {"x-tandem-debug": "1", "x-priority": "-100"}
        plain = httpx.post(router.url + "/v1/completions", json=body, headers=debug)
        assert plain.status_code == 200, plain.text
        assert not any(h.endswith("-engine") for h in plain.headers)
        assert "x-tandem-ttft-ms" in plain.headers  # timings carry no address
        boss = httpx.post(
            router.url + "/v1/completions",
            json=body,
            headers={**debug, "authorization": "Bearer boss"},
        )
        assert boss.headers["x-tandem-decode-engine"] == worker.url
        metrics = httpx.get(f"http://127.0.0.1:{admin_port}/metrics").text
        assert 'tandem_router_queue_seconds_count{priority="0"} 1.0' in metrics  # -100 ignored
        assert 'priority="-100"' in metrics  # the admin's was honoured
        assert httpx.get(router.url + "/metrics").status_code == 404  # only on the admin port
        assert httpx.get(router.url + "/engines").status_code == 404
        assert httpx.get(f"http://127.0.0.1:{admin_port}/engines").json()[0]["url"] == worker.url


def test_prefill_4xx_and_malformed_bodies_reach_the_client_as_400s() -> None:
    prefill, decode = Engine("prefill"), Engine("decode")
    args = ["--prefill", prefill.url, "--decode", decode.url, "--disaggregation", "always"]
    with behind_router([prefill, decode], args) as router:
        url = router.url + "/v1/completions"
        too_long = httpx.post(url, json={"model": "tiny", "prompt": "token " * 5000}, timeout=30)
        assert too_long.status_code == 400  # the prefill engine's answer, as it sent it
        assert "too long" in too_long.json()["error"]["message"]
        for body in (
            {"model": ["tiny"], "prompt": "x"},
            {"model": {"name": "tiny"}, "prompt": "x"},
            {"prompt": "x", "max_tokens": -1},
        ):
            response = httpx.post(url, json=body)
            assert response.status_code == 400, body
            assert response.json()["error"]["type"] == "BadRequestError"
        deep = b'{"prompt": "x", "a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        assert httpx.post(url, content=deep).status_code == 400
        assert "Traceback" not in router.output()


async def test_kv_event_subscriber_survives_anything_an_engine_sends() -> None:
    """A real ZMQ publisher and replay socket sending garbage, then a good batch."""
    context = zmq.asyncio.Context()
    pub = context.socket(zmq.PUB)
    pub_port = pub.bind_to_random_port("tcp://127.0.0.1")
    replay = context.socket(zmq.ROUTER)
    replay_port = replay.bind_to_random_port("tcp://127.0.0.1")
    index = PrefixIndex(1024)
    block_map = EngineBlockMap("e1", index, 16)
    metrics = RouterMetrics()
    subscriber = KvEventSubscriber(
        block_map, f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}", context, metrics,
        replay_timeout_s=0.3,
    )  # fmt: skip
    encode = msgspec.msgpack.encode

    async def answer_replays() -> None:
        while True:
            frames = await replay.recv_multipart()
            ident = frames[0]
            await replay.send_multipart([ident, b"", b"t", b"\x00" * 8, b"\xc1garbage"])
            await replay.send_multipart([ident, b"", b"t", b"\xff", b""])  # short seq
            await replay.send_multipart(
                [ident, b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
            )

    replies = asyncio.create_task(answer_replays())
    subscriber.start()
    try:
        await asyncio.sleep(0.5)
        stored = {"type": "BlockStored", "block_hashes": [11], "parent_block_hash": None,
                  "token_ids": list(range(16)), "block_size": 16}  # fmt: skip
        hostile: list[Any] = [
            b"\xc1",  # not msgpack
            encode([0.0, "not a list", 0]),
            encode(
                [
                    0.0,
                    [
                        {
                            "type": "BlockStored",
                            "block_hashes": [2**64 - 1],
                            "token_ids": [2**64 - 1] * 16,
                        }
                    ],
                    0,
                ]
            ),
            encode([0.0, [{"type": "BlockStored", "block_size": "x", "token_ids": "abc"}], 0]),
            encode([0.0, [{"type": "BlockRemoved", "block_hashes": 5}], 0]),
            encode([0.0, [[1, 2, 3], None, 7], 0]),
        ]
        for seq, payload in enumerate(hostile, start=1):
            await pub.send_multipart([b"t", seq.to_bytes(8, "big"), payload])
        await pub.send_multipart([b"t", b"\x01", b"short seq frame"])
        await pub.send_multipart(
            [b"t", (len(hostile) + 1).to_bytes(8, "big"), encode([0.0, [stored], 0])]
        )
        deadline = time.monotonic() + 5
        while index.size("e1") == 0:
            assert time.monotonic() < deadline, "the good batch never reached the index"
            await asyncio.sleep(0.05)
        assert subscriber._task is not None
        assert not subscriber._task.done()
        assert subscriber.bad_batches >= 3
        assert 'kind="batch"' in metrics.render().decode()
    finally:
        replies.cancel()
        await subscriber.stop()
        pub.close(0)
        replay.close(0)
        context.term()
