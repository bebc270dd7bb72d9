"""`tandem router --processes N`: workers on one port under a supervisor, over real sockets.

The merge of the workers' expositions, the admission split and the restart backoff are checked as
pure functions; the rest runs real processes: an emulator engine and a two-process router.
"""

from __future__ import annotations

import json
import signal
import socket
import threading

import httpx
import psutil
import pytest
from pydantic import ValidationError
from router_harness import Engine, Router, metric, metrics, running, wait_until

from tandem.common.ports import free_port
from tandem.router.config import RouterConfig
from tandem.router.main import build_parser, config_from_args
from tandem.router.metrics_merge import merge_families, render_families
from tandem.router.processes import (
    RESTART_BASE_S,
    RESTART_CAP_S,
    merge_engine_views,
    restart_delay,
    split_limit,
    worker_config,
)

WORKER_A = """\
# HELP tandem_router_requests_total Requests answered.
# TYPE tandem_router_requests_total counter
tandem_router_requests_total{route="local",status="200"} 3.0
# HELP tandem_router_queue_seconds Time waiting.
# TYPE tandem_router_queue_seconds histogram
tandem_router_queue_seconds_bucket{priority="0",le="0.5"} 2.0
tandem_router_queue_seconds_bucket{priority="0",le="+Inf"} 3.0
tandem_router_queue_seconds_count{priority="0"} 3.0
tandem_router_queue_seconds_sum{priority="0"} 0.75
"""
WORKER_B = """\
# HELP tandem_router_requests_total Requests answered.
# TYPE tandem_router_requests_total counter
tandem_router_requests_total{route="local",status="200"} 5.0
tandem_router_requests_total{route="local",status="429"} 1.0
# HELP tandem_router_engine_healthy Engine healthy.
# TYPE tandem_router_engine_healthy gauge
tandem_router_engine_healthy{pool="decode",endpoint="e"} 1.0
"""


def test_merge_labels_every_sample_and_states_each_family_once() -> None:
    text = render_families(merge_families([("0", WORKER_A), ("1", WORKER_B)])).decode()
    assert text.count("# TYPE tandem_router_requests_total counter") == 1
    assert text.count("# HELP tandem_router_requests_total ") == 1
    assert text.count("# TYPE tandem_router_queue_seconds histogram") == 1
    assert 'tandem_router_requests_total{process="0",route="local",status="200"} 3.0' in text
    assert 'tandem_router_requests_total{process="1",route="local",status="200"} 5.0' in text
    assert 'tandem_router_requests_total{process="1",route="local",status="429"} 1.0' in text
    assert 'tandem_router_queue_seconds_bucket{le="+Inf",priority="0",process="0"} 3.0' in text
    assert 'tandem_router_engine_healthy{endpoint="e",pool="decode",process="1"} 1.0' in text
    # Summed over processes, the totals are what one router would have counted.
    assert metric(text, "tandem_router_requests_total", status="200") == 8.0
    samples = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert all('process="' in line for line in samples)
    assert len(samples) == 8


def test_engine_views_merge_per_engine_over_processes() -> None:
    def view(url: str, healthy: bool, in_flight: int, blocks: int, seq: int | None) -> dict:
        return {"url": url, "roles": ["worker"], "healthy": healthy, "in_flight": in_flight,
                "waiting": 3, "indexed_blocks": blocks, "history_blocks": 0,
                "kv_events_last_seq": seq, "kv_events_replays": 1, "kv_events_resubscribes": 0}  # fmt: skip

    merged = merge_engine_views(
        [
            ("0", [view("http://a", True, 2, 10, 7), view("http://b", True, 1, 4, None)]),
            ("1", [view("http://a", False, 3, 12, 9)]),
        ]
    )
    a, b = merged
    assert (a["url"], a["healthy"], a["in_flight"], a["indexed_blocks"]) == (
        "http://a",
        False,
        5,
        12,
    )
    assert (a["kv_events_last_seq"], a["kv_events_replays"], a["waiting"]) == (9, 2, 3)
    assert a["processes"]["1"] == {
        "healthy": False, "in_flight": 3, "indexed_blocks": 12, "history_blocks": 0,
        "kv_events_last_seq": 9, "removal_cost": None,
    }  # fmt: skip
    assert (b["healthy"], b["in_flight"], b["kv_events_last_seq"]) == (True, 1, None)
    assert list(b["processes"]) == ["0"]


def test_admission_limits_are_split_with_ceiling_division() -> None:
    assert [split_limit(1024, n) for n in (1, 2, 3, 4, 64)] == [1024, 512, 342, 256, 16]
    assert split_limit(1, 4) == 1
    config = RouterConfig.model_validate(
        {
            "servedModelName": "tiny",
            "processes": 3,
            "static": {"workers": [{"url": "http://127.0.0.1:1"}]},
            "trust": {"adminPort": 9901, "adminKeys": ["k"]},
            "admission": {"maxInFlight": 100, "maxQueue": 10, "maxQueuePerPriority": 5},
            "tenancy": {
                "defaultRate": {"tokensPerSecond": 300},
                "tenants": [{"name": "a", "rate": {"tokensPerSecond": 30, "burstTokens": 90}}],
            },
        }
    )
    worker = worker_config(config, 8123)
    assert (worker.processes, worker.port, worker.trust.admin_port) == (1, 8123, 0)
    assert worker.trust.admin_keys == ["k"]
    admission = worker.admission
    assert (admission.max_in_flight, admission.max_queue, admission.max_queue_per_priority) == (
        34,
        4,
        2,
    )
    # Token rates too: the kernel spreads connections evenly over the processes.
    rate = worker.tenancy.default_rate
    assert rate is not None
    assert (rate.tokens_per_second, rate.capacity) == (100, 1000)
    own = worker.tenancy.tenants[0].rate
    assert own is not None
    assert (own.tokens_per_second, own.capacity) == (10, 30)
    # What the supervisor writes is what a worker reads back.
    assert RouterConfig.model_validate(json.loads(worker.model_dump_json(by_alias=True))) == worker


