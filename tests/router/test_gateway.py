"""`tandem gateway` over real sockets: two models on two pools of emulated engines behind one
endpoint, vLLM's 404 for an unknown model, and tenants' fair shares, token rates and shedding."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from router_harness import (
    DEBUG,
    LONG,
    SIDE_CHANNELS,
    Engine,
    Proc,
    metric,
    metrics,
    running,
    wait_all_healthy,
    wait_until,
)
from tandem_process import GOLDEN

from tandem.common.ports import free_port
from tandem.router.config import GatewayConfig


class Gateway(Proc):
    def __init__(self, config: dict[str, Any], directory: Path):
        port = free_port()
        path = directory / f"gateway-{port}.yaml"
        path.write_text(GatewayConfig.model_validate(config).to_yaml())
        args = ["gateway", "--config", str(path), "--host", "127.0.0.1", "--port", str(port)]
        super().__init__("gateway", args, port)

    def wait_ready(self, path: str = "/health", timeout: float = 30.0) -> None:
        """/health answers 200 (one decode engine is healthy), and every engine of every model
        is healthy in the gateway's view."""
        super().wait_ready(path, timeout, ready=lambda status: status == 200)
        wait_all_healthy(self, timeout)


def endpoint(engine: Engine) -> dict[str, Any]:
    entry: dict[str, Any] = {"url": engine.url}
    if engine.url in SIDE_CHANNELS:
        entry["sideChannelPort"] = SIDE_CHANNELS[engine.url]
    return entry


def model(name: str, static: dict[str, list[Engine]], **extra: Any) -> dict[str, Any]:
    return {
        "servedModelName": name,
        "static": {role: [endpoint(e) for e in engines] for role, engines in static.items()},
        **extra,
    }


def served_as(name: str, role: str | None, speedup: float = 20.0) -> Engine:
    return Engine(role, speedup=speedup, extra=["--served-model-name", name])


def post(url: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body, headers={**DEBUG, **headers}, timeout=60)


def test_two_models_on_one_endpoint_each_with_its_own_pd_pools(tmp_path: Path) -> None:
    alpha = {"prefill": [served_as("alpha", "prefill")], "decode": [served_as("alpha", "decode")]}
    beta = {"prefill": [served_as("beta", "prefill")], "decode": [served_as("beta", "decode")]}
    always = {"disaggregation": {"mode": "always"}}
    gateway = Gateway(
        {
            "trust": {"trustAllClients": True},
            "models": [
                model("alpha", alpha, apiKeys=["sk-alpha", "sk-both"], **always),
                model("beta", beta, apiKeys=["sk-both"], **always),
            ],
        },
        tmp_path,
    )
    both = {"authorization": "Bearer sk-both"}
    only_alpha = {"authorization": "Bearer sk-alpha"}
    engines = [*alpha["prefill"], *alpha["decode"], *beta["prefill"], *beta["decode"]]
    with running(*engines, gateway):
        for name, pools in (("alpha", alpha), ("beta", beta)):
            answer = post(gateway.url, {"model": name, "prompt": LONG, "max_tokens": 4}, **both)
            assert answer.status_code == 200, answer.text
            assert answer.json()["model"] == name
            assert answer.headers["x-tandem-route"] == "disaggregated"
            assert answer.headers["x-tandem-prefill-engine"] == pools["prefill"][0].url
            assert answer.headers["x-tandem-decode-engine"] == pools["decode"][0].url
        chat = httpx.post(
            gateway.url + "/v1/chat/completions",
            json={
                "model": "beta",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
            },
            headers={**DEBUG, **both},
            timeout=60,
        )
        assert chat.status_code == 200, chat.text
        assert chat.headers["x-tandem-decode-engine"] == beta["decode"][0].url

        # An unknown model: vLLM's own 404, byte for byte in shape (the real-vLLM transcript).
        captured = json.loads((GOLDEN / "single/10_err_unknown_model_completions.json").read_text())
        request = captured["request"]["body"]
        missing = post(gateway.url, request, **both)
        assert missing.status_code == captured["response"]["status"] == 404
        expected = captured["response"]["body"]
        expected["error"]["message"] = expected["error"]["message"].replace(
            "Valid aliases: tiny.", "Valid aliases: alpha, beta."
        )
        assert missing.json() == expected
        no_model = post(gateway.url, {"prompt": "hi", "max_tokens": 2}, **both)
        assert no_model.status_code == 400
        assert no_model.json()["error"]["param"] == "model"

        listed = httpx.get(gateway.url + "/v1/models", headers=both, timeout=5).json()
        assert [card["id"] for card in listed["data"]] == ["alpha", "beta"]

        # A key opens only the models whose routers accept it.
        listed = httpx.get(gateway.url + "/v1/models", headers=only_alpha, timeout=5).json()
        assert [card["id"] for card in listed["data"]] == ["alpha"]
        beta_body = {"model": "beta", "prompt": "hi", "max_tokens": 2}
        assert post(gateway.url, beta_body, **only_alpha).status_code == 401
        assert post(gateway.url, beta_body).status_code == 401
        assert httpx.get(gateway.url + "/v1/models", timeout=5).status_code == 401
        unknown = post(gateway.url, request, **only_alpha).json()["error"]["message"]
        assert unknown.endswith("Valid aliases: alpha.")
        text = httpx.get(gateway.url + "/metrics", timeout=5).text
        assert metric(text, "tandem_router_decisions_total", model="alpha") >= 1
        assert metric(text, "tandem_router_decisions_total", model="beta") >= 2
        described = httpx.get(gateway.url + "/engines", timeout=5).json()
        assert sorted((e["model"], e["url"]) for e in described) == sorted(
            [
                (n, e.url)
                for n, pools in (("alpha", alpha), ("beta", beta))
                for es in pools.values()
                for e in es
            ]
        )


