"""Speculative decoding, static batching, KV capacity from the memory settings and the emulated
GPU gauges: scheduler and profile units."""

from __future__ import annotations

import json

import httpx
import pytest
from emu_harness import TINY_ARGS, emulator, metric_value
from test_emulator_scheduler import make as make_scheduler

from tandem.emulator.args import parse_args
from tandem.emulator.metrics import EmulatedGPU
from tandem.emulator.profile import GPUMemory, load_profile
from tandem.emulator.request import EngineRequest
from tandem.emulator.scheduler import Scheduler

pytestmark = pytest.mark.timeout(30)


def make(k: int = 0, static: bool = False, max_seqs: int = 8) -> Scheduler:
    return make_scheduler(
        num_blocks=256, max_seqs=max_seqs, budget=512, events=False,
        num_speculative_tokens=k, static_batching=static, seed=3,
    )  # fmt: skip


def request(rid: str, max_tokens: int, rate: float = 0.0, prompt: int = 40) -> EngineRequest:
    return EngineRequest(
        request_id=rid,
        prompt_token_ids=[hash(rid) % 500 + i for i in range(prompt)],
        max_tokens=max_tokens,
        arrival_time=0.0,
        acceptance_rate=rate,
    )


def steps_to_finish(s: Scheduler, limit: int = 2000) -> tuple[int, dict[str, int]]:
    """Steps until idle, and the step at which each request finished."""
    done: dict[str, int] = {}
    for step in range(1, limit):
        batch = s.schedule()
        if not batch:
            return step - 1, done
        for r in s.update(batch)[2]:
            s.kv.free(r)
            done[r.request_id] = step
    raise AssertionError("did not drain")


def test_full_acceptance_emits_k_plus_one_tokens_per_verify_step() -> None:
    s = make(k=4)
    r = request("a", max_tokens=101, rate=1.0)
    s.add(r)
    steps, _ = steps_to_finish(s)
    # one prefill step gives the first token, then 5 tokens per step: 100 more in 20 steps
    assert steps == 21
    assert r.num_output_tokens == 101
    assert s.spec_draft_tokens == 4 * s.spec_drafts
    assert s.spec_accepted_tokens == 4 * s.spec_drafts
    # the KV of every token but the last is computed, and its blocks hold them
    assert r.num_computed_tokens == r.num_tokens - 1


def test_zero_acceptance_is_plain_decoding_and_the_rate_sets_the_mean() -> None:
    s = make(k=4)
    s.add(request("none", max_tokens=50, rate=0.0))
    steps, _ = steps_to_finish(s)
    assert steps == 50
    assert s.spec_accepted_tokens == 0
    s = make(k=3)
    for i in range(8):
        s.add(request(f"r{i}", max_tokens=400, rate=0.6))
    steps_to_finish(s)
    # accepted per verify step: sum over i of 0.6^i for i = 1..3 = 1.176
    assert s.spec_accepted_tokens / s.spec_drafts == pytest.approx(0.6 + 0.36 + 0.216, abs=0.08)
    assert s.spec_accepted_per_pos[0] > s.spec_accepted_per_pos[1] > s.spec_accepted_per_pos[2]


def test_drafted_tokens_count_against_the_budget_and_reserve_kv() -> None:
    s = make(k=7)
    s.add(request("a", max_tokens=30, rate=0.0, prompt=31))
    s.update(s.schedule())  # prefill: first token
    batch = s.schedule()
    assert batch.decode_seqs == 1
    assert batch.total_tokens == 8
    assert batch.decodes[0].kv_capacity >= batch.decodes[0].num_computed_tokens + 8


def test_static_batching_admits_nobody_until_the_batch_drains() -> None:
    s = make(static=True, max_seqs=2)
    for rid, n in (("a", 5), ("b", 40), ("c", 5), ("d", 5)):
        s.add(request(rid, max_tokens=n))
    _, done = steps_to_finish(s)
    # c waits for b although a's slot freed at step 5: it starts only after b finished
    assert done["a"] < done["b"] < done["c"]
    assert done["c"] - done["b"] == 5
    s = make(static=False, max_seqs=2)
    for rid, n in (("a", 5), ("b", 40), ("c", 5), ("d", 5)):
        s.add(request(rid, max_tokens=n))
    _, done = steps_to_finish(s)
    assert done["c"] < done["b"]  # continuous batching: c took a's slot


def test_verify_cost_follows_the_h200_fit() -> None:
    profile = load_profile("h200-llama-3.1-8b")
    spec = profile.speculative
    assert spec.seconds("ngram", 0, 32, 32 * 1024) == 0.0
    # B=32, C=1024, k=4 measured 11.88 ms against 8.14 ms at k=0 (docs/profiles/)
    extra = spec.seconds("ngram", 4, 32, 32 * 1024)
    assert 0.0025 < extra < 0.0050
    # a draft model costs k of its own decode steps on top, an EAGLE head far less
    assert spec.seconds("draft_model", 4, 32, 32 * 1024) - extra > 4 * 0.002
    assert spec.seconds("eagle", 4, 32, 32 * 1024) - extra < 4 * 0.0006


