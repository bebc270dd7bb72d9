"""Prompt token ids from vLLM's own renderer (`vllm launch render MODEL`, or any vLLM 0.32 server).

    chat:        POST {url}/v1/chat/completions/render   -> {"token_ids": [...], ...}
    completions: POST {url}/v1/completions/render        -> [{"token_ids": [...], ...}, ...]

The request body goes as the client sent it (the renderer applies vLLM's own rules, so it is
exact for every model vLLM serves), with the engines' key when the router has one: a renderer
started with the engines' `--api-key` (or VLLM_API_KEY) refuses requests without it. Any failure (refused, timed out, an error answer) raises
`RenderUnavailable`; the featurizer then routes on the approximation.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from tandem.router.upstream import AuthHeader, UpstreamError, UpstreamPool


class RenderUnavailable(Exception):
    """The renderer gave no token ids for this request."""


class RenderClient:
    def __init__(self, url: str, timeout_s: float = 2.0, auth: AuthHeader | None = None):
        self.pool = UpstreamPool(url, connect_timeout=timeout_s, auth=auth)
        self.timeout_s = timeout_s

    async def token_ids(self, body: dict[str, Any], chat: bool) -> list[int]:
        path = "/v1/chat/completions/render" if chat else "/v1/completions/render"
        payload = msgspec.json.encode({k: v for k, v in body.items() if k != "stream_options"})
        try:
            async with asyncio.timeout(self.timeout_s):
                response = await self.pool.request(
                    "POST",
                    path,
                    payload,
                    [("content-type", "application/json")],
                    idle_s=self.timeout_s,
                )
                raw = await response.read()
        except (UpstreamError, TimeoutError) as exc:
            raise RenderUnavailable(str(exc)) from exc
        if response.status != 200:
            raise RenderUnavailable(f"renderer answered {response.status}")
        try:
            answer = msgspec.json.decode(raw)
        except msgspec.DecodeError as exc:
            raise RenderUnavailable(f"renderer answer is not JSON: {exc}") from exc
        first = answer[0] if isinstance(answer, list) and answer else answer
        ids = first.get("token_ids") if isinstance(first, dict) else None
        if not isinstance(ids, list):
            raise RenderUnavailable("renderer answer without token_ids")
        return ids

    def close(self) -> None:
        self.pool.close()
