"""Runtime LoRA adapter loading through the router: one /v1/load_lora_adapter or
/v1/unload_lora_adapter request sent to every engine of the cluster (prefill and decode alike, so
P/D serves the adapter on both), the router's adapter lists updated from the answers, and the
load replayed to an engine that joins later (`RuntimeAdapters`)."""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

from tandem.router.engines import Engine
from tandem.router.errors import error_body
from tandem.router.upstream import UpstreamError, Upstreams

log = logging.getLogger("tandem.router.lora")

LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"


@dataclass(frozen=True, slots=True)
class EngineAnswer:
    engine: Engine
    status: int  # 0: the engine could not be reached
    body: bytes


def parse_adapter_request(raw: bytes) -> tuple[str, str | None] | None:
    """(lora_name, lora_path) of a load or unload body; None when it has no lora_name (the path
    is the engines' to check: vLLM answers a load without one with its own 400)."""
    try:
        body = json.loads(raw)
    except ValueError:
        return None
    name = body.get("lora_name") if isinstance(body, dict) else None
    if not isinstance(name, str) or not name:
        return None
    path = body.get("lora_path")
    return name, path if isinstance(path, str) else None


def combined_answer(answers: list[EngineAnswer], load: bool, name: str) -> tuple[int, bytes]:
    """The client's answer: vLLM's success text when every engine succeeded; otherwise the first
    failing engine's own status and body (an unreachable engine: 502), so the client sees vLLM's
    words (404 for an unknown adapter, 400 for one loaded already)."""
    if not answers:
        return 503, error_body(503, "no engine to load the adapter on")
    for answer in answers:
        if answer.status != 200:
            if answer.status == 0:
                return 502, error_body(502, f"engine {answer.engine.id} could not be reached")
            return answer.status, answer.body
    verb = "added" if load else "removed"
    return 200, f"Success: LoRA adapter '{name}' {verb} successfully.".encode()


async def send_to_engines(
    engines: list[Engine], upstreams: Upstreams, path: str, raw: bytes, timeout_s: float
) -> list[EngineAnswer]:
    """`raw` POSTed to `path` on every engine at once."""

    async def one(engine: Engine) -> EngineAnswer:
        try:
            response = await upstreams.pool(engine.url).request(
                "POST", path, raw, [("content-type", "application/json")], timeout_s
            )
            return EngineAnswer(engine, response.status, await response.read())
        except UpstreamError as exc:
            log.warning("%s on %s failed: %s", path, engine.id, exc)
            return EngineAnswer(engine, 0, b"")

    return list(await asyncio.gather(*(one(e) for e in engines)))


def record_answers(answers: list[EngineAnswer], load: bool, name: str, path: str | None) -> None:
    """Each engine that accepted the change lists the adapter (load) or no longer does (unload)
    at once, before the monitor's next /v1/models read."""
    for answer in answers:
        if answer.status != 200:
            if answer.status:
                log.warning(
                    "engine %s refused to %s adapter %s: %d %s",
                    answer.engine.id,
                    "load" if load else "unload",
                    name,
                    answer.status,
                    answer.body[:200].decode(errors="replace"),
                )
            continue
        adapters = dict(answer.engine.adapters or {})
        if load:
            adapters[name] = path or ""
        else:
            adapters.pop(name, None)
        answer.engine.adapters = adapters


class RuntimeAdapters:
    """Adapters loaded at runtime through this router, each with the load body it was loaded
    with, so that an engine which joins later (a scale-up, a pod restarted without them) is sent
    the same load.

    An engine e is sent the load of adapter a when

        a was loaded through this router  and  e's /v1/models was read and lacks a
        and  another engine of the pool lists a

    The last clause keeps router replicas consistent without sharing state: an adapter unloaded
    through another replica is listed by no engine after that replica's fan-out, so this one
    forgets it instead of bringing it back.
    """

    def __init__(self) -> None:
        self._bodies: dict[str, bytes] = {}
        self._refused: set[tuple[str, str]] = set()  # (engine id, adapter): answered 4xx

    def record(self, answers: list[EngineAnswer], load: bool, name: str, raw: bytes) -> None:
        """A load that some engine accepted is remembered; an unload forgets the adapter. An
        engine that refuses a replayed load with a 4xx (runtime updating off, a path it cannot
        read) is not asked again; an unreachable one or a 5xx is, on the next pass."""
        if not load:
            self._bodies.pop(name, None)
            self._refused = {(e, a) for e, a in self._refused if a != name}
            return
        if any(answer.status == 200 for answer in answers):
            self._bodies[name] = raw
        self._refused |= {(a.engine.id, name) for a in answers if 400 <= a.status < 500}

    def replays(self, engines: list[Engine]) -> list[tuple[Engine, str, bytes]]:
        """(engine, adapter, load body) for every load owed (the rule above); adapters that no
        engine lists any more are forgotten."""
        owed: list[tuple[Engine, str, bytes]] = []
        for name, raw in list(self._bodies.items()):
            listing = [e for e in engines if e.adapters is not None and name in e.adapters]
            if not listing:
                del self._bodies[name]
                continue
            owed += [
                (engine, name, raw)
                for engine in engines
                if engine.healthy
                and engine.adapters is not None
                and name not in engine.adapters
                and (engine.id, name) not in self._refused
            ]
        return owed

    def __contains__(self, name: str) -> bool:
        return name in self._bodies