def test_capacity_moves_with_gpu_memory_utilization_and_batched_tokens() -> None:
    profile = load_profile("h200-llama-3.1-8b")
    reference = profile.num_gpu_blocks(16, 0.9, 8192)
    assert reference == profile.capacity.num_gpu_blocks
    block_bytes = profile.model.kv_bytes_per_token * 16
    memory = profile.gpu_memory()
    lower = profile.num_gpu_blocks(16, 0.8, 8192)
    assert reference - lower == pytest.approx(0.1 * memory.total_bytes / block_bytes, abs=1)
    more_tokens = profile.num_gpu_blocks(16, 0.9, 32768)
    assert reference - more_tokens == pytest.approx(
        24576 * memory.activation_bytes_per_token / block_bytes, abs=1
    )
    # a profile without a memory model keeps its fixed capacity
    assert load_profile("llm-d-h100-8b").num_gpu_blocks(16, 0.5, 8192) == (
        load_profile("llm-d-h100-8b").capacity.num_gpu_blocks
    )


def test_emulated_gpu_reports_busy_fraction_and_memory() -> None:
    memory = GPUMemory(total_bytes=100 * 2**30, weights_bytes=16 * 2**30, non_torch_bytes=0,
                       activation_bytes_per_token=2**20)  # fmt: skip
    gpu = EmulatedGPU(memory, kv_block_bytes=2**20, engine_id="e", window_s=1.0)
    for i in range(10):  # busy 50 ms of every 100 ms
        gpu.step(i * 0.1, i * 0.1 + 0.05, kv_blocks_in_use=1024, tokens=512)
    assert gpu.utilisation(1.0) == pytest.approx(0.5)
    assert gpu.used_bytes(0.92) == 17 * 2**30 + 512 * 2**20  # a step in flight: activations
    assert gpu.used_bytes(0.99) == 17 * 2**30
    families = {f.name: f.samples[0].value for f in gpu.collect_at(0.99)}
    assert families == {"DCGM_FI_DEV_GPU_UTIL": 50.0, "DCGM_FI_DEV_FB_USED": 17 * 1024.0,
                        "DCGM_FI_DEV_FB_FREE": 83 * 1024.0}  # fmt: skip


def test_speculative_config_and_batching_flags_parse() -> None:
    rendered = json.dumps({"method": "eagle", "num_speculative_tokens": 4, "model": "x/eagle"})
    config, ignored, _ = parse_args(
        [
            "serve",
            "m",
            "--speculative-config",
            rendered,
            "--spec-acceptance-rate",
            "0.4",
            "--batching",
            "static",
            "--static-batch-wait",
            "0.05",
        ]
    )
    assert ignored == []
    assert config.speculative_config is not None
    assert (
        config.speculative_config.proposer,
        config.speculative_config.num_speculative_tokens,
    ) == ("eagle", 4)
    assert (config.spec_acceptance_rate, config.batching, config.static_batch_wait_s) == (
        0.4,
        "static",
        0.05,
    )
    inferred = parse_args(
        ["m", "--speculative-config", '{"model": "yuhuili/EAGLE-LLaMA3.1-Instruct-8B"}']
    )
    assert inferred[0].speculative_config is not None
    assert inferred[0].speculative_config.proposer == "eagle"
    assert (
        parse_args(["m", "--speculative-config", '{"num_speculative_tokens": 3}'])[
            0
        ].speculative_config.proposer
        == "ngram"
    )  # type: ignore[union-attr]


def test_a_request_sets_its_acceptance_rate_through_vllm_xargs() -> None:
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3})
    with emulator([*TINY_ARGS, "--speculative-config", spec]) as engine:
        for rate in (1.0, 0.0):
            body = {"model": "tiny", "prompt": "hello there", "max_tokens": 40, "ignore_eos": True,
                    "vllm_xargs": {"spec_acceptance_rate": rate}}  # fmt: skip
            answer = httpx.post(f"{engine.url}/v1/completions", json=body, timeout=30).json()
            assert answer["usage"]["completion_tokens"] == 40
        text = httpx.get(f"{engine.url}/metrics", timeout=10).text
    drafts = metric_value(text, "vllm:spec_decode_num_drafts_total")
    accepted = metric_value(text, "vllm:spec_decode_num_accepted_tokens_total")
    # rate 1: 39 tokens after the first in 10 verify steps (3 accepted + 1 each, the last cut);
    # rate 0: 39 steps of one token, none accepted
    assert drafts == 10 + 39
    assert accepted >= 27
    assert metric_value(text, "vllm:spec_decode_num_draft_tokens_total") == 3 * drafts
    assert metric_value(text, "DCGM_FI_DEV_FB_USED") > 15_000
