"""`tandem bench` against a real engine process: one `tandem emulate` on 127.0.0.1, sped up."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from tandem_process import TandemProcess

from tandem.bench.main import main
from tandem.bench.records import BenchRecord
from tandem.common.ports import free_port

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def emulator() -> Iterator[str]:
    port = free_port()
    args = ["emulate", "tiny-model", "--served-model-name", "tiny", "--host", "127.0.0.1",
            "--port", str(port), "--block-size", "16", "--speedup", "10"]  # fmt: skip
    process = TandemProcess("bench-emulator", args, port)
    try:
        process.wait_ready(timeout=60)
        yield process.url
    finally:
        process.stop()


def test_shared_prefix_run_reads_usage_and_engine_metrics(emulator: str, tmp_path: Path) -> None:
    args = [
        emulator,
        "--preset",
        "shared-prefix",
        "--num-requests",
        "24",
        "--qps",
        "20",
        "--groups",
        "2",
    ]
    args += [
        "--input",
        "256",
        "--output",
        "16",
        "--warmup",
        "4",
        "--quiet",
        "--out",
        str(tmp_path),
        "--api",
        "chat",
    ]
    assert main(args) == 0
    record = BenchRecord.load(tmp_path / "A.json")
    assert (record.model, record.summary.ok) == ("tiny", 24)
    assert all(r.output_tokens == 16 for r in record.requests)
    # Prompts are sized in words; the emulator's tokenizer counts about one token per word.
    assert all(200 <= (r.prompt_tokens or 0) <= 330 for r in record.requests)
    # Three quarters of every prompt is a prefix that the warm-up already cached.
    assert record.engine.prefix_hit_rate is not None
    assert record.engine.prefix_hit_rate > 0.5
    assert record.engine.queue_ms_per_request is not None
    assert record.engine.itl_ms_p50 is not None  # from the engine's own histogram buckets
    assert {"endpoint"} == {s.source for s in record.samples}
    assert any("vllm:kv_cache_usage_perc" in s.values for s in record.samples)


def test_completions_burst_reports_phases(emulator: str, tmp_path: Path) -> None:
    args = [
        emulator,
        "--preset",
        "burst",
        "--phases",
        "4x2,30x1,4x2",
        "--input",
        "64",
        "--output",
        "8",
    ]
    assert main([*args, "--warmup", "2", "--quiet", "--no-plots", "--out", str(tmp_path)]) == 0
    record = BenchRecord.load(tmp_path / "A.json")
    assert set(record.by_phase) == {"phase-0", "phase-1", "phase-2"}
    assert record.summary.failed == 0
