"""The reliability suite (benchmarks/reliability.py), smaller: the same scenarios, real
processes on 127.0.0.1, bounded in count and time. The full run's figures are in
docs/reliability.md."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

import pytest
from tandem_process import ROOT


def _suite() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "reliability", ROOT / "benchmarks" / "reliability.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["reliability"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


reliability = _suite()


@pytest.mark.timeout(120)
async def test_slowloris_leaves_normal_traffic_alone() -> None:
    result = await reliability.slowloris(connections=100, header_timeout_s=2.0)
    print(*result.lines(), sep="\n")
    assert result.normal_failures == 0
    assert result.slow_cut >= 100  # every slow connection's first round was cut
    # p99 within 2x, with 50 ms of room for a shared CI machine's scheduling noise
    assert result.attack_p99_ms <= 2 * result.baseline_p99_ms + 50


@pytest.mark.timeout(120)
async def test_fuzzed_requests_make_no_router_5xx() -> None:
    result = await reliability.fuzz(count=600, concurrency=16)
    print(*result.lines(), sep="\n")
    assert result.router_alive
    assert result.router_5xx == 0, result.examples_5xx
    assert result.rss_after_mb <= 1.10 * result.rss_before_mb


@pytest.mark.timeout(120)
async def test_concurrent_pd_streams_all_complete() -> None:
    result = await reliability.streams(count=150, tokens=8)
    print(*result.lines(), sep="\n")
    assert result.completed == 150
    assert result.disaggregated == 150


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_chaos_soak_has_no_hung_requests() -> None:
    result = await reliability.chaos(seconds=40, rate=8, fault_every_s=(2.0, 4.0))
    print(*result.lines(), sep="\n")
    assert sum(result.faults.values()) >= 5
    assert result.hung == 0
    assert result.failed_elsewhere == 0, "\n".join(result.unexplained)
    assert result.clean_ok == result.clean
    assert result.worst_error_s <= result.limit_s + 2


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_prefill_4xx_and_kv_pull_failures_end_cleanly() -> None:
    result = await reliability.failure_paths()
    print(*result.lines(), sep="\n")
    assert result.prefill_4xx_status == 400
    assert "too long" in result.prefill_4xx_body
    assert not result.prefill_4xx_traceback
    # the request still completes: the decode engine recomputes the prompt itself (the engines'
    # recompute policy), or the router sends it again without the handoff
    assert result.kv_pull_status == 200
    assert result.kv_pull_retried <= 1
    assert result.kv_pull_terminal_s < 10
    assert result.foreign_handoff_status == 502
    assert result.handoff_rejected_metric == 1
