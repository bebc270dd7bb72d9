"""Trace parsing, detection, planning (window, speed, loops, scaling, caps) and the prefix bound."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.bench.spec import Trace
from tandem.bench.trace_plan import TimedRequest, plan_trace, prefix_bound, trace_requests
from tandem.bench.traces import (
    TraceFormatError,
    TraceRow,
    detect_format,
    file_format,
    parse_azure,
    parse_burstgpt,
    parse_mooncake,
    parse_tandem,
    read_trace,
    wall_clock_s,
)

MOONCAKE = """\
{"timestamp": 3000, "input_length": 1100, "output_length": 20, "hash_ids": [0, 1, 2]}
{"timestamp": 1000, "input_length": 700, "output_length": 0, "hash_ids": [0, 3]}

{"timestamp": 6000, "input_length": 1024, "output_length": 5, "hash_ids": [0, 1]}
"""
AZURE = """\
TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,4808,10
2023-11-16 18:15:50.9951690,3180,8
2023-11-16 18:15:46.1805900,110,27"""  # unsorted, no trailing newline, 7 fractional digits
BURSTGPT = """\
Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type
5,ChatGPT,472,18,490,Conversation log
45,ChatGPT,1087,0,1087,Conversation log
110.5,GPT-4,417,505,922,API log
"""
TANDEM = """\
{"at_s": 0.5, "input_tokens": 600, "output_tokens": 4, "hash_ids": [7, 8]}
{"at_s": 0.0, "input_tokens": 30, "output_tokens": 2}
"""


def rows(*specs: tuple[float, int, int, tuple[int, ...]]) -> list[TraceRow]:
    return [TraceRow(at_s=t, input_tokens=i, output_tokens=o, hash_ids=h) for t, i, o, h in specs]


def test_mooncake_rows_are_sorted_rebased_in_seconds_with_outputs_of_at_least_one() -> None:
    assert parse_mooncake(MOONCAKE.splitlines()) == rows(
        (0.0, 700, 1, (0, 3)), (2.0, 1100, 20, (0, 1, 2)), (5.0, 1024, 5, (0, 1))
    )


def test_azure_timestamps_keep_all_seven_fractional_digits() -> None:
    parsed = parse_azure(AZURE.splitlines())
    assert [(r.input_tokens, r.output_tokens) for r in parsed] == [(110, 27), (4808, 10), (3180, 8)]
    assert [round(r.at_s, 7) for r in parsed] == [0.0, 0.5, 4.8145790]
    assert all(r.hash_ids == () for r in parsed)
    assert wall_clock_s("2023-11-16 18:15:46.6805900") - wall_clock_s("2023-11-16 18:15:46") == (
        pytest.approx(0.68059)
    )


def test_burstgpt_leaves_out_failed_rows() -> None:
    assert parse_burstgpt(BURSTGPT.splitlines()) == rows((0.0, 472, 18, ()), (105.5, 417, 505, ()))


def test_tandem_format() -> None:
    assert parse_tandem(TANDEM.splitlines()) == rows((0.0, 30, 2, ()), (0.5, 600, 4, (7, 8)))


@pytest.mark.parametrize(
    ("text", "expected"),
    [(MOONCAKE, "mooncake"), (AZURE, "azure"), (BURSTGPT, "burstgpt"), (TANDEM, "tandem")],
)
def test_each_format_is_detected_from_its_first_line(
    tmp_path: Path, text: str, expected: str
) -> None:
    assert detect_format(text.splitlines()[0]) == expected
    path = tmp_path / "trace.txt"
    path.write_text("\n" + text)
    assert file_format(path) == expected
    assert read_trace(path) == read_trace(path, detect_format(text.splitlines()[0]))


def test_unknown_or_broken_files_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match="unknown trace header"):
        detect_format("time,prompt,answer")
    with pytest.raises(TraceFormatError, match="neither mooncake"):
        detect_format('{"t": 1}')
    broken = tmp_path / "broken.jsonl"
    broken.write_text(MOONCAKE + '{"timestamp": 1, "input_length": "many", "output_length": 1}\n')
    with pytest.raises(TraceFormatError, match=r"broken.jsonl: line 5: 'input_length'"):
        read_trace(broken)
    empty = tmp_path / "empty.csv"
    empty.write_text("\n\n")
    with pytest.raises(TraceFormatError, match="empty"):
        read_trace(empty)
    with pytest.raises(TraceFormatError, match="lacks GeneratedTokens"):
        parse_azure(["TIMESTAMP,ContextTokens", "2023-11-16 18:15:46,1"])


def test_window_speedup_scaling_and_caps() -> None:
    trace = rows(
        (0.0, 1024, 10, (0, 1)),
        (10.0, 1100, 300, (0, 1, 2)),
        (20.0, 512, 10, (5,)),
        (30.0, 900, 10, ()),
        (40.0, 100, 10, (9,)),
    )
    spec = Trace(
        path="-", start_s=10, duration_s=25, speedup=2, block_tokens=128, max_input_tokens=200,
        max_output_tokens=64,
    )  # fmt: skip
    planned = plan_trace(trace, spec)
    assert [r.at_s for r in planned] == [0.0, 5.0, 10.0]
    # 1100 * 128 / 512 = 275 tokens, cut to 200: two blocks of 128 (the second partial)
    assert planned[0] == TimedRequest(0, 0.0, 200, 64, (0, 1), 0)
    assert planned[1] == TimedRequest(1, 5.0, 128, 10, (5,), 0)
    # no ids in the trace: fresh negative ones, 900 * 128 / 512 = 225 tokens in two blocks
    assert planned[2] == TimedRequest(2, 10.0, 200, 10, (-1, -2), 0)
    assert plan_trace(trace, Trace(path="-", max_requests=2)) == [
        TimedRequest(0, 0.0, 1024, 10, (0, 1), 0),
        TimedRequest(1, 10.0, 1100, 300, (0, 1, 2), 0),
    ]
    assert plan_trace(trace, Trace(path="-", start_s=100)) == []


def test_loops_repeat_arrivals_and_lengths_on_fresh_blocks() -> None:
    trace = rows((0.0, 512, 1, (0,)), (4.0, 1024, 1, (0, 1)), (8.0, 100, 1, ()))
    planned = plan_trace(trace, Trace(path="-", loops=3))
    assert [r.at_s for r in planned] == [0, 4, 8, 12, 16, 20, 24, 28, 32]  # period 8 + 4
    assert [r.loop for r in planned] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert [r.block_ids for r in planned] == [
        (0,), (0, 1), (-1,), (2,), (2, 3), (-2,), (4,), (4, 5), (-3,)
    ]  # fmt: skip
    bound = prefix_bound(planned, 512)
    assert (bound.blocks, bound.hit_blocks) == (12, 3)  # one reused block per loop


def test_prefix_bound_counts_chains_not_ids() -> None:
    """A block hits only when its whole chain was seen; a partial block only as far as seen."""
    requests = [
        TimedRequest(0, 0.0, 30, 1, (1, 2, 3)),  # blocks of 10, 10, 10
        TimedRequest(1, 1.0, 25, 1, (1, 2, 3)),  # 10 + 10 + 5 tokens hit
        TimedRequest(2, 2.0, 30, 1, (1, 9, 3)),  # block 3 after another parent: a miss
        TimedRequest(3, 0.5, 14, 1, (1, 4)),  # sent before request 1: 10 hit, 4 missed
    ]
    bound = prefix_bound(requests, 10)
    assert (bound.blocks, bound.hit_blocks) == (11, 5)
    assert (bound.tokens, bound.hit_tokens) == (99, 45)
    assert bound.block_fraction == pytest.approx(5 / 11)
    assert bound.token_fraction == pytest.approx(45 / 99)
    assert prefix_bound([], 10).block_fraction is None


def test_a_bounded_cache_forgets_the_least_recently_used_chains() -> None:
    requests = [
        TimedRequest(0, 0.0, 20, 1, (1, 2)),
        TimedRequest(1, 1.0, 20, 1, (5, 6)),
        TimedRequest(2, 2.0, 20, 1, (1, 7)),  # (1) used again: the chain (1, 2) is older
        TimedRequest(3, 3.0, 20, 1, (5, 6)),
        TimedRequest(4, 4.0, 30, 1, (1, 2, 8)),
    ]
    assert prefix_bound(requests, 10).hit_blocks == 5  # 1; 5, 6; 1, 2
    # 4 chains: request 2 hits (1), and its (1, 7) evicts the oldest, (1, 2); request 3 hits
    # (5), (5, 6); request 4 hits (1) and misses (1, 2), and so (1, 2, 8)
    assert prefix_bound(requests, 10, capacity_blocks=4).hit_blocks == 4
    # 3 chains: each request's own blocks push out what the next one would reuse
    assert prefix_bound(requests, 10, capacity_blocks=3).hit_blocks == 0
    # a chain still cached after its parent was evicted is no hit: the lookup stopped before it
    orphan = [TimedRequest(0, 0.0, 20, 1, (1, 2)), TimedRequest(1, 1.0, 10, 1, (3,))]
    orphan.append(TimedRequest(2, 2.0, 20, 1, (1, 2)))
    assert prefix_bound(orphan, 10, capacity_blocks=2).hit_blocks == 0
    assert prefix_bound(orphan, 10).hit_blocks == 2


def test_the_bound_of_a_mooncake_file_is_its_repeated_block_share(tmp_path: Path) -> None:
    path = tmp_path / "mooncake.jsonl"
    path.write_text(MOONCAKE)
    planned = trace_requests(Trace(path=str(path)))
    assert [r.block_ids for r in planned] == [(0, 3), (0, 1, 2), (0, 1)]
    assert prefix_bound(planned, 512).block_fraction == pytest.approx(3 / 7)
