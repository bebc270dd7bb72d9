"""What a failure report shows of a child's log: its first error as well as its end.

The end alone often hides the cause. When a vLLM engine core dies while starting, the last lines
are the API server's own traceback ("Engine core initialization failed. See root cause above"),
and the cause (a port already bound, memory that does not fit, a bad argument) is a traceback
further up, logged by the engine-core process.
"""

from __future__ import annotations

import re

# vLLM's prefix on every line of a record: "(EngineCore pid=42) ERROR 12-01 08:12:43 [core.py:1510] "
_VLLM_PREFIX = r"(?:\([\w:. -]+ pid=\d+\) )?(?:[A-Z]+ \d\d-\d\d [\d:]+ \[[^\]]+\] )?"
_ERROR_START = re.compile(r"Traceback \(most recent call last\)|\bERROR\b|\bCRITICAL\b|\bFATAL\b")
_EXCEPTION_LINE = re.compile(
    _VLLM_PREFIX + r"[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Failure)\b(?::.*)?$"
)


def first_error(lines: list[str]) -> tuple[int, list[str]] | None:
    """(index, lines) of the first error: the line that starts it and, when a traceback follows,
    the exception line that ends the traceback; None for a log without an error."""
    start = next((i for i, line in enumerate(lines) if _ERROR_START.search(line)), None)
    if start is None:
        return None
    if _EXCEPTION_LINE.match(lines[start]):
        return start, [lines[start]]
    for line in lines[start + 1 :]:
        if _EXCEPTION_LINE.match(line):
            return start, [lines[start], "  …", line]
    return start, [lines[start]]


def failure_excerpt(text: str, tail_lines: int = 15) -> str:
    """The last `tail_lines` lines of a log, preceded by its first error when that lies above
    them."""
    lines = text.rstrip().splitlines()
    tail_start = max(len(lines) - tail_lines, 0)
    tail = "\n".join(lines[tail_start:])
    found = first_error(lines)
    if found is None or found[0] >= tail_start:
        return tail
    index, error = found
    return f"first error (line {index + 1}):\n" + "\n".join(error) + f"\nlast lines:\n{tail}"
