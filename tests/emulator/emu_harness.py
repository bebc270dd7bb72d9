"""Test harness: emulator processes on free 127.0.0.1 ports, and the golden vLLM transcripts."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from tandem_process import GOLDEN, MODEL_DIR, TandemProcess

from tandem.common.ports import free_port


class Emulator(TandemProcess):
    """One `tandem emulate` process on 127.0.0.1; stopped (and reaped) on exit."""

    def __init__(
        self, args: list[str], env: dict[str, str] | None = None, port: int | None = None
    ) -> None:
        port = port or free_port()
        argv = ["emulate", *args, "--host", "127.0.0.1", "--port", str(port)]
        super().__init__("emulator", argv, port, env)


@contextlib.contextmanager
def emulator(
    args: list[str], env: dict[str, str] | None = None, ready: bool = True
) -> Iterator[Emulator]:
    proc = Emulator(args, env)
    try:
        if ready:
            proc.wait_ready()
        yield proc
    finally:
        proc.stop()


TINY_ARGS = [
    "--model",
    str(MODEL_DIR),
    "--served-model-name",
    "tiny",
    "--max-model-len",
    "1024",
    "--block-size",
    "32",
    "--enable-prefix-caching",
    "--load-format",
    "dummy",
    "--speedup",
    "20",
]


def shape(value: object) -> object:
    """The structure of a JSON value: key sets, list element shapes and scalar type names."""
    if isinstance(value, dict):
        return {key: shape(item) for key, item in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return type(value).__name__


def golden_json(*parts: str) -> dict[str, object]:
    import json

    data = json.loads(GOLDEN.joinpath(*parts).read_text())
    assert isinstance(data, dict)
    return data


def metric_value(text: str, prefix: str) -> float:
    """The value of the first sample line of a /metrics body starting with `prefix`."""
    for line in text.splitlines():
        if line.startswith(prefix):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no sample {prefix!r}")


def counter_values(text: str) -> dict[str, float]:
    """Every vllm:* sample that does not measure time: counters, gauges, histogram counts and sums
    of token-valued histograms (what the same traffic must reproduce exactly)."""
    values = {}
    for line in text.splitlines():
        if not line.startswith("vllm:") or "_created" in line or "_bucket" in line:
            continue
        if "seconds" in line or "cache_config_info" in line:
            continue
        key, value = line.rsplit(" ", 1)
        values[key] = float(value)
    return values


def golden_request(path: Path) -> tuple[str, dict[str, object]]:
    """(URL path, JSON body) of a golden NAME.req.http."""
    import json

    raw = path.read_bytes().decode()
    head, _, body = raw.partition("\r\n\r\n")
    return head.split()[1], json.loads(body)
