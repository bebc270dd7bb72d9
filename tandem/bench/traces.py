"""Request traces in the formats people publish, read into one list of `TraceRow`s.

Formats (`detect_format` tells them apart by their first line):

- mooncake: JSON lines `{"timestamp": ms, "input_length": N, "output_length": M,
  "hash_ids": [ids]}` (kvcache-ai/Mooncake, FAST25-release/traces); `hash_ids` name the
  prompt's 512-token blocks, the last one partial; equal ids are equal blocks.
- azure: CSV `TIMESTAMP,ContextTokens,GeneratedTokens` (Azure/AzurePublicDataset,
  AzureLLMInferenceDataset2023, Splitwise); `TIMESTAMP` is a wall-clock time with up to 7
  fractional digits; no prefix information.
- burstgpt: CSV `Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type`
  (HPMLL/BurstGPT); `Timestamp` is seconds since the collection began. Rows with 0 response
  tokens were failed requests in the original service and are left out.
- tandem: JSON lines `{"at_s": seconds, "input_tokens": N, "output_tokens": M}` with optional
  `hash_ids` (512-token blocks, as in mooncake) — the simplest way to write a trace by hand.

Every row's time is made relative to the earliest row, rows are sorted by it (stably), and
output lengths below 1 are raised to 1 (an engine cannot be asked for no token).
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

TraceFormat = Literal["mooncake", "azure", "burstgpt", "tandem"]
TRACE_FORMATS: tuple[TraceFormat, ...] = get_args(TraceFormat)
# Mooncake's hash ids (and the tandem format's) name blocks of this many prompt tokens.
TRACE_BLOCK_TOKENS = 512

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
BURSTGPT_COLUMNS = ("Timestamp", "Request tokens", "Response tokens")


class TraceRow(BaseModel):
    """One request of a trace: when it arrived (seconds after the trace's first request), its
    prompt and output lengths, and the ids of its prompt's 512-token blocks when the trace has
    them (empty: every block is the request's own)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    at_s: float = Field(ge=0)
    input_tokens: int = Field(ge=1)
    output_tokens: int = Field(ge=1)
    hash_ids: tuple[int, ...] = ()


class TraceFormatError(ValueError):
    """A file, or one of its lines, that is not in the expected trace format."""


Row = tuple[float, int, int, tuple[int, ...]]  # at, input tokens, output tokens, hash ids


def _rebased(rows: list[Row]) -> list[TraceRow]:
    """Rows sorted by time (stably) with times relative to the earliest."""
    if not rows:
        return []
    start = min(row[0] for row in rows)
    ordered = sorted(rows, key=lambda row: row[0])
    return [
        TraceRow(at_s=t - start, input_tokens=max(1, i), output_tokens=max(1, o), hash_ids=h)
        for t, i, o, h in ordered
    ]


def _json_lines(lines: Iterable[str]) -> Iterator[tuple[int, dict[str, Any]]]:
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceFormatError(f"line {number}: not JSON ({exc})") from exc
        if not isinstance(value, dict):
            raise TraceFormatError(f"line {number}: not a JSON object")
        yield number, value


def _field(row: dict[str, Any], name: str, number: int, kind: Callable[[Any], Any]) -> Any:
    if name not in row:
        raise TraceFormatError(f"line {number}: no {name!r}")
    try:
        return kind(row[name])
    except (TypeError, ValueError) as exc:
        raise TraceFormatError(f"line {number}: {name!r} is {row[name]!r}") from exc


def _hash_ids(row: dict[str, Any], number: int) -> tuple[int, ...]:
    ids = row.get("hash_ids") or []
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise TraceFormatError(f"line {number}: 'hash_ids' is not a list of integers")
    return tuple(ids)


def parse_mooncake(lines: Iterable[str]) -> list[TraceRow]:
    """Mooncake JSON lines; `timestamp` is in milliseconds."""
    rows = [
        (
            _field(row, "timestamp", number, float) / 1000,
            _field(row, "input_length", number, int),
            _field(row, "output_length", number, int),
            _hash_ids(row, number),
        )
        for number, row in _json_lines(lines)
    ]
    return _rebased(rows)


def parse_tandem(lines: Iterable[str]) -> list[TraceRow]:
    """Tandem's own JSON lines: `at_s` (seconds), `input_tokens`, `output_tokens`, `hash_ids`."""
    rows = [
        (
            _field(row, "at_s", number, float),
            _field(row, "input_tokens", number, int),
            _field(row, "output_tokens", number, int),
            _hash_ids(row, number),
        )
        for number, row in _json_lines(lines)
    ]
    return _rebased(rows)


def _csv_rows(
    lines: Iterable[str], columns: tuple[str, ...]
) -> Iterator[tuple[int, dict[str, str]]]:
    reader = csv.DictReader(line for line in lines if line.strip())
    missing = [c for c in columns if c not in (reader.fieldnames or [])]
    if missing:
        raise TraceFormatError(f"the CSV header lacks {', '.join(missing)}")
    yield from enumerate(reader, 2)


def wall_clock_s(text: str) -> float:
    """Seconds since the epoch (no time zone: only differences matter) of an Azure timestamp
    `YYYY-MM-DD HH:MM:SS[.fraction]`, whose fraction may have more digits than Python parses."""
    whole, _, fraction = text.strip().partition(".")
    seconds = datetime.fromisoformat(whole).timestamp()
    return seconds + (float(f"0.{fraction}") if fraction else 0.0)


def parse_azure(lines: Iterable[str]) -> list[TraceRow]:
    """Azure LLM inference trace CSV (Splitwise): `TIMESTAMP,ContextTokens,GeneratedTokens`."""
    rows: list[Row] = []
    for number, row in _csv_rows(lines, AZURE_COLUMNS):
        try:
            rows.append(
                (
                    wall_clock_s(row["TIMESTAMP"]),
                    int(row["ContextTokens"]),
                    int(row["GeneratedTokens"]),
                    (),
                )
            )
        except (TypeError, ValueError) as exc:
            raise TraceFormatError(f"line {number}: {exc}") from exc
    return _rebased(rows)


def parse_burstgpt(lines: Iterable[str]) -> list[TraceRow]:
    """BurstGPT CSV; rows with 0 response tokens (failures in the original service) are left out."""
    rows: list[Row] = []
    for number, row in _csv_rows(lines, BURSTGPT_COLUMNS):
        try:
            at, prompt = float(row["Timestamp"]), int(float(row["Request tokens"]))
            output = int(float(row["Response tokens"]))
        except (TypeError, ValueError) as exc:
            raise TraceFormatError(f"line {number}: {exc}") from exc
        if output > 0:
            rows.append((at, prompt, output, ()))
    return _rebased(rows)


PARSERS: dict[TraceFormat, Callable[[Iterable[str]], list[TraceRow]]] = {
    "mooncake": parse_mooncake,
    "azure": parse_azure,
    "burstgpt": parse_burstgpt,
    "tandem": parse_tandem,
}


def detect_format(first_line: str) -> TraceFormat:
    """The format whose first line (a JSON object's keys, or a CSV header) this is."""
    line = first_line.strip().lstrip("\ufeff")
    if line.startswith("{"):
        try:
            keys = set(json.loads(line))
        except json.JSONDecodeError as exc:
            raise TraceFormatError(f"the first line is not JSON ({exc})") from exc
        if {"timestamp", "input_length", "output_length"} <= keys:
            return "mooncake"
        if {"at_s", "input_tokens", "output_tokens"} <= keys:
            return "tandem"
        raise TraceFormatError(
            f"a JSON line with keys {sorted(keys)}: neither mooncake (timestamp, input_length, "
            "output_length) nor tandem (at_s, input_tokens, output_tokens)"
        )
    header = {column.strip() for column in next(csv.reader([line]), [])}
    if set(AZURE_COLUMNS) <= header:
        return "azure"
    if set(BURSTGPT_COLUMNS) <= header:
        return "burstgpt"
    raise TraceFormatError(
        f"unknown trace header {line[:120]!r}: expected mooncake or tandem JSON lines, or a CSV "
        f"with {','.join(AZURE_COLUMNS)} (azure) or {','.join(BURSTGPT_COLUMNS)} (burstgpt)"
    )


def _first_line(lines: Iterable[str], path: Path) -> str:
    first = next((line for line in lines if line.strip()), "")
    if not first:
        raise TraceFormatError(f"{path}: the trace is empty")
    return first


def file_format(path: Path) -> TraceFormat:
    """The format of the trace file at `path`, from its first non-empty line."""
    with path.open(encoding="utf-8", newline="") as file:
        first = _first_line(file, path)
    try:
        return detect_format(first)
    except TraceFormatError as exc:
        raise TraceFormatError(f"{path}: {exc}") from exc


def read_trace(path: Path, trace_format: TraceFormat | None = None) -> list[TraceRow]:
    """Every row of the trace file at `path`, in the given format or the one its first line shows."""
    with path.open(encoding="utf-8", newline="") as file:
        lines = file.read().splitlines()
    try:
        return PARSERS[trace_format or detect_format(_first_line(lines, path))](lines)
    except TraceFormatError as exc:
        raise TraceFormatError(f"{path}: {exc}") from exc
