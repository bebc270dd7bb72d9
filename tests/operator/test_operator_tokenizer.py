"""The tokenizer in the router pod: fetched from the Hub by an init container, mounted from the
model volume, or named by the manifest; without any, status and an Event say the router routes on
its approximation. Rendered objects are validated against Kubernetes' own schemas."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import yaml
from sc_manifests import cluster, minimal
from test_operator_handlers import Events, FakeKube, mark_ready, run

from tandem.operator.render import render
from tandem.operator.status import aggregate_status
from tandem.operator.tokenizer import FETCH_CONTAINER, TOKENIZER_DIR, router_tokenizer
from tandem.router.config import RouterConfig

K8S_VERSION = "1.34"


def router_pod(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (deployment,) = [
        o
        for o in objects
        if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-router")
    ]
    kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)
    pod: dict[str, Any] = deployment["spec"]["template"]["spec"]
    return pod


def router_config_of(objects: list[dict[str, Any]]) -> RouterConfig:
    (config_map,) = [o for o in objects if o["kind"] == "ConfigMap"]
    return RouterConfig.model_validate(yaml.safe_load(config_map["data"]["router.yaml"]))


def test_a_hub_model_gets_an_init_container_that_fetches_only_the_tokenizer() -> None:
    sc = cluster(
        model={
            "name": "meta-llama/Llama-3.1-8B-Instruct",
            "revision": "v1",
            "hfTokenSecret": {"name": "hf", "key": "token"},
        }
    )
    objects = render(sc)
    pod = router_pod(objects)
    (fetch,) = pod["initContainers"]
    assert fetch["name"] == FETCH_CONTAINER
    assert (
        fetch["image"] == sc.spec.engine.image
    )  # no custom image: the engine's has the Hub client
    assert fetch["args"][:3] == ["meta-llama/Llama-3.1-8B-Instruct", "v1", TOKENIZER_DIR]
    assert "tokenizer*" in fetch["args"]
    assert not any("safetensors" in a or a == "*" for a in fetch["args"])
    token = {e["name"]: e for e in fetch["env"]}["HF_TOKEN"]
    assert token["valueFrom"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
    assert fetch["securityContext"]["readOnlyRootFilesystem"] is True
    (router,) = pod["containers"]
    assert {"name": "tokenizer", "mountPath": TOKENIZER_DIR, "readOnly": True} in router[
        "volumeMounts"
    ]
    assert {"name": "tokenizer", "emptyDir": {"sizeLimit": "1Gi"}} in pod["volumes"]
    assert router_config_of(objects).tokenizer == TOKENIZER_DIR


def test_a_separate_tokenizer_id_is_fetched_without_the_models_revision() -> None:
    sc = cluster(model={"name": "org/model", "revision": "v2", "tokenizer": "org/tok"})
    (fetch,) = router_pod(render(sc))["initContainers"]
    assert fetch["args"][:2] == ["org/tok", ""]


def test_a_model_on_the_model_volume_is_mounted_read_only_in_the_router() -> None:
    sc = cluster(
        model={
            "name": "/models/llama-3",
            "cache": {"pvc": "weights", "subPath": "hf", "readOnly": True},
        }
    )
    objects = render(sc)
    pod = router_pod(objects)
    assert "initContainers" not in pod
    assert {
        "name": "model-cache",
        "persistentVolumeClaim": {"claimName": "weights", "readOnly": True},
    } in pod["volumes"]
    (router,) = pod["containers"]
    assert {
        "name": "model-cache",
        "mountPath": "/models",
        "readOnly": True,
        "subPath": "hf",
    } in router["volumeMounts"]
    assert router_config_of(objects).tokenizer == "/models/llama-3"


def test_a_configured_router_tokenizer_wins() -> None:
    sc = cluster(router={"tokenizer": "/opt/tokenizer"})
    objects = render(sc)
    assert "initContainers" not in router_pod(objects)
    assert router_config_of(objects).tokenizer == "/opt/tokenizer"


def test_without_a_source_the_status_and_an_event_say_routing_is_approximate() -> None:
    sc = cluster(model={"name": "/opt/baked-into-the-image"})
    assert not router_tokenizer(sc).exact
    objects = render(sc)
    assert "initContainers" not in router_pod(objects)
    assert router_config_of(objects).tokenizer is None
    status = aggregate_status(sc, {}, "2026-12-01T00:00:00Z")
    (condition,) = [c for c in status.conditions if c.type == "ExactTokenization"]
    assert (condition.status, condition.reason) == ("False", "NoTokenizerSource")
    assert "spec.model.cache" in condition.message

    kube, events = FakeKube(), Events()
    kube.add_cluster(minimal(model={"name": "/opt/baked-into-the-image"}))
    run(kube, events)
    assert events.reasons() == ["Applied", "ApproximateRouting", "Pending"]
    mark_ready(kube)
    run(kube, events)  # the same generation again: no second warning
    assert events.reasons().count("ApproximateRouting") == 1
    conditions = {c["type"]: c for c in kube.cluster()["status"]["conditions"]}
    assert conditions["ExactTokenization"]["status"] == "False"


def test_a_hub_model_reports_exact_tokenization() -> None:
    status = aggregate_status(cluster(), {}, "2026-12-01T00:00:00Z")
    (condition,) = [c for c in status.conditions if c.type == "ExactTokenization"]
    assert (condition.status, condition.reason) == ("True", "FetchedFromHub")


def test_the_engines_inline_chat_template_and_kwargs_reach_the_router() -> None:
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    sc = cluster(
        engine={
            "extraArgs": [
                "--chat-template",
                template,
                '--default-chat-template-kwargs={"enable_thinking": false}',
            ]
        }
    )
    config = router_config_of(render(sc))
    assert config.chat_template == template
    assert config.chat_template_kwargs == {"enable_thinking": False}
    assert router_tokenizer(sc).exact


def test_a_chat_template_file_on_the_model_volume_is_read_there() -> None:
    sc = cluster(
        model={"name": "/models/llama-3", "cache": {"pvc": "models", "mountPath": "/models"}},
        decode={"extraArgs": ["--chat-template=/models/templates/chat.jinja"]},
    )
    assert router_config_of(render(sc)).chat_template == "/models/templates/chat.jinja"
    assert router_tokenizer(sc).exact


def test_a_chat_template_file_the_router_cannot_read_makes_routing_approximate() -> None:
    sc = cluster(engine={"extraArgs": ["--chat-template", "/etc/vllm/chat.jinja"]})
    source = router_tokenizer(sc)
    assert source.path is not None
    assert not source.exact
    assert "/etc/vllm/chat.jinja" in source.message
    assert router_config_of(render(sc)).chat_template is None
    status = aggregate_status(sc, {}, "2026-12-01T00:00:00Z")
    (condition,) = [c for c in status.conditions if c.type == "ExactTokenization"]
    assert (condition.status, condition.reason) == ("False", "ChatTemplateUnreadable")