def test_processes_flag() -> None:
    args = ["--model", "tiny", "--worker", "http://127.0.0.1:1", "--admin-port", "9901"]
    assert config_from_args(build_parser().parse_args(args)).processes == 1
    parsed = build_parser().parse_args([*args, "--processes", "4"])
    assert config_from_args(parsed).processes == 4


def test_several_processes_need_an_admin_port() -> None:
    with pytest.raises(ValidationError, match="adminPort"):
        RouterConfig.model_validate(
            {
                "servedModelName": "tiny",
                "processes": 2,
                "static": {"workers": [{"url": "http://127.0.0.1:1"}]},
            }
        )


def test_restart_backoff_doubles_and_is_capped() -> None:
    assert restart_delay([], 100.0) == 0.0
    assert restart_delay([99.0], 100.0) == RESTART_BASE_S
    assert restart_delay([97.0, 98.0, 99.0], 100.0) == 4 * RESTART_BASE_S
    assert restart_delay([float(t) for t in range(50, 100)], 100.0) == RESTART_CAP_S
    assert restart_delay([-1000.0, 99.0], 100.0) == RESTART_BASE_S  # old exits forgotten


def _healthy_processes(admin_url: str) -> int:
    """Processes that see the engine healthy (each checks it on its own)."""
    text = metrics(admin_url)
    return sum(metric(text, "tandem_router_engine_healthy", process=str(i)) > 0 for i in range(2))


def _workers(supervisor: int) -> list[int]:
    return sorted(p.pid for p in psutil.Process(supervisor).children())


def _stream(router: Router, started: threading.Barrier, outcomes: list[str]) -> None:
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 400, "stream": True}
    try:
        with (
            httpx.Client(timeout=30) as client,
            client.stream("POST", router.url + "/v1/completions", json=body) as response,
        ):
            chunks = response.iter_raw()
            next(chunks)
            started.wait(20)
            for _ in chunks:
                pass
        outcomes.append("completed")
    except (httpx.HTTPError, threading.BrokenBarrierError):
        outcomes.append("broken")


def test_two_processes_serve_restart_and_stop_together() -> None:
    engine = Engine(None, speedup=2.0)
    admin = free_port()
    router = Router(["--worker", engine.url, "--processes", "2", "--admin-port", str(admin)])
    admin_url = f"http://127.0.0.1:{admin}"
    with running(engine, router):
        wait_until(lambda: _healthy_processes(admin_url) == 2)
        first = _workers(router.proc.pid)
        assert len(first) == 2
        # Fresh connections are spread over both processes; each counts its own requests.
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
        for _ in range(40):
            response = httpx.post(router.url + "/v1/completions", json=body, timeout=30)
            assert response.status_code == 200
        text = metrics(admin_url)
        served = [metric(text, "tandem_router_requests_total", process=str(i)) for i in (0, 1)]
        assert sum(served) == 40
        assert min(served) > 0, served
        assert httpx.get(admin_url + "/health").status_code == 200
        [seen] = httpx.get(admin_url + "/engines").json()
        assert (seen["url"], seen["healthy"], sorted(seen["processes"])) == (
            engine.url,
            True,
            ["0", "1"],
        )

        # Streams open on the killed process break; those on the other one complete.
        streams = 12
        started = threading.Barrier(streams + 1)
        outcomes: list[str] = []
        threads = [
            threading.Thread(target=_stream, args=(router, started, outcomes))
            for _ in range(streams)
        ]
        for thread in threads:
            thread.start()
        started.wait(20)
        victim = first[0]
        psutil.Process(victim).send_signal(signal.SIGKILL)
        for thread in threads:
            thread.join(30)
        assert outcomes.count("broken") > 0, outcomes
        assert outcomes.count("completed") > 0, outcomes
        for _ in range(10):
            response = httpx.post(router.url + "/v1/completions", json=body, timeout=30)
            assert response.status_code == 200

        wait_until(lambda: _healthy_processes(admin_url) == 2)
        text = metrics(admin_url)
        assert metric(text, "tandem_router_processes_alive") == 2
        assert metric(text, "tandem_router_process_restarts_total") == 1
        second = _workers(router.proc.pid)
        assert len(second) == 2
        assert victim not in second

        router.proc.send_signal(signal.SIGTERM)
        assert router.proc.wait(20) == 0
        assert not any(psutil.pid_exists(pid) for pid in second)
        with socket.socket() as sock:  # a new router may listen there
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", router.port))
            sock.listen()


def test_a_port_held_by_another_process_is_refused() -> None:
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        worker = ["--worker", "http://127.0.0.1:1"]
        # The last --port wins over the harness's own.
        router = Router([*worker, "--processes", "2", "--admin-port", "0", "--port", str(port)])
        try:
            assert router.proc.wait(20) == 1
            assert f"127.0.0.1:{port} is already in use by another process" in router.output()
        finally:
            router.stop()


def test_killing_the_supervisor_takes_the_workers_down() -> None:
    router = Router(
        ["--worker", "http://127.0.0.1:1", "--processes", "2", "--admin-port", str(free_port())]
    )
    with running(router):
        workers = _workers(router.proc.pid)
        assert len(workers) == 2
        router.proc.kill()
        wait_until(lambda: not any(psutil.pid_exists(pid) for pid in workers))
