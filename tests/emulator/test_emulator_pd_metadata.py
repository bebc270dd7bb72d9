"""P/D pairs: without NIXL (metadata and leases only), and vLLM's counters after the golden exchange."""

from __future__ import annotations

import time

import httpx
import pytest
from emu_harness import GOLDEN, counter_values, golden_request, metric_value
from test_emulator_pd_nixl import do_decode, do_prefill, metrics, pd_engines

pytestmark = pytest.mark.timeout(60)


def test_pd_without_nixl_moves_no_bytes_but_releases_the_blocks() -> None:
    with pd_engines(["--no-nixl"]) as (prefill, decode):
        params = do_prefill(prefill)["kv_transfer_params"]
        r = do_decode(decode, params, stream=False)
        assert r.status_code == 200
        assert r.json()["usage"]["completion_tokens"] == 8
        text = metrics(decode)
        assert metric_value(text, "vllm:nixl_bytes_transferred_count") == 0
        external = 'vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",source="external_kv_transfer"}'
        assert metric_value(text, external) == params["remote_num_tokens"]
        assert metric_value(metrics(prefill), "vllm:kv_cache_usage_perc") == 0


def test_golden_pd_exchange_gives_vllms_counters() -> None:
    """golden/pd/main 01 (prefill) then 02 (decode, with our prefill's params) on a fresh pair leave
    the non-timing values of 03 and 04 (bytes aside: the emulator moves a scaled-down KV)."""
    folder = GOLDEN / "pd" / "main"
    with pd_engines([]) as (prefill, decode):
        path, body = golden_request(folder / "01_prefill.req.http")
        first = httpx.post(prefill.url + path, json=body, timeout=20)
        assert first.status_code == 200
        path, body = golden_request(folder / "02_decode_stream.req.http")
        body["kv_transfer_params"] = first.json()["kv_transfer_params"]
        assert httpx.post(decode.url + path, json=body, timeout=20).status_code == 200
        time.sleep(0.3)  # the read notification reaches the prefill engine
        for engine, golden_file in (
            (prefill, "03_prefill_metrics.txt"),
            (decode, "04_decode_metrics.txt"),
        ):
            mine = counter_values(metrics(engine))
            golden = counter_values((folder / golden_file).read_text())
            differing = {
                k: (mine.get(k), v)
                for k, v in golden.items()
                if mine.get(k) != v and "nixl_bytes" not in k
            }
            assert not differing, golden_file
