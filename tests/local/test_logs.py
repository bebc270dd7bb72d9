"""A failure report names the cause: the first error of a child's log as well as its end.

data/vllm-engine-core-failed-to-start.log is a real vLLM 0.32 (CPU build) log of an engine core
that died while starting because its KV-event replay port had been taken; its last lines show only
the API server's "See root cause above"."""

from __future__ import annotations

from pathlib import Path

from tandem.local.logs import failure_excerpt, first_error

ENGINE_CORE_FAILED = Path(__file__).parent / "data" / "vllm-engine-core-failed-to-start.log"


def test_a_vllm_engine_core_failure_shows_its_cause_and_the_end_of_the_log() -> None:
    text = ENGINE_CORE_FAILED.read_text()
    excerpt = failure_excerpt(text)
    first, _, last = excerpt.partition("\nlast lines:\n")
    assert "EngineCore failed to start." in first
    assert "zmq.error.ZMQError: Address already in use (addr='tcp://*:38071')" in first
    assert "See root cause above" not in first
    assert last == "\n".join(text.rstrip().splitlines()[-15:])
    assert "See root cause above" in last


def test_the_first_error_ends_at_the_exception_that_closes_its_traceback() -> None:
    lines = [
        "INFO starting",
        "(EngineCore pid=7) ERROR 12-01 08:04:12 [core.py:1510] EngineCore failed to start.",
        "(EngineCore pid=7) ERROR 12-01 08:04:12 [core.py:1510] Traceback (most recent call last):",
        '(EngineCore pid=7) ERROR 12-01 08:04:12 [core.py:1510]   File "x.py", line 1, in f',
        "(EngineCore pid=7) ERROR 12-01 08:04:12 [core.py:1510]     raise ValueError(",
        "(EngineCore pid=7) ERROR 12-01 08:04:12 [core.py:1510] ValueError: no room for the KV cache",
        "RuntimeError: Engine core initialization failed. See root cause above.",
    ]
    assert first_error(lines) == (1, [lines[1], "  …", lines[5]])


def test_a_plain_traceback_is_found_too() -> None:
    lines = ["Traceback (most recent call last):", '  File "a.py"', "OSError: [Errno 98] in use"]
    assert first_error(lines) == (0, [lines[0], "  …", lines[2]])


def test_a_log_whose_error_is_in_its_last_lines_shows_only_them() -> None:
    text = "ready\nserving\nERROR lost the engine\n"
    assert failure_excerpt(text) == text.rstrip()
    assert failure_excerpt("a\nb\nc", tail_lines=2) == "b\nc"
    assert first_error(["all well"]) is None