def _fire(url: str, body: dict[str, Any], headers: dict[str, str], out: list[Any]) -> None:
    response = post(url, body, **headers)
    out.append((time.monotonic(), headers.get("x-tandem-tenant", ""), response))


def test_a_quiet_tenant_is_served_between_a_loud_tenants_burst(tmp_path: Path) -> None:
    worker = served_as("tiny", None, speedup=1.0)
    gateway = Gateway(
        {
            "trust": {"trustAllClients": True},
            "models": [model("tiny", {"workers": [worker]}, admission={"maxInFlight": 1})],
        },
        tmp_path,
    )
    body = {"model": "tiny", "prompt": "a short prompt", "max_tokens": 24, "ignore_eos": True}
    # a loud request runs long enough that the burst is queued before the first one finishes
    long_body = {**body, "max_tokens": 240}
    with running(worker, gateway):
        done: list[Any] = []
        loud = [
            threading.Thread(
                target=_fire, args=(gateway.url, long_body, {"x-tandem-tenant": "loud"}, done)
            )
            for _ in range(8)
        ]
        for thread in loud:
            thread.start()

        def admitted_and_waiting() -> tuple[float, float]:
            text = metrics(gateway.url)
            admitted = metric(
                text, "tandem_router_tenant_requests_total", tenant="loud", outcome="admitted"
            )
            return admitted, metric(text, "tandem_router_queue_waiting")

        # the whole loud burst has arrived (admitted or queued) before the quiet tenant does
        wait_until(lambda: sum(admitted_and_waiting()) == 8, timeout=30)
        ahead, _ = admitted_and_waiting()
        quiet = [
            threading.Thread(
                target=_fire, args=(gateway.url, body, {"x-tandem-tenant": "quiet"}, done)
            )
            for _ in range(2)
        ]
        for thread in quiet:
            thread.start()
        for thread in loud + quiet:
            thread.join(60)
        assert all(response.status_code == 200 for _, _, response in done)
        order = [tenant for _, tenant, _ in sorted(done, key=lambda d: d[0])]
        # First come first served would finish the quiet tenant's two last (places 9 and 10);
        # fair shares serve them among the next few, after the `ahead` loud ones already admitted.
        places = [i for i, tenant in enumerate(order) if tenant == "quiet"]
        assert len(places) == 2, order
        assert ahead <= 3, f"{ahead} loud requests were admitted before the quiet ones came"
        assert max(places) <= ahead + 4, order
        text = httpx.get(gateway.url + "/metrics", timeout=5).text
        for tenant, count in (("loud", 8), ("quiet", 2)):
            assert metric(text, "tandem_router_tenant_queue_seconds_count", tenant=tenant) == count
            admitted = metric(
                text, "tandem_router_tenant_requests_total", tenant=tenant, outcome="admitted"
            )
            assert admitted == count


