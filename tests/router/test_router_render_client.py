"""Delegation to vLLM's renderer over a real socket.

The renderer here is a small aiohttp server on 127.0.0.1 answering in the wire format of vLLM
0.32's `/v1/chat/completions/render` (a GenerateRequest with `token_ids`) and
`/v1/completions/render` (a list of them), because starting real vLLM takes a minute and belongs
to the real-vLLM tier; benchmarks/tokenize_render_bench.py runs the same client against real vLLM
and checks its ids equal the in-process ones on every request.
"""

from __future__ import annotations

import shutil
import socket
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from tandem.router.blocks import block_keys
from tandem.router.features import Featurizer
from tandem.router.render_client import RenderClient


@pytest.fixture
async def renderer() -> Any:
    seen: list[tuple[str, dict[str, Any]]] = []

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(("chat", body))
        if body.get("messages") == "fail":
            return web.json_response({"error": {"message": "bad"}}, status=400)
        return web.json_response({"request_id": "r", "token_ids": list(range(40))})

    async def completion(request: web.Request) -> web.Response:
        seen.append(("completion", await request.json()))
        return web.json_response([{"request_id": "r", "token_ids": [7] * 33}])

    app = web.Application()
    app.router.add_post("/v1/chat/completions/render", chat)
    app.router.add_post("/v1/completions/render", completion)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"http://127.0.0.1:{port}", seen
    await runner.cleanup()


async def test_remote_mode_takes_the_renderers_ids(renderer: Any) -> None:
    url, seen = renderer
    reasons: list[str] = []
    featurizer = Featurizer(
        16, None, render=RenderClient(url), render_all=True, on_fallback=reasons.append
    )
    assert featurizer.exact
    chat = await featurizer.features({"messages": [{"role": "user", "content": "x"}]}, True)
    assert chat.exact
    assert chat.keys == block_keys(list(range(40)), 16)
    salted = await featurizer.features({"prompt": "y", "cache_salt": "s"}, False)
    assert salted.prompt_tokens == 33
    assert salted.keys[0] != block_keys([7] * 33, 16)[0]
    assert [k for k, _ in seen] == ["chat", "completion"]
    refused = await featurizer.features({"messages": "fail"}, True)
    assert not refused.exact
    assert reasons == ["render"]


async def test_local_mode_asks_the_renderer_only_for_what_it_declines(renderer: Any) -> None:
    url, seen = renderer
    featurizer = Featurizer(
        16,
        "tests/router/fixtures/tokenization/models/llama3.1",
        render=RenderClient(url),
        chat_template_kwargs={"date_string": "26 Jul 2024"},
    )
    text = await featurizer.features({"messages": [{"role": "user", "content": "hi"}]}, True)
    assert text.exact
    assert not seen
    image = {
        "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
        ]
    }
    delegated = await featurizer.features(image, True)
    assert delegated.keys == block_keys(list(range(40)), 16)
    assert len(seen) == 1


async def test_an_unreproduced_tokenizer_class_takes_the_renderers_ids(
    renderer: Any, tmp_path: Path
) -> None:
    url, seen = renderer
    directory = tmp_path / "model"
    shutil.copytree("tests/router/fixtures/tokenization/classes/spm-llama2", directory)
    (directory / "tokenizer_config.json").write_text('{"tokenizer_class": "T5TokenizerFast"}')
    (directory / "config.json").write_text('{"model_type": "t5"}')
    reasons: list[str] = []
    featurizer = Featurizer(
        16, str(directory), render=RenderClient(url), on_fallback=reasons.append
    )
    assert featurizer.exact
    assert featurizer.tokenizer_issue is not None
    chat = await featurizer.features({"messages": [{"role": "user", "content": "hi"}]}, True)
    assert chat.exact
    assert chat.keys == block_keys(list(range(40)), 16)
    assert [k for k, _ in seen] == ["chat"]
    assert reasons == []


async def test_an_unreachable_renderer_falls_back_to_the_approximation() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    reasons: list[str] = []
    featurizer = Featurizer(
        16,
        None,
        render=RenderClient(f"http://127.0.0.1:{port}", 1.0),
        render_all=True,
        on_fallback=reasons.append,
    )
    features = await featurizer.features({"prompt": "z" * 300}, False)
    assert not features.exact
    assert features.prompt_tokens == 75
    assert reasons == ["render"]
