"""Processes for router tests: emulator engines and `tandem router`, on free 127.0.0.1 ports."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator

import httpx
from tandem_process import MODEL_DIR, TandemProcess

from tandem.common.ports import free_port


class Proc(TandemProcess):
    """A router-test process: ready once its health path answers below 500."""

    def wait_ready(
        self,
        path: str = "/health",
        timeout: float = 40.0,
        ready: Callable[[int], bool] = lambda status: status < 500,
    ) -> None:
        super().wait_ready(path, timeout, ready)


ENGINE_ARGS = [
    "--model",
    str(MODEL_DIR),
    "--load-format",
    "dummy",
    "--served-model-name",
    "tiny",
    "--max-model-len",
    "4096",
    "--block-size",
    "16",
    "--enable-prefix-caching",
    "--prefix-caching-hash-algo",
    "sha256_cbor",
]


def kv_transfer_config(role: str, kv_lease_s: int = 5) -> str:
    return json.dumps(
        {
            "kv_connector": "NixlConnector",
            "kv_role": role,
            "kv_buffer_device": "cpu",
            "kv_connector_extra_config": {"kv_lease_duration": kv_lease_s},
        }
    )


# Engine URL -> its NIXL side-channel port: routers started here are told each one's, as the
# operator's discovery config tells a real router.
SIDE_CHANNELS: dict[str, int] = {}
# Test clients are trusted (priority honoured) and ask for the engines' addresses.
DEBUG = {"x-tandem-debug": "1"}


class Engine(Proc):
    def __init__(
        self,
        role: str | None,
        speedup: float = 20.0,
        extra: list[str] | None = None,
        kv_events: bool = False,
        extra_env: dict[str, str] | None = None,
        port: int | None = None,
        kv_lease_s: int = 5,
    ):
        port = port or free_port()
        args = [
            "emulate",
            *ENGINE_ARGS,
            "--speedup",
            str(speedup),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "warning",
            *(extra or []),
        ]
        env = {"PYTHONHASHSEED": "0", **(extra_env or {})}
        if role is not None:
            args += [
                "--kv-transfer-config",
                kv_transfer_config(
                    "kv_producer" if role == "prefill" else "kv_consumer", kv_lease_s
                ),
            ]
            side_channel = free_port()
            SIDE_CHANNELS[f"http://127.0.0.1:{port}"] = side_channel
            env |= {
                "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel),
            }
        self.events = self.replay = None
        if kv_events:
            pub, replay = free_port(), free_port()
            self.events, self.replay = f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}"
            args += [
                "--kv-events-config",
                json.dumps(
                    {
                        "enable_kv_cache_events": True,
                        "publisher": "zmq",
                        "endpoint": f"tcp://*:{pub}",
                        "replay_endpoint": f"tcp://*:{replay}",
                        "topic": "kv-events",
                    }
                ),
            ]
        super().__init__(f"engine-{role}", args, port, env)


class Router(Proc):
    def __init__(self, args: list[str], trust_all: bool = True):
        port = free_port()
        side_channels = [
            f"--side-channel={url}={SIDE_CHANNELS[url]}" for url in args if url in SIDE_CHANNELS
        ]
        super().__init__(
            "router",
            [
                "router",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--model",
                "tiny",
                "--log-level",
                "warning",
                *(["--trust-all-clients"] if trust_all else []),
                *side_channels,
                *args,
            ],
            port,
        )

    def wait_ready(self, path: str = "/v1/models", timeout: float = 20.0) -> None:
        super().wait_ready(path, timeout)


@contextlib.contextmanager
def running(*procs: Proc) -> Iterator[None]:
    """The processes ready for the body, stopped after it; when the body fails, each one's last
    log lines are printed (pytest shows them with the failure)."""
    try:
        for proc in procs:
            proc.wait_ready()
        yield
    except BaseException:
        for proc in procs:
            print(f"--- {proc.name} ({proc.url}), last output:\n{proc.output()}")
        raise
    finally:
        for proc in procs:
            proc.stop()


def wait_all_healthy(front: Proc, timeout: float = 20.0) -> None:
    """Until the router's (or gateway's) monitor has seen every engine answer: one started beside
    its engines may first find them refusing connections, and a request before they answer is
    prefilled locally or refused."""
    wait_until(
        lambda: all(e["healthy"] for e in httpx.get(f"{front.url}/engines", timeout=5).json()),
        timeout,
    )


def wait_until(ready: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll `ready` every 0.1 s until it holds; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.1)


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        series = head[len(name) :]
        if series and not series.startswith("{"):
            continue
        if all(f'{k}="{v}"' in series for k, v in labels.items()):
            total += float(value)
    return total


LONG = "the quick brown fox jumps over the lazy dog while the router relays the cache. " * 12
SHORT = "hello there"


def metrics(url: str) -> str:
    return httpx.get(url + "/metrics", timeout=5).text


def completion(router: Router, prompt: str, **extra: object) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, **extra}
    return httpx.post(router.url + "/v1/completions", json=body, headers=DEBUG, timeout=60)
