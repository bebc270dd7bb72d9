"""Block prompts (equal ids give equal token blocks, exactly), and the trace report's pure functions."""

from __future__ import annotations

from typing import Any

import pytest
from tandem_process import MODEL_DIR

from tandem.bench.client import request_body
from tandem.bench.records import EngineTotals, RequestRecord
from tandem.bench.spec import SLO, Trace
from tandem.bench.trace_plan import TimedRequest
from tandem.bench.trace_prompts import (
    BlockPrompts,
    load_tokenizer,
    trace_schedule,
    vocabulary,
)
from tandem.bench.trace_report import slo_goodput, time_buckets, trace_report

TOKENIZER = MODEL_DIR / "tokenizer.json"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    assert TOKENIZER.is_file(), f"missing fixture: {TOKENIZER}"
    return load_tokenizer(str(MODEL_DIR))


def test_equal_ids_are_equal_blocks_and_text_encodes_to_the_ids(tokenizer: Any) -> None:
    prompts = BlockPrompts(vocabulary(tokenizer), block_tokens=16, seed=3)
    a = TimedRequest(0, 0.0, 40, 1, (0, 1, 2))
    b = TimedRequest(1, 0.0, 37, 1, (0, 1, 5))
    c = TimedRequest(2, 0.0, 20, 1, (7, 1))
    ids_a, ids_b, ids_c = (prompts.token_ids(r) for r in (a, b, c))
    assert (len(ids_a), len(ids_b), len(ids_c)) == (40, 37, 20)
    assert ids_a[:32] == ids_b[:32]
    assert ids_a[32:36] != ids_b[32:36]
    # block 1 after another first block is the same tokens: ids name blocks, not positions
    assert ids_c[16:] == ids_a[16:20]
    assert ids_c[:16] != ids_a[:16]
    for request, ids in ((a, ids_a), (b, ids_b), (c, ids_c)):
        assert tokenizer.encode(prompts.text(request), add_special_tokens=False).ids == ids
    prompts.check_text([a, b], [prompts.text(a), prompts.text(b)])
    with pytest.raises(ValueError, match="request 0"):
        prompts.check_text([a], [prompts.text(b)])
    assert BlockPrompts(vocabulary(tokenizer), 16, seed=4).token_ids(a) != ids_a


def test_without_a_tokenizer_prompts_are_text_of_equal_blocks() -> None:
    prompts = BlockPrompts(vocabulary(), block_tokens=8)
    a = prompts.text(TimedRequest(0, 0.0, 16, 1, (1, 2)))
    b = prompts.text(TimedRequest(1, 0.0, 12, 1, (1, 3)))
    assert len(a.split()) == 16
    assert a.split()[:8] == b.split()[:8]
    with pytest.raises(ValueError, match="tokenizer"):
        prompts.token_ids(TimedRequest(0, 0.0, 16, 1, (1, 2)))


def test_schedule_warms_up_on_blocks_of_no_trace_request(tokenizer: Any) -> None:
    timed = [TimedRequest(0, 0.0, 20, 3, (0, 1)), TimedRequest(1, 0.5, 10, 2, (0,))]
    spec = Trace(path="-", block_tokens=16, warmup_requests=1, prompt="ids", tokenizer="x")
    schedule = trace_schedule(timed, spec, BlockPrompts(vocabulary(tokenizer), 16))
    first, second = schedule.measured
    assert (first.at_s, first.max_tokens, first.prompt_words, first.phase) == (0.0, 3, 20, "trace")
    assert isinstance(first.prompt, list)
    assert first.prompt[:10] == second.prompt
    (warm,) = schedule.warmup
    assert isinstance(warm.prompt, list)
    assert len(warm.prompt) == 20
    assert warm.prompt[:16] != first.prompt[:16]
    assert request_body(first, "completions", "m", True)["prompt"] == first.prompt
    with pytest.raises(ValueError, match="text prompt"):
        request_body(first, "chat", "m", True)


def record(index: int, start_s: float, **fields: Any) -> RequestRecord:
    base: dict[str, Any] = {"klass": "trace", "phase": "trace", "ok": True, "status": 200}
    return RequestRecord(index=index, start_s=start_s, **(base | fields))


def test_time_buckets_split_offered_and_achieved_load() -> None:
    timed = [
        TimedRequest(0, 0.0, 100, 10, ()),
        TimedRequest(1, 0.5, 50, 10, ()),
        TimedRequest(2, 1.5, 200, 20, ()),
    ]
    requests = [
        record(0, 0.01, ttft_ms=100, tpot_ms=10, e2e_ms=300, prompt_tokens=101, output_tokens=10),
        record(1, 0.51, ttft_ms=300, tpot_ms=30, e2e_ms=1200, output_tokens=10),  # ends at 1.71
        record(2, 1.52, ok=False, status=500, error="boom"),
    ]
    first, second = time_buckets(timed, requests, bucket_s=1.0)
    assert (first.start_s, first.offered, first.completed, first.failed) == (0.0, 2, 1, 0)
    assert first.offered_rps == 2.0
    assert first.offered_tok_s == 170.0
    assert first.achieved_tok_s == 111.0  # the usage prompt tokens, not the planned ones
    assert (first.ttft_ms_p50, first.tpot_ms_p99) == (200.0, pytest.approx(29.8))
    assert (second.offered, second.completed, second.failed) == (1, 1, 1)
    assert second.achieved_tok_s == 60.0  # no usage: the planned 50 prompt tokens
    assert second.ttft_ms_p50 is None


def test_goodput_per_slo_and_the_prefix_bound_in_the_report() -> None:
    requests = [
        record(0, 0.0, ttft_ms=100, tpot_ms=10, e2e_ms=200),
        record(1, 0.0, ttft_ms=900, tpot_ms=10, e2e_ms=1000),
        record(2, 0.0, ttft_ms=100, tpot_ms=80, e2e_ms=500),
        record(3, 0.0, ok=False, status=503),
    ]
    slos = [SLO(ttft_ms=200, itl_ms=50), SLO(ttft_ms=1000, itl_ms=100)]
    strict, loose = slo_goodput(requests, slos, duration_s=2.0)
    assert (strict.ttft_ms, strict.tpot_ms, strict.attainment, strict.goodput_rps) == (
        200, 50, 0.25, 0.5
    )  # fmt: skip
    assert (loose.attainment, loose.goodput_rps) == (0.75, 1.5)
    timed = [TimedRequest(0, 0.0, 20, 1, (0, 1)), TimedRequest(1, 2.0, 20, 1, (0, 1))]
    spec = Trace(path="-", block_tokens=10, bucket_s=5)
    report = trace_report(spec, "tandem", timed, requests[:2], EngineTotals(prefix_hit_rate=0.4))
    assert (report.bound_block_hit_rate, report.bound_token_hit_rate) == (0.5, 0.5)
    assert report.engine_share_of_bound == pytest.approx(0.8)
    assert (report.requests, report.offered_span_s, report.offered_rps) == (2, 2.0, 1.0)
    assert len(report.buckets) == 1
