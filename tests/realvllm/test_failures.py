"""Engines that die under a request: a prefill engine killed between its answer and the decode
engine's KV pull (the request must still be answered), and a decode engine killed mid-stream
(the client must get a terminal error, not a hang). Each test kills a real engine; the shared pair
is restarted before the next test that needs it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import openai
import pytest
from engine_standin import EngineStandIn
from harness import (
    PDCluster,
    metrics_of,
    openai_client,
    stop_core_while_running,
    stream_completion,
)

from tandem.common.routing import DisaggregationConfig
from tandem.router.config import StaticDiscovery, StaticEndpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPT = "A prompt whose KV cache the decode engine will not be able to pull. " * 15


@pytest.fixture
def standin(pd: PDCluster) -> Iterator[EngineStandIn]:
    standin = EngineStandIn(pd.prefill.url)
    yield standin
    standin.stop()


def test_prefill_killed_after_its_answer_still_answers_the_client(
    pd: PDCluster, standin: EngineStandIn
) -> None:
    """The prefill engine is SIGKILLed right after it answered, so the decode engine's NIXL pull
    meets a dead peer. The decode pool's `kv_load_failure_policy: recompute` (rendered by the
    operator) recomputes the prompt there, and the router would retry once without remote prefill
    if the decode answer still failed: either way the client gets its tokens."""
    plan = pd.plan.router_config
    assert plan.static is not None
    # The stand-in relays the prefill engine's answers, which name that engine's side channel.
    side_channel = plan.static.prefill[0].side_channel_port
    stand_in = StaticEndpoint(url=standin.url, side_channel_port=side_channel)
    static = StaticDiscovery(prefill=[stand_in], decode=plan.static.decode)
    router = pd.router("router-standin", tokenizer=None, static=static)
    try:
        # One relayed request first: the decode engine's NIXL handshake with this prefill engine is
        # done, so the next pull fails on the transfer itself (a dead peer), not the handshake.
        warm = openai_client(router.url).completions.create(
            model="tiny", prompt=PROMPT + "warm", max_tokens=2
        )
        assert warm.usage is not None
        before = metrics_of(pd.decode.url)

        def kill_prefill() -> None:
            pd.prefill.kill()
            # A pull the decode engine posts before its transport has seen the peer's death waits
            # in vLLM 0.32 for ever (docs/reliability.md): the client gets the router's 504 after
            # decodeIdleSeconds. This test is about a pull that meets a peer known to be dead.
            time.sleep(1.0)

        standin.arm(kill_prefill)
        started = time.monotonic()
        raw = stream_completion(router.url, PROMPT + "after the kill", 8)
        chunks = list(raw.parse())
        elapsed = time.monotonic() - started
        assert standin.kills == 1
        assert not pd.prefill.alive()
        usage = chunks[-1].usage
        assert usage is not None
        assert usage.completion_tokens == 8
        after = metrics_of(pd.decode.url)
        failed = after["vllm:nixl_num_failed_transfers_total"] - before.get(
            "vllm:nixl_num_failed_transfers_total", 0
        )
        retries = metrics_of(router.url).get(
            "tandem_router_retries_total{pool=decode,reason=kv_transfer}", 0.0
        )
        print(
            f"prefill killed: answered in {elapsed:.2f} s, failed pulls {failed}, router retries {retries}"
        )
        assert failed == 1  # the pull did meet the dead engine
    finally:
        router.stop()


class StreamReader(threading.Thread):
    """Reads a long stream from the router to its end, counting chunks: how it ended and when."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.chunks = 0
        self.error: Exception | None = None  # an openai.APIError from the router's error event
        self.ended_at: float | None = None
        self.start()

    def run(self) -> None:
        try:
            stream = openai_client(self.url).completions.create(
                model="tiny",
                prompt=PROMPT,
                max_tokens=1800,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            for _ in stream:
                self.chunks += 1
        except Exception as error:  # asserted by the test, whatever it is
            self.error = error
        finally:
            self.ended_at = time.monotonic()


def test_decode_killed_mid_stream_ends_the_clients_stream_with_an_error(
    pd_cluster: PDCluster,
) -> None:
    """The decode engine is SIGKILLed once the client has 3 chunks of a long stream and the engine
    still runs it (checked with its EngineCore stopped: a client starved on a loaded machine reads
    late, and an engine on a quiet one decodes fast): the client's stream ends with the router's
    error."""
    # Only the decode engine streams here: a prefill engine killed by the test before is not
    # restarted for it (that costs a minute on this machine).
    pd = pd_cluster
    pd.ensure_engines(pd.decode)
    router = pd.router(
        "router-midstream", tokenizer=None, disaggregation=DisaggregationConfig(mode="never")
    )
    try:
        reader = StreamReader(router.url)
        caught = stop_core_while_running(
            pd.decode,
            requests=1,
            ready=lambda: reader.chunks >= 3,
            ended=lambda: reader.ended_at is not None,
        )
        assert caught, f"the stream ended ({reader.chunks} chunks, {reader.error!r}) unkilled"
        killed_at = time.monotonic()
        pd.decode.kill()
        reader.join(60)
        assert reader.ended_at is not None, "the client's stream hangs after the kill"
        ended_after = reader.ended_at - killed_at
        print(
            f"decode killed after {reader.chunks} chunks read: the client's stream ended "
            f"{ended_after:.2f} s later: {reader.error!r}"
        )
        assert reader.error is not None, f"the stream ended whole after {reader.chunks} chunks"
        assert isinstance(reader.error, openai.APIError), repr(reader.error)
        assert "decode engine failed mid-stream" in str(reader.error)
        assert ended_after < 30
    finally:
        router.stop()
