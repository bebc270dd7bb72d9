"""`tandem bench --trace` against a real engine process: a short window of each format replayed
on one `tandem emulate` of the tiny model (its own tokenizer) on 127.0.0.1, sped up."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tandem_process import MODEL_DIR, TandemProcess

from tandem.bench.main import main
from tandem.bench.records import BenchRecord
from tandem.bench.spec import Trace
from tandem.bench.trace_plan import prefix_bound, trace_requests
from tandem.common.ports import free_port

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def engine() -> Iterator[str]:
    assert (MODEL_DIR / "tokenizer.json").is_file(), f"missing fixture: {MODEL_DIR}/tokenizer.json"
    port = free_port()
    args = ["emulate", "--model", str(MODEL_DIR), "--served-model-name", "tiny",
            "--max-model-len", "4096", "--block-size", "16", "--enable-prefix-caching",
            "--load-format", "dummy", "--speedup", "20", "--host", "127.0.0.1",
            "--port", str(port)]  # fmt: skip
    process = TandemProcess("bench-trace-emulator", args, port)
    try:
        process.wait_ready(timeout=60)
        yield process.url
    finally:
        process.stop()


def replay(engine: str, trace: Path, out: Path, *options: str) -> BenchRecord:
    args = [engine, "--trace", str(trace), "--quiet", "--no-plots", "--out", str(out), *options]
    assert main(args) == 0
    return BenchRecord.load(out / "A.json")


def test_mooncake_window_with_token_id_blocks(engine: str, tmp_path: Path) -> None:
    """Conversations that grow: each turn repeats the previous turn's blocks, then adds one."""
    lines = []
    for turn in range(12):
        session = turn % 3
        blocks = [0, *[100 * session + k for k in range(1, turn // 3 + 2)]]
        length = 512 * len(blocks) - 100
        lines.append(
            {
                "timestamp": 200 * turn,
                "input_length": length,
                "output_length": 40,
                "hash_ids": blocks,
            }
        )
    lines.append({"timestamp": 9000, "input_length": 600, "output_length": 4, "hash_ids": [0, 7]})
    trace = tmp_path / "conversation.jsonl"
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    record = replay(
        engine, trace, tmp_path, "--tokenizer", str(MODEL_DIR), "--trace-block-tokens", "64",
        "--trace-speedup", "4", "--trace-max-requests", "12", "--trace-max-output", "8",
        "--trace-bucket", "0.25", "--slo-ttft-ms", "2000", "--slo-ttft-ms", "0.01",
        "--slo-tpot-ms", "100", "--warmup", "2",
    )  # fmt: skip
    spec = record.workload
    assert isinstance(spec, Trace)
    assert (spec.format, spec.prompt, spec.block_tokens) == ("mooncake", "ids", 64)
    timed = trace_requests(spec)
    assert record.summary.ok == len(timed) == 12
    # token-id prompts: the engine saw exactly the planned prompt lengths
    by_index = {r.index: r for r in record.requests}
    assert [by_index[t.index].prompt_tokens for t in timed] == [t.input_tokens for t in timed]
    assert all(r.output_tokens == 8 for r in record.requests)
    report = record.trace
    assert report is not None
    assert (report.format, report.requests, report.block_tokens) == ("mooncake", 12, 64)
    assert report.offered_span_s == pytest.approx(11 * 0.2 / 4)
    bound = prefix_bound(timed, 64)
    assert report.bound_token_hit_rate == pytest.approx(bound.token_fraction)
    assert report.bound_block_hit_rate == pytest.approx(bound.block_fraction)
    assert bound.token_fraction is not None
    assert bound.token_fraction > 0.4
    # the engine caches whole 16-token blocks and has room for everything: close to the bound
    assert report.engine_hit_rate is not None
    assert 0.6 * bound.token_fraction < report.engine_hit_rate <= bound.token_fraction
    assert report.engine_share_of_bound == pytest.approx(
        report.engine_hit_rate / bound.token_fraction
    )
    assert sum(b.offered for b in report.buckets) == 12
    assert sum(b.completed for b in report.buckets) == 12
    assert report.buckets[0].offered_rps == pytest.approx(report.buckets[0].offered / 0.25)
    assert any(b.ttft_ms_p50 is not None for b in report.buckets)
    loose, strict = record.slo_goodput
    assert (loose.ttft_ms, loose.tpot_ms, loose.attainment) == (2000, 100, 1.0)
    assert (strict.ttft_ms, strict.tpot_ms, strict.attainment) == (0.01, 100, 0.0)
    assert record.slo.ttft_ms == 2000


def test_azure_window_with_text_prompts_that_tokenize_exactly(engine: str, tmp_path: Path) -> None:
    rows = [f"2023-11-16 18:15:{46 + i // 4}.{1000000 * (i % 4):07d},{300 + 97 * i},{3 + i}"
            for i in range(10)]  # fmt: skip
    trace = tmp_path / "azure.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows))
    record = replay(
        engine, trace, tmp_path, "--tokenizer", str(MODEL_DIR), "--trace-prompt", "text",
        "--trace-speedup", "8", "--trace-start", "0.15", "--trace-max-input", "700",
    )  # fmt: skip
    spec = record.workload
    assert isinstance(spec, Trace)
    assert (spec.format, spec.prompt) == ("azure", "text")
    timed = trace_requests(spec)
    assert len(timed) == 8  # the first two rows are before the window
    assert max(t.input_tokens for t in timed) == 700
    by_index = {r.index: r for r in record.requests}
    assert [by_index[t.index].prompt_tokens for t in timed] == [t.input_tokens for t in timed]
    assert [by_index[t.index].output_tokens for t in timed] == [5 + i for i in range(8)]
    assert record.trace is not None
    assert record.trace.bound_block_hit_rate == 0.0  # no prefix information in this format
    assert record.summary.failed == 0


def max_tokens_asked(engine: str) -> tuple[float, float]:
    """(requests, sum of their max_tokens) from the engine's vllm:request_params_max_tokens."""
    families = text_string_to_metric_families(httpx.get(engine + "/metrics").text)
    samples = {
        s.name: s.value
        for family in families
        if family.name == "vllm:request_params_max_tokens"
        for s in family.samples
    }
    return (
        samples["vllm:request_params_max_tokens_count"],
        samples["vllm:request_params_max_tokens_sum"],
    )


def test_length_cap_hides_each_length_and_the_engine_still_ends_there(
    engine: str, tmp_path: Path
) -> None:
    """`--length-cap`: every request asks for max_tokens 64 and ends at the trace's length."""
    rows = [f"2023-11-16 18:15:46.{100000 * i:06d},{200 + 50 * i},{1 + 7 * i}" for i in range(6)]
    trace = tmp_path / "azure.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows))
    count_before, sum_before = max_tokens_asked(engine)
    record = replay(
        engine, trace, tmp_path, "--tokenizer", str(MODEL_DIR), "--trace-speedup", "4",
        "--length-cap", "64", "--warmup", "0",
    )  # fmt: skip
    count_after, sum_after = max_tokens_asked(engine)
    assert (count_after - count_before, sum_after - sum_before) == (6, 6 * 64)
    assert sorted(r.output_tokens for r in record.requests) == [1 + 7 * i for i in range(6)]
    assert record.summary.failed == 0


def test_burstgpt_window_over_chat_without_a_tokenizer(engine: str, tmp_path: Path) -> None:
    rows = [f"{0.1 * i:.1f},ChatGPT,{60 + 10 * i},{0 if i == 3 else 6},0,Conversation log"
            for i in range(9)]  # fmt: skip
    trace = tmp_path / "burst.csv"
    trace.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                     + "\n".join(rows) + "\n")  # fmt: skip
    record = replay(engine, trace, tmp_path, "--api", "chat", "--trace-duration", "0.75")
    spec = record.workload
    assert isinstance(spec, Trace)
    assert (spec.format, spec.prompt, record.api) == ("burstgpt", "text", "chat")
    assert record.summary.ok == 7  # rows at 0.0-0.7 s, less the failed one
    assert all(r.output_tokens == 6 for r in record.requests)
    assert record.trace is not None
    assert record.trace.engine_hit_rate is not None


def test_own_format_looped_twice(engine: str, tmp_path: Path) -> None:
    trace = tmp_path / "own.jsonl"
    trace.write_text(
        '{"at_s": 0.0, "input_tokens": 1024, "output_tokens": 4, "hash_ids": [1, 2]}\n'
        '{"at_s": 0.1, "input_tokens": 1536, "output_tokens": 4, "hash_ids": [1, 2, 3]}\n'
        '{"at_s": 0.2, "input_tokens": 200, "output_tokens": 4}\n'
    )
    record = replay(
        engine, trace, tmp_path, "--tokenizer", str(MODEL_DIR), "--trace-loops", "2",
        "--trace-block-tokens", "32", "--trace-format", "tandem",
    )  # fmt: skip
    assert record.summary.ok == 6
    assert set(record.by_phase) == {"loop-0", "loop-1"}
    assert record.trace is not None
    # per loop: 2 + 3 + 1 blocks, of which the second request's first two hit
    assert record.trace.bound_block_hit_rate == pytest.approx(4 / 12)
