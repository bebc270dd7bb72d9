"""LoRA adapters as the router sees them: vLLM's adapter-slot metric, the adapters an engine's
/v1/models lists, and this router's open requests per adapter and engine."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

_LORA_INFO = b"vllm:lora_requests_info{"
_LABEL = re.compile(rb'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True, slots=True)
class LoraSlots:
    """One engine's `vllm:lora_requests_info`: its adapter slots (`--max-loras`) and the adapters
    of its running and waiting requests."""

    max_loras: int
    running: frozenset[str]
    waiting: frozenset[str]


def _names(value: bytes) -> frozenset[str]:
    return frozenset(name for name in value.decode(errors="replace").split(",") if name)


def parse_lora_slots(text: bytes) -> LoraSlots | None:
    """The current `vllm:lora_requests_info` series of a /metrics page, None without one.

    vLLM sets the gauge of the label set it sees (max_lora, running_lora_adapters,
    waiting_lora_adapters) to the current time at every stats update and never removes an old
    label set, so the page holds every combination seen since start: the current one is the
    series with the largest value. Several DP ranks' series (one engine) are merged.
    """
    best: dict[bytes, bytes] | None = None
    best_value = float("-inf")
    for line in text.split(b"\n"):
        if not line.startswith(_LORA_INFO):
            continue
        close = line.rfind(b"}")
        try:
            value = float(line[close + 1 :].split()[0])
        except (ValueError, IndexError):
            continue
        if value > best_value:
            best_value = value
            best = dict(_LABEL.findall(line[len(_LORA_INFO) : close]))
    if best is None:
        return None
    try:
        max_loras = int(best.get(b"max_lora", b"0"))
    except ValueError:
        max_loras = 0
    return LoraSlots(
        max_loras,
        _names(best.get(b"running_lora_adapters", b"")),
        _names(best.get(b"waiting_lora_adapters", b"")),
    )


def adapters_of(models: Any) -> dict[str, str]:
    """Adapter name -> path from an engine's /v1/models answer: every model with a `parent` (vLLM
    lists an adapter with `parent` = the base model and `root` = the path it was loaded from, the
    path its block hashes carry)."""
    data = models.get("data") if isinstance(models, dict) else None
    out: dict[str, str] = {}
    for model in data if isinstance(data, list) else []:
        if not isinstance(model, dict) or model.get("parent") is None:
            continue
        name, root = model.get("id"), model.get("root")
        if isinstance(name, str) and isinstance(root, str):
            out[name] = root
    return out


def served_adapters(engines: Iterable[Mapping[str, str] | None]) -> dict[str, str]:
    """Every adapter some engine lists (name -> path, the first engine's path for a name)."""
    out: dict[str, str] = {}
    for adapters in engines:
        for name, path in (adapters or {}).items():
            out.setdefault(name, path)
    return out


@contextlib.contextmanager
def adapter_stream(streams: MutableMapping[str, int], adapter: str | None) -> Iterator[None]:
    """Counts one open request for `adapter` in `streams` (an engine's) while the block runs."""
    if adapter is None:
        yield
        return
    streams[adapter] = streams.get(adapter, 0) + 1
    try:
        yield
    finally:
        left = streams[adapter] - 1
        if left > 0:
            streams[adapter] = left
        else:
            del streams[adapter]
