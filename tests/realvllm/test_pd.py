"""The official `openai` client through `tandem router` in front of a real vLLM prefill/decode pair:
streaming completions and chat, the P/D path proven by the engines' own metrics, and client-given
`kv_transfer_params` that never reach an engine."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from harness import PDCluster, Router, metrics_of, openai_client, stream_completion

from tandem.bench.client import request_body
from tandem.bench.workloads import PlannedRequest
from tandem.common.routing import DisaggregationConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

LONG_PROMPT = "Prefill and decode run apart; the decode engine pulls the prompt's KV cache. " * 12


@pytest.fixture(scope="module")
def router(pd_cluster: PDCluster) -> Iterator[Router]:
    # No tokenizer: this router routes on its approximate index. What these tests prove (the
    # client, the P/D handoff, the stripped params) does not depend on exact tokenization, which
    # is test_parity's subject.
    pd_cluster.ensure_engines()
    router = pd_cluster.router("router-pd", tokenizer=None)
    yield router
    router.stop()


def changed(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def assert_went_through_prefill_and_decode(
    pd: PDCluster, before: tuple[dict[str, float], dict[str, float]], prompt_tokens: int
) -> None:
    """The engines' own counters: the prefill engine finished the request after one token and the
    decode engine took the prompt's KV from it over NIXL instead of computing it."""
    prefill, decode = metrics_of(pd.prefill.url), metrics_of(pd.decode.url)
    assert changed(before[0], prefill, "vllm:request_success_total{finished_reason=length}") == 1
    assert changed(before[0], prefill, "vllm:prompt_tokens_total") == prompt_tokens
    p2p = changed(before[1], decode, "vllm:prompt_tokens_cached_by_source_total{source=p2p}")
    local = changed(before[1], decode, "vllm:prompt_tokens_cached_by_source_total{source=device}")
    assert p2p > 0
    assert p2p + local == prompt_tokens
    assert changed(before[1], decode, "vllm:nixl_xfer_time_seconds_count") == 1
    assert changed(before[1], decode, "vllm:nixl_num_failed_transfers_total") == 0


def test_openai_client_streams_completions_through_prefill_and_decode(
    pd: PDCluster, router: Router
) -> None:
    before = metrics_of(pd.prefill.url), metrics_of(pd.decode.url)
    raw = stream_completion(router.url, LONG_PROMPT + "completions", 12)
    assert raw.headers["x-tandem-route"] == "disaggregated"
    assert raw.headers["x-tandem-prefill-engine"] == pd.prefill.url
    chunks = list(raw.parse())
    usage = chunks[-1].usage
    assert usage is not None
    assert usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert_went_through_prefill_and_decode(pd, before, usage.prompt_tokens)


def test_openai_client_streams_chat_through_prefill_and_decode(
    pd: PDCluster, router: Router
) -> None:
    before = metrics_of(pd.prefill.url), metrics_of(pd.decode.url)
    raw = openai_client(router.url).chat.completions.with_raw_response.create(
        model="tiny",
        messages=[
            {"role": "system", "content": LONG_PROMPT},
            {"role": "user", "content": "Stream a short answer."},
        ],
        max_tokens=10,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    assert raw.headers["x-tandem-route"] == "disaggregated"
    chunks = list(raw.parse())
    assert chunks[0].choices[0].delta.role == "assistant"
    usage = chunks[-1].usage
    assert usage is not None
    assert usage.completion_tokens == 10
    assert_went_through_prefill_and_decode(pd, before, usage.prompt_tokens)


def test_a_length_hidden_from_the_router_ends_where_planned_after_a_handoff(
    pd: PDCluster, router: Router
) -> None:
    """`tandem bench --length-cap`'s body on real vLLM: max_tokens is the cap, and min_tokens,
    stop_token_ids and a +100 logit_bias end the answer at its planned length. The prefill leg
    (max_tokens 1, min_tokens dropped) ends on the stop token and still hands its KV over."""
    planned = PlannedRequest(
        index=0, at_s=0.0, prompt=LONG_PROMPT + "hidden length", prefix="", prompt_words=0,
        max_tokens=7, klass="default", phase="trace",
    )  # fmt: skip
    body = request_body(planned, "completions", "tiny", ignore_eos=True, length_cap=32)
    assert body["max_tokens"] == 32
    before = metrics_of(pd.prefill.url), metrics_of(pd.decode.url)
    raw = openai_client(router.url).completions.with_raw_response.create(
        model="tiny",
        prompt=body["prompt"],
        max_tokens=body["max_tokens"],
        stream=True,
        stream_options={"include_usage": True},
        extra_body={
            k: body[k] for k in ("ignore_eos", "min_tokens", "stop_token_ids", "logit_bias")
        },
    )
    assert raw.headers["x-tandem-route"] == "disaggregated"
    chunks = list(raw.parse())
    usage = chunks[-1].usage
    assert usage is not None
    assert usage.completion_tokens == 7
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    prefill, decode = metrics_of(pd.prefill.url), metrics_of(pd.decode.url)
    assert changed(before[0], prefill, "vllm:request_success_total{finished_reason=stop}") == 1
    assert changed(before[1], decode, "vllm:nixl_xfer_time_seconds_count") == 1
    assert changed(before[1], decode, "vllm:nixl_num_failed_transfers_total") == 0


INJECTED_ENGINE_ID = "injected-0000-4000-8000-client"


@pytest.mark.parametrize("mode", ["always", "never"])
def test_client_kv_transfer_params_never_reach_an_engine(
    pd: PDCluster, router: Router, mode: str
) -> None:
    """A client's params naming a foreign engine and host are dropped on both paths: replaced by
    the prefill engine's own (P/D), or removed (decode prefills itself)."""
    target = router
    if mode == "never":
        target = pd.router(
            "router-local", tokenizer=None, disaggregation=DisaggregationConfig(mode="never")
        )
    before = metrics_of(pd.decode.url)
    stripped_before = metrics_of(target.url).get(
        "tandem_router_stripped_kv_transfer_params_total", 0
    )
    answer = openai_client(target.url).completions.with_raw_response.create(
        model="tiny",
        prompt=LONG_PROMPT + f"injected {mode}",
        max_tokens=4,
        extra_body={
            "kv_transfer_params": {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": INJECTED_ENGINE_ID,
                "remote_request_id": "cmpl-injected-0",
                "remote_host": "10.255.255.1",
                "remote_port": 5600,
                "remote_block_ids": [[1, 2, 3]],
            }
        },
    )
    assert answer.http_response.status_code == 200
    assert answer.headers["x-tandem-route"] == ("disaggregated" if mode == "always" else "local")
    assert answer.parse().usage is not None
    after = metrics_of(pd.decode.url)
    assert changed(before, after, "vllm:nixl_num_failed_transfers_total") == 0
    expected_pulls = 1 if mode == "always" else 0
    assert changed(before, after, "vllm:nixl_xfer_time_seconds_count") == expected_pulls
    stripped = metrics_of(target.url)["tandem_router_stripped_kv_transfer_params_total"]
    assert stripped == stripped_before + 1
    for engine in (pd.prefill, pd.decode):
        assert INJECTED_ENGINE_ID not in engine.log_text()
    if target is not router:
        target.stop()