def test_token_rate_limit_and_sheddable_band_answer_429_with_retry_after(tmp_path: Path) -> None:
    key = "sk-team-a"
    worker = served_as("tiny", None, speedup=1.0)
    gateway = Gateway(
        {
            "models": [
                model(
                    "tiny",
                    {"workers": [worker]},
                    apiKeys=[key, "sk-other"],
                    tenancy={
                        "tenants": [
                            {
                                "name": "team-a",
                                "keySha256": [hashlib.sha256(key.encode()).hexdigest()],
                                "rate": {"tokensPerSecond": 1, "burstTokens": 60},
                            }
                        ]
                    },
                    admission={"maxInFlight": 1, "maxQueue": 2},
                    scoring={
                        "predictive": {
                            "sloClasses": [
                                {"minPriority": -100},
                                {"minPriority": 10, "sheddable": True},
                            ]
                        }
                    },
                )
            ],
            "trust": {"adminKeys": ["sk-admin"]},
        },
        tmp_path,
    )
    small = {"model": "tiny", "prompt": "hello there", "max_tokens": 40}
    with running(worker, gateway):
        team_a = {"authorization": f"Bearer {key}"}
        assert post(gateway.url, small, **team_a).status_code == 200
        limited = post(gateway.url, small, **team_a)
        assert limited.status_code == 429
        assert limited.json()["error"]["type"] == "RateLimitError"
        assert int(limited.headers["retry-after"]) >= 20  # ~25 tokens short at 1 token/s
        assert post(gateway.url, small, authorization="Bearer sk-other").status_code == 200

        # One slot, two places in the queue: batch work of the sheddable band fills them, and an
        # interactive request pushes the newest of it out (429, Retry-After) instead of waiting.
        admin = {"authorization": "Bearer sk-admin"}
        slow = {**small, "max_tokens": 400, "ignore_eos": True}
        done: list[Any] = []
        batch = [
            threading.Thread(
                target=_fire, args=(gateway.url, slow, {**admin, "x-priority": "10"}, done)
            )
            for _ in range(3)
        ]
        for thread in batch:
            thread.start()

        def waiting() -> float:
            text = httpx.get(gateway.url + "/metrics", headers=admin, timeout=5).text
            return metric(text, "tandem_router_queue_waiting")

        wait_until(lambda: waiting() == 2, timeout=30)  # one batch request runs, two wait
        urgent = post(gateway.url, small, **admin)
        for thread in batch:
            thread.join(60)
        assert urgent.status_code == 200
        statuses = sorted(response.status_code for _, _, response in done)
        assert statuses == [200, 200, 429]
        shed = next(r for _, _, r in done if r.status_code == 429)
        assert int(shed.headers["retry-after"]) >= 1
        assert "ranked above" in shed.json()["error"]["message"]
        text = httpx.get(gateway.url + "/metrics", headers=admin, timeout=5).text
        assert metric(text, "tandem_router_rejected_total", reason="shed") == 1
        assert metric(text, "tandem_router_rejected_total", reason="rate_limit") == 1
        per_tenant = {
            (outcome, tenant): metric(
                text, "tandem_router_tenant_requests_total", tenant=tenant, outcome=outcome
            )
            for outcome in ("admitted", "rate_limit", "shed")
            for tenant in ("team-a", "key-" + hashlib.sha256(b"sk-admin").hexdigest()[:12])
        }
        # team-a's refused request was admitted first: its prompt is counted after the queue
        assert [v for (_, tenant), v in per_tenant.items() if tenant == "team-a"] == [2, 1, 0]
        assert [v for (_, tenant), v in per_tenant.items() if tenant != "team-a"] == [3, 0, 1]


@pytest.mark.parametrize("bad", [{"models": []}, {"models": [{"servedModelName": "a"}]}])
def test_gateway_config_is_checked(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"models|discovery"):
        GatewayConfig.model_validate(bad)
