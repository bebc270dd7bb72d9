"""A bounded open-loop load generator for autoscaling tests: fixed request rate, capped count and time."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class LoadResult:
    sent: int = 0
    ok: int = 0
    failed: int = 0
    latencies_s: list[float] = field(default_factory=list)


async def drive(
    url: str,
    model: str,
    rate_per_s: float,
    duration_s: float,
    prompt_words: int,
    max_tokens: int,
    max_requests: int = 2000,
    timeout_s: float = 60.0,
    stop: asyncio.Event | None = None,
) -> LoadResult:
    """POST /v1/completions at `rate_per_s` for `duration_s` (at most `max_requests`), then wait for
    the requests in flight (each bounded by `timeout_s`). Prompts differ so no prefix is cached."""
    result = LoadResult()
    tasks: list[asyncio.Task[None]] = []
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:

        async def one(index: int) -> None:
            prompt = f"request {index} " + " ".join(
                f"w{(index * 7 + i) % 997}" for i in range(prompt_words)
            )
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
            started = time.monotonic()
            try:
                response = await client.post("/v1/completions", json=body)
                if response.status_code == 200:
                    result.ok += 1
                    result.latencies_s.append(time.monotonic() - started)
                else:
                    result.failed += 1
            except httpx.HTTPError:
                result.failed += 1

        start = time.monotonic()
        while result.sent < max_requests and time.monotonic() - start < duration_s:
            if stop is not None and stop.is_set():
                break
            tasks.append(asyncio.create_task(one(result.sent)))
            result.sent += 1
            next_at = start + result.sent / rate_per_s
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        await asyncio.gather(*tasks)
    return result
