"""Parity of the router's config file and a ServingCluster: every router setting is either set from
the spec, decided by the operator, or deliberately not exposed, and each policy field reaches the
router exactly as written in the ServingCluster."""

from __future__ import annotations

import re
from typing import Any, get_args, get_origin

import pytest
from pydantic import BaseModel
from sc_manifests import cluster

from tandem.operator.api import ServingCluster
from tandem.operator.api_router import RouterSpec
from tandem.operator.crd import openapi_schema
from tandem.operator.router_render import router_config
from tandem.router.config import RouterConfig

# RouterConfig field -> RouterSpec field carrying it (`spec.router.*`).
FROM_ROUTER_SPEC = {
    "scoring": "scoring",
    "disaggregation": "disaggregation",
    "admission": "admission",
    "tenancy": "tenancy",
    "timeouts": "timeouts",
    "metrics_scrape_interval_s": "metrics_scrape_interval_seconds",
    "tokenizer": "tokenizer",
    "log_level": "log_level",
    "processes": "processes",
}
# Taken from elsewhere in the spec: the model's name and the engines' block hashing.
# chat_template / chat_template_kwargs: the engines' own --chat-template flags (tokenizer.py)
FROM_OTHER_SPEC = {
    "served_model_name",
    "block_size",
    "hash_algo",
    "hash_seed",
    "chat_template",
    "chat_template_kwargs",
    "epp",  # spec.inferencePool (ports of the endpoint picker and the relays)
}
# Decided by the operator: where the router listens and finds its engines; KV events are always
# rendered on the engines, so the router always subscribes; `auth` holds the paths where the
# operator mounts the Secrets that `spec.router.auth` names; `trust` its admin port.
SET_BY_OPERATOR = {"host", "port", "kubernetes", "static", "kv_events", "auth", "trust"}
# Not settable from a ServingCluster (yet): API keys want a Secret reference; the operator renders
# no vLLM renderer service for `render_url`/`render_mode`; the others are internal bounds with
# safe defaults.
NOT_EXPOSED = {
    "http",  # client-connection limits (docs/reliability.md), safe defaults
    "health_check_interval_s",
    "index_max_blocks_per_engine",
    "api_keys",
    "render_url",
    "render_mode",
    "pending_ttl_s",
    "catch_up_s",
}
POLICY = ("scoring", "disaggregation", "admission", "timeouts")


def test_every_router_setting_is_accounted_for() -> None:
    groups = [set(FROM_ROUTER_SPEC), FROM_OTHER_SPEC, SET_BY_OPERATOR, NOT_EXPOSED]
    assert sum(len(g) for g in groups) == len(set().union(*groups)), "a field listed twice"
    assert set(RouterConfig.model_fields) == set().union(*groups)


def test_policy_sections_are_the_routers_own_models() -> None:
    for name in POLICY:
        assert (
            RouterSpec.model_fields[name].annotation is RouterConfig.model_fields[name].annotation
        )


def _policy_model(section: str) -> type[BaseModel]:
    model = RouterConfig.model_fields[section].annotation
    assert isinstance(model, type)
    assert issubclass(model, BaseModel)
    return model


# Fields whose bounds `default * 2 + 3` would leave, and literals: a valid other value each.
OTHER_VALUES: dict[str, Any] = {
    "mode": "always",
    "policy": "predictive",
    "running_weight": 0.5,
    "forget": 0.9,
    "meet_probability": 0.75,
    "interference_budget": 0.5,
    "min_priority": 5,
}


def _changed(model: type[BaseModel]) -> dict[str, Any]:
    """A value other than the default for every field of `model`, by alias, within its bounds
    (a nested model's fields all changed too, a list of models as one such item)."""
    values: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        default = field.default
        annotation = field.annotation
        if name in OTHER_VALUES:
            value: Any = OTHER_VALUES[name]
        elif isinstance(annotation, type) and issubclass(annotation, BaseModel):
            value = _changed(annotation)
        elif get_origin(annotation) is list:
            (item,) = get_args(annotation)
            value = [_changed(item)]
        elif isinstance(default, str):
            value = "x-other"
        elif default is None:
            value = 7
        elif isinstance(default, bool):
            value = not default
        else:
            value = type(default)(default * 2 + 3)
        values[field.alias or name] = value
    return values


@pytest.mark.parametrize("section", POLICY)
def test_every_policy_field_set_in_a_servingcluster_reaches_the_router(section: str) -> None:
    model = _policy_model(section)
    written = _changed(model)
    config = router_config(cluster(router={section: written}))
    assert getattr(config, section).model_dump(by_alias=True) == written


@pytest.mark.parametrize("section", POLICY)
def test_the_crd_schema_has_every_policy_field(section: str) -> None:
    model = _policy_model(section)
    router = openapi_schema()["properties"]["spec"]["properties"]["router"]
    alias = RouterSpec.model_fields[section].alias or section
    properties = router["properties"][alias]["properties"]
    assert set(properties) == {f.alias or n for n, f in model.model_fields.items()}
    assert all(p.get("description") for p in properties.values())


def test_top_level_router_settings_reach_the_router() -> None:
    sc = cluster(
        router={
            "metricsScrapeIntervalSeconds": 2.5,
            "tokenizer": "/models/tok",
            "logLevel": "debug",
        }
    )
    config = router_config(sc)
    for config_field, spec_field in FROM_ROUTER_SPEC.items():
        if config_field not in POLICY:
            assert getattr(config, config_field) == getattr(sc.spec.router, spec_field)


def _budgets(sc: ServingCluster) -> tuple[int | None, int | None]:
    predictive = router_config(sc).scoring.predictive
    return predictive.prefill_chunk_tokens, predictive.prefill_pool_chunk_tokens


def test_the_predictive_step_budgets_are_the_pools_own_unless_the_router_sets_them() -> None:
    """The router's cost models chunk prefills at the budget each pool's engines run with: its
    last --max-num-batched-tokens, an extraArgs override included."""
    pools = {
        "decode": {"maxNumBatchedTokens": 2048},
        "prefill": {"maxNumBatchedTokens": 16384, "extraArgs": ["--max-num-batched-tokens=12288"]},
    }
    assert _budgets(cluster(**pools)) == (2048, 12288)
    assert _budgets(cluster()) == (8192, 8192)
    set_by_router = {"scoring": {"predictive": {"prefillChunkTokens": 4096}}}
    assert _budgets(cluster(**pools, router=set_by_router)) == (4096, 12288)
    colocated = {"disaggregation": {"mode": "never"}}
    assert _budgets(cluster(decode={"maxNumBatchedTokens": 2048}, router=colocated)) == (2048, None)


@pytest.mark.parametrize("value", ["lots", "0"])
def test_a_step_budget_no_engine_could_run_is_refused_by_name(value: str) -> None:
    sc = cluster(engine={"extraArgs": ["--max-num-batched-tokens", value]})
    with pytest.raises(
        ValueError, match=re.escape(f"spec.decode: --max-num-batched-tokens {value!r}")
    ):
        router_config(sc)
