"""The pure parts of the hardened request path: plan_route, body checks, handoff checks, trust,
and per-engine metric series."""

from __future__ import annotations

import pytest

from tandem.router.config import RouterConfig
from tandem.router.decision import Reason, Route, RouteInputs, plan_route
from tandem.router.engines import Engine
from tandem.router.handoff import handoff_problem
from tandem.router.httpserver import Request
from tandem.router.metrics import RouterMetrics
from tandem.router.rendezvous import weight
from tandem.router.trust import DEBUG_HEADER, ClientTrust
from tandem.router.validation import InvalidRequest, parse_body


def _config(**extra: object) -> RouterConfig:
    return RouterConfig.model_validate(
        {"servedModelName": "tiny", "static": {"decode": [{"url": "http://d"}]}, **extra}
    )


def _inputs(decoders: list[Engine], prefillers: list[Engine], **extra: object) -> RouteInputs:
    fields: dict[str, object] = {
        "prompt_tokens": 1000,
        "total_blocks": 62,
        "n": 1,
        "decoders": decoders,
        "prefillers": prefillers,
        "any_prefill_configured": bool(prefillers),
        "hits": {},
        "cached_blocks": {},
    }
    return RouteInputs(**(fields | extra))  # type: ignore[arg-type]


def test_plan_route_ranks_decides_and_gives_its_reason() -> None:
    config = _config()
    d1, d2 = Engine("http://d1", frozenset({"decode"})), Engine("http://d2", frozenset({"decode"}))
    p = Engine("http://p", frozenset({"prefill"}))
    plan = plan_route(_inputs([d1, d2], [p], hits={"http://d2": 10}), config)
    assert plan is not None
    assert plan.decode.engine is d2  # the prefix hit wins
    assert (plan.route, plan.reason) == (Route.DISAGGREGATED, Reason.DISAGGREGATED)
    assert [c.engine for c in plan.prefill_ranking] == [p]
    # n > 1 is decided inside the plan: one prefill answer hands off one sequence's KV
    several = plan_route(_inputs([d1], [p], n=3), config)
    assert several is not None
    assert several.route is Route.LOCAL
    assert not several.prefill_ranking
    # every prefill engine down: local, and the reason says it was a fallback
    down = plan_route(_inputs([d1], [], any_prefill_configured=True), config)
    assert down is not None
    assert (down.route, down.reason) == (Route.LOCAL, Reason.FALLBACK)
    never = _config(disaggregation={"mode": "never"})
    plain = plan_route(_inputs([d1], [], any_prefill_configured=True), never)
    assert plain is not None
    assert plain.reason is Reason.LOCAL
    # a session goes to its rendezvous engine, prefix hit or not
    session = next(s for s in (f"s{i}" for i in range(100)) if weight(s, d1.id) > weight(s, d2.id))
    sticky = plan_route(_inputs([d1, d2], [], hits={"http://d2": 10}, session=session), config)
    assert sticky is not None
    assert sticky.decode.engine is d1
    assert plan_route(_inputs([], [p]), config) is None


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": ["tiny"], "prompt": "x"}',
        b'{"model": {"a": 1}, "prompt": "x"}',
        b'{"prompt": "x", "max_tokens": "many"}',
        b'{"prompt": "x", "n": 0}',
        b'{"prompt": [[1, 2], "x"]}',
        b'{"prompt": ""}',
        b'{"prompt": "x", "stream": "yes"}',
        b'{"prompt": "x", "deep": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b"[" * 100_000,
        b'"just a string"',
    ],
)
def test_malformed_bodies_are_400s(raw: bytes) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_body(raw, chat=False, model_names={"tiny"})
    assert info.value.status == 400
    assert b'"type":"BadRequestError"' in info.value.body


def test_chat_bodies_and_unknown_models() -> None:
    for raw in (b'{"messages": [1]}', b'{"messages": [{"content": "x"}]}', b'{"messages": []}'):
        with pytest.raises(InvalidRequest):
            parse_body(raw, chat=True, model_names={"tiny"})
    with pytest.raises(InvalidRequest) as info:
        parse_body(b'{"model": "other", "prompt": "x"}', chat=False, model_names={"tiny"})
    assert info.value.status == 404
    ok = b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}'
    assert parse_body(ok, chat=True, model_names={"tiny"})["messages"][0]["role"] == "user"


def test_handoff_must_name_the_answering_engine() -> None:
    engine = Engine("http://10.0.0.7:8000", frozenset({"prefill"}), side_channel_port=5600)
    good = {"remote_host": "10.0.0.7", "remote_port": 5600, "remote_engine_id": "e"}
    assert handoff_problem(good, engine) is None
    assert handoff_problem({**good, "remote_host": "169.254.169.254"}, engine)
    assert handoff_problem({**good, "remote_port": 6443}, engine)
    assert handoff_problem({**good, "remote_port": True}, engine)
    assert handoff_problem({**good, "remote_host": None}, engine)
    assert handoff_problem("not a dict", engine)
    local = Engine("http://127.0.0.1:8000", frozenset({"prefill"}), side_channel_port=7000)
    assert handoff_problem({"remote_host": "localhost", "remote_port": 7000}, local) is None


def _request(peer: str, **headers: str) -> Request:
    return Request("GET", "/metrics", "", headers, b"", peer)


def test_trust_decides_priority_debug_and_admin() -> None:
    plain = ClientTrust(_config(apiKeys=["client"], trust={"adminKeys": ["admin"]}))
    outsider = _request("10.1.2.3", authorization="Bearer client", **{DEBUG_HEADER: "1"})
    admin = _request("10.1.2.3", authorization="Bearer admin", **{DEBUG_HEADER: "1"})
    assert plain.authorized(outsider)
    assert plain.authorized(admin)
    assert not plain.trusted(outsider)
    assert not plain.wants_engines(outsider)
    assert plain.trusted(admin)
    assert plain.wants_engines(admin)
    assert not plain.admin_on_main_port(outsider)
    assert plain.admin_on_main_port(admin)
    assert plain.admin_on_main_port(_request("127.0.0.1"))  # a local tandem up, a sidecar
    with_port = ClientTrust(_config(trust={"adminPort": 9901, "adminKeys": ["admin"]}))
    assert not with_port.admin_on_main_port(admin)  # only on the admin port then
    assert ClientTrust(_config(trust={"trustAllClients": True})).trusted(_request("10.1.2.3"))


def test_metric_series_leave_with_their_engine() -> None:
    metrics = RouterMetrics()
    metrics.child(metrics.ttft, "local", "http://gone").observe(0.1)
    metrics.child(metrics.ttft, "local", "http://stays").observe(0.1)
    metrics.child(metrics.upstream_errors, "decode", "http://gone", "connect").inc()
    metrics.forget_endpoint("http://gone")
    text = metrics.render().decode()
    assert "http://gone" not in text
    assert "http://stays" in text
