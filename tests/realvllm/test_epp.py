"""Real vLLM behind Envoy and Tandem's endpoint picker: the official `openai` client through a real
Envoy (ext_proc, FULL_DUPLEX_STREAMED) to `tandem relay` beside the real decode engine, which
prefills on the real prefill engine the picker named; the engines' own counters prove the P/D
path."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from epp.epp_harness import Envoy, Relay
from harness import PDCluster, Router, metrics_of, stream_completion
from test_pd import LONG_PROMPT, assert_went_through_prefill_and_decode

from tandem.common.ports import free_port
from tandem.router.epp.config import EppConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def gateway(pd_cluster: PDCluster) -> Iterator[tuple[Router, Envoy]]:
    pd_cluster.ensure_engines()
    # the engines take the run's engine key, as from the router
    key = pd_cluster.plan.router_config.auth.engine_key
    extra: list[str] = []
    if key:
        key_file = pd_cluster.run_dir / "relay-engine-key"
        key_file.write_text(key)
        extra = ["--engine-key-file", str(key_file)]
    relay = Relay(pd_cluster.decode.url, extra)
    relay.wait_ready()
    epp = EppConfig(port=free_port(), relays={pd_cluster.decode.url: f"127.0.0.1:{relay.port}"})
    router = pd_cluster.router("router-epp", tokenizer=None, epp=epp)
    envoy = Envoy(epp.port)
    try:
        envoy.wait_ready()
        yield router, envoy
    finally:
        envoy.stop()
        router.stop()
        relay.stop()


def test_openai_client_through_envoy_prefills_and_decodes_on_real_vllm(
    pd_cluster: PDCluster, gateway: tuple[Router, Envoy]
) -> None:
    _, envoy = gateway
    before = metrics_of(pd_cluster.prefill.url), metrics_of(pd_cluster.decode.url)
    raw = stream_completion(envoy.url, LONG_PROMPT + "through the gateway", 8)
    assert raw.headers["x-tandem-route"] == "disaggregated"
    assert raw.headers["x-tandem-prefill-engine"] == pd_cluster.prefill.url
    chunks = list(raw.parse())
    usage = chunks[-1].usage
    assert usage is not None
    assert usage.completion_tokens == 8
    assert_went_through_prefill_and_decode(pd_cluster, before, usage.prompt_tokens)
