"""vLLM's development endpoints of sleep mode (/sleep, /wake_up, /is_sleeping) over SleepMode."""

from __future__ import annotations

from typing import Any, cast, get_args

from aiohttp import web

from tandem.emulator.engine import EmulatedEngine
from tandem.emulator.errors import internal_error
from tandem.emulator.responses import json_response
from tandem.emulator.sleep import PauseMode

NOT_ENABLED = "Sleep mode is not enabled: start the engine with --enable-sleep-mode"


def _query_error(name: str, value: str, message: str) -> web.Response:
    """FastAPI's 422 for a query parameter that fails validation, as vLLM answers it."""
    detail = {"type": "value_error", "loc": ["query", name], "msg": message, "input": value}
    return json_response({"detail": [detail]}, 422)


class SleepEndpoints:
    """Handlers that exist, as in vLLM, only with VLLM_SERVER_DEV_MODE=1."""

    def __init__(self, engine: EmulatedEngine) -> None:
        self.engine = engine

    def add_routes(self, router: web.UrlDispatcher) -> None:
        router.add_post("/sleep", self.sleep)
        router.add_post("/wake_up", self.wake_up)
        router.add_get("/is_sleeping", self.is_sleeping)

    def _check_enabled(self) -> None:
        if not self.engine.config.enable_sleep_mode:
            raise internal_error(NOT_ENABLED)

    async def sleep(self, request: web.Request) -> web.Response:
        raw_level = request.query.get("level", "1")
        mode = request.query.get("mode", "abort")
        if not raw_level.lstrip("-").isdigit() or not 0 <= int(raw_level) <= 2:
            return _query_error("level", raw_level, "Input should be 0, 1 or 2")
        if mode not in get_args(PauseMode):
            return _query_error("mode", mode, "Input should be 'abort', 'wait' or 'keep'")
        self._check_enabled()
        level = int(raw_level)
        await self.engine.sleep_mode.sleep(level, cast(PauseMode, mode))
        return json_response({"status": "sleeping", "level": level})

    async def wake_up(self, request: web.Request) -> web.Response:
        self._check_enabled()
        tags: list[str] | None = request.query.getall("tags", []) or None
        awake = await self.engine.sleep_mode.wake_up(tags)
        body: dict[str, Any] = {"status": "awake" if awake else "sleeping", "tags": tags}
        return json_response(body)

    async def is_sleeping(self, request: web.Request) -> web.Response:
        return json_response({"is_sleeping": self.engine.sleep_mode.is_sleeping})
