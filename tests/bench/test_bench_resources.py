"""Resource monitoring in `tandem bench`: DCGM gauges from a real emulator process's /metrics,
CPU and memory of that process, KV usage and preemptions, the first saturation; and the pure
summaries over known series."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from tandem_process import TandemProcess

from tandem.bench.main import main
from tandem.bench.records import BenchRecord, SampleRecord
from tandem.bench.resources import first_saturated, summarize_resources
from tandem.bench.sampler import flatten
from tandem.common.ports import free_port

pytestmark = pytest.mark.timeout(120)


def test_a_small_kv_pool_saturates_first_and_every_resource_is_reported(tmp_path: Path) -> None:
    port = free_port()
    args = ["emulate", "tiny-model", "--served-model-name", "tiny", "--host", "127.0.0.1",
            "--port", str(port), "--block-size", "16", "--speedup", "4",
            "--num-gpu-blocks-override", "40"]  # fmt: skip
    engine = TandemProcess("bench-resources-emulator", args, port)
    try:
        engine.wait_ready(timeout=60)
        bench = [engine.url, "--num-requests", "30", "--qps", "40", "--input", "256",
                 "--output", "64", "--warmup", "2", "--quiet", "--out", str(tmp_path),
                 "--sample-interval", "0.1", "--pid", f"emulator={engine.proc.pid}"]  # fmt: skip
        assert main(bench) == 0
    finally:
        engine.stop()
    record = BenchRecord.load(tmp_path / "A.json")
    found = {(r.name, r.source): r for r in record.resources}
    assert {
        ("GPU utilisation", "endpoint"),
        ("GPU memory", "endpoint"),
        ("KV cache", "endpoint"),
        ("preemptions", "endpoint"),
        ("CPU", "process:emulator"),
        ("resident memory", "process:emulator"),
    } <= set(found)
    memory = found[("GPU memory", "endpoint")]
    # baseline before the load: weights and memory outside PyTorch, no KV blocks in use
    assert memory.baseline == pytest.approx((16_094_069_248 + 825_229_312) / 2**20, rel=0.01)
    assert memory.peak > memory.baseline
    assert found[("GPU utilisation", "endpoint")].peak > 50
    # 30 requests of 320 tokens at 40 req/s into 40 blocks of 16 tokens: the KV pool fills
    assert found[("KV cache", "endpoint")].saturated_at_s is not None
    assert first_saturated(record.resources) is not None
    cpu = found[("CPU", "process:emulator")]
    assert cpu.baseline < 50  # idle before the load
    assert (tmp_path / "resources.png").stat().st_size > 10_000


def test_summaries_and_the_first_saturation_from_known_series() -> None:
    samples = [
        SampleRecord(
            t_s=t,
            source="gpu-host",
            values={
                "DCGM_FI_DEV_GPU_UTIL{gpu=0}": util,
                "DCGM_FI_DEV_FB_USED{gpu=0}": used,
                "DCGM_FI_DEV_FB_FREE{gpu=0}": 1000.0 - used,
                "vllm:kv_cache_usage_perc": kv,
            },
        )
        for t, util, used, kv in [
            (0.0, 0, 200, 0.0),
            (1.0, 60, 600, 0.5),
            (2.0, 95, 700, 0.97),
            (3.0, 99, 960, 0.99),
        ]
    ]
    resources = {r.name: r for r in summarize_resources(samples)}
    util = resources["GPU utilisation"]
    assert (util.baseline, util.peak, util.mean) == (0.0, 99.0, pytest.approx(63.5))
    assert util.saturated_at_s == 2.0
    assert resources["GPU memory"].capacity == 1000.0
    assert resources["GPU memory"].saturated_at_s == 3.0
    assert resources["KV cache"].saturated_at_s == 2.0
    first = first_saturated(list(resources.values()))
    assert first is not None
    assert first.saturated_at_s == 2.0


def test_dcgm_gauges_are_kept_per_gpu() -> None:
    page = (
        'DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-a",device="nvidia0"} 40\n'
        'DCGM_FI_DEV_GPU_UTIL{gpu="1",UUID="GPU-b",device="nvidia1"} 90\n'
        "# HELP something else\n"
        'vllm:num_requests_running{engine="0"} 3\n'
    )
    assert flatten(page) == {
        "DCGM_FI_DEV_GPU_UTIL{gpu=0}": 40.0,
        "DCGM_FI_DEV_GPU_UTIL{gpu=1}": 90.0,
        "vllm:num_requests_running": 3.0,
    }


def test_task_classes_send_their_acceptance_rate_to_a_speculating_engine(tmp_path: Path) -> None:
    port = free_port()
    spec = '{"method": "ngram", "num_speculative_tokens": 3}'
    args = ["emulate", "tiny-model", "--served-model-name", "tiny", "--host", "127.0.0.1",
            "--port", str(port), "--speedup", "20", "--speculative-config", spec,
            "--spec-acceptance-rate", "0"]  # fmt: skip
    engine = TandemProcess("bench-spec-emulator", args, port)
    try:
        engine.wait_ready(timeout=60)
        bench = [engine.url, "--num-requests", "6", "--qps", "20", "--input", "64",
                 "--output", "33", "--warmup", "0", "--quiet", "--no-plots", "--out", str(tmp_path),
                 "--task-acceptance", "default=1.0"]  # fmt: skip
        assert main(bench) == 0
        metrics = flatten(httpx.get(f"{engine.url}/metrics", timeout=10).text)
    finally:
        engine.stop()
    record = BenchRecord.load(tmp_path / "A.json")
    assert record.workload.task_acceptance == {"default": 1.0}
    # every draft accepted (the engine's own rate is 0): 32 tokens after the first in 8 steps
    # of 4, per request
    assert metrics["vllm:spec_decode_num_drafts_total"] == 6 * 8
    assert metrics["vllm:spec_decode_num_accepted_tokens_total"] == 6 * 8 * 3
