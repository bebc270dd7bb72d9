"""Delegation to vLLM's renderer when the renderer fails in ways real vLLM cannot be made to.

The real-vLLM tier (tests/realvllm/test_render.py) runs the router against vLLM 0.32's own
renderer (`vllm launch render`): the ids of every render mode, the engines' key, a request the
renderer refuses (400) and a renderer gone. What stays here is what that renderer never does on
request: an answer of 200 that is not JSON or holds no `token_ids`, a server error, and an answer
that does not come in time. The renderer here is a small aiohttp server on 127.0.0.1 at vLLM's
paths (`/v1/chat/completions/render`, `/v1/completions/render`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from tandem.router.features import Featurizer, prompt_text
from tandem.router.render_client import RenderClient

CHAT = {"messages": [{"role": "user", "content": "x" * 300}]}


@pytest.fixture
async def failing_renderer() -> AsyncIterator[str]:
    """Chat: a 200 without token_ids, or (user "slow") no answer until the test ends; completions:
    a 200 that is not JSON, or (prompt "error") a 502 page."""
    release = asyncio.Event()

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        if body["messages"][0]["content"] == "slow":
            await release.wait()
        return web.json_response({"request_id": "r", "token_ids": None})

    async def completion(request: web.Request) -> web.Response:
        if (await request.json())["prompt"] == "error":
            return web.Response(status=502, text="<html>bad gateway</html>")
        return web.Response(text="<html>not json</html>", content_type="text/html")

    app = web.Application()
    app.router.add_post("/v1/chat/completions/render", chat)
    app.router.add_post("/v1/completions/render", completion)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"http://127.0.0.1:{port}"
    release.set()
    await runner.cleanup()


@pytest.mark.parametrize(
    ("body", "chat"),
    [(CHAT, True), ({"prompt": "z" * 300}, False), ({"prompt": "error"}, False)],
    ids=["no-token-ids", "not-json", "server-error"],
)
async def test_an_unusable_answer_is_routed_on_the_approximation(
    failing_renderer: str, body: dict[str, object], chat: bool
) -> None:
    reasons: list[str] = []
    featurizer = Featurizer(
        16, None, render=RenderClient(failing_renderer), render_all=True, on_fallback=reasons.append
    )
    features = await featurizer.features(body, chat)
    assert not features.exact
    assert features == featurizer.approximate(prompt_text(body, chat))
    assert reasons == ["render"]


async def test_an_answer_that_does_not_come_in_time_is_routed_on_the_approximation(
    failing_renderer: str,
) -> None:
    reasons: list[str] = []
    featurizer = Featurizer(
        16,
        None,
        render=RenderClient(failing_renderer, 0.5),
        render_all=True,
        on_fallback=reasons.append,
    )
    slow = {"messages": [{"role": "user", "content": "slow"}]}
    # the client's own timeout ends the wait; the outer bound only keeps a broken one from hanging
    features = await asyncio.wait_for(featurizer.features(slow, True), timeout=30)
    assert not features.exact
    assert reasons == ["render"]
