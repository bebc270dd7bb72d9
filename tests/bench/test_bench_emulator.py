"""`tandem bench` against a real engine process: one `tandem emulate` on 127.0.0.1, sped up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tandem.bench.main import main
from tandem.bench.records import BenchRecord
from tandem.local.cluster import free_port

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = (tmp_path_factory.mktemp("emulator") / "engine.log").open("wb")
    command = [sys.executable, "-m", "tandem.cli", "emulate", "tiny-model", "--served-model-name", "tiny",
               "--host", "127.0.0.1", "--port", str(port), "--block-size", "16", "--speedup", "10"]  # fmt: skip
    process = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, "the emulator exited while starting"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the emulator did not become healthy"
            time.sleep(0.2)
        yield url
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        log.close()


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
