"""vLLM's Prometheus metrics (names, types, labels, buckets, help texts of vLLM 0.32) for one engine."""

from __future__ import annotations

import socket
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from tandem.common.metrics import Counter, Histogram
from tandem.emulator.lora import LoraAdapters
from tandem.emulator.profile import GPUMemory

if TYPE_CHECKING:
    from tandem.emulator.scheduler import Scheduler

TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
)  # fmt: skip
REQUEST_TIME_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)
PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
NIXL_TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
NIXL_POST_BUCKETS = (0.001, *NIXL_TIME_BUCKETS)
NIXL_BYTES_BUCKETS = tuple(float(2048 * 4**i) for i in range(12))
NIXL_DESCRIPTOR_BUCKETS = (10, 20, 30, 50, 75, 100, 200, 400, 1000, 2000, 4000, 10000, 20000, 50000)

FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
CACHED_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")

# vLLM's help texts, keyed by the exposed name.
HELP = {
    "vllm:nixl_xfer_time_seconds": "Histogram of transfer duration for NIXL KV Cache transfers.",
    "vllm:nixl_post_time_seconds": "Histogram of transfer post time for NIXL KV Cache transfers.",
    "vllm:nixl_bytes_transferred": "Histogram of bytes transferred per NIXL KV Cache transfers.",
    "vllm:nixl_num_descriptors": "Histogram of number of descriptors per NIXL  KV Cache transfers.",
    "vllm:nixl_num_failed_transfers_total": "Number of failed NIXL KV Cache transfers, including handshake and notification failures. NOTE: KV expiry is tracked separately in vllm:nixl_num_kv_expired_reqs.",
    "vllm:nixl_num_failed_notifications_total": "Number of failed NIXL KV Cache notifications. Retained for compatibility; these failures are also included in vllm:nixl_num_failed_transfers.",
    "vllm:nixl_num_kv_expired_reqs_total": "Number of requests that had their KV expire. NOTE: This metric is tracked on the P instance.",
    "vllm:nixl_num_notifications_after_expiry_total": "Number of completion notifications for requests that were no longer tracked, usually because their KV lease expired. The KV blocks may have been reused before the transfer finished. Counted per notification (one per remote rank), not per request.",
    "vllm:estimated_flops_per_gpu_total": "Estimated number of floating point operations per GPU (for Model Flops Utilization calculations).",
    "vllm:estimated_read_bytes_per_gpu_total": "Estimated number of bytes read from memory per GPU (for Model Flops Utilization calculations).",
    "vllm:estimated_write_bytes_per_gpu_total": "Estimated number of bytes written to memory per GPU (for Model Flops Utilization calculations).",
    "vllm:num_requests_running": "Number of requests in model execution batches.",
    "vllm:num_requests_waiting": "Number of requests waiting to be processed.",
    "vllm:num_requests_waiting_by_reason": "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.",
    "vllm:num_requests_kv_fetch_by_stage": "Number of waiting requests by async KV load stage. Stage labels: 'waiting_to_start' = needs an async KV load that has not started; 'in_progress' = load started and not yet reported finished; 'completed_waiting' = load finished, request not running yet.",
    "vllm:engine_sleep_state": "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
    "vllm:kv_cache_usage_perc": "KV-cache usage. 1 means 100 percent usage.",
    "vllm:prefix_cache_queries_total": "Prefix cache queries, in terms of number of queried tokens.",
    "vllm:prefix_cache_hits_total": "Prefix cache hits, in terms of number of cached tokens.",
    "vllm:external_prefix_cache_queries_total": "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of queried tokens.",
    "vllm:external_prefix_cache_hits_total": "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of cached tokens.",
    "vllm:mm_cache_queries_total": "Multi-modal cache queries, in terms of number of queried items.",
    "vllm:mm_cache_hits_total": "Multi-modal cache hits, in terms of number of cached items.",
    "vllm:num_preemptions_total": "Cumulative number of preemption from the engine.",
    "vllm:prompt_tokens_total": "Number of prefill tokens processed.",
    "vllm:prompt_tokens_by_source_total": "Number of prompt tokens by source.",
    "vllm:prompt_tokens_cached_total": "Number of cached prompt tokens (local + external).",
    "vllm:prompt_tokens_cached_by_source_total": "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), host (offloaded to DRAM), disk, p2p (transferred from another vLLM instance) or external_unspecified. Counted at admission; sums to vllm:prefix_cache_hits + vllm:external_prefix_cache_hits.",
    "vllm:generation_tokens_total": "Number of generation tokens processed.",
    "vllm:request_success_total": "Count of successfully processed requests.",
    "vllm:admission_rejections_total": "Number of admission attempts rejected by a queue limit, by reason.",
    "vllm:request_prompt_tokens": "Number of prefill tokens processed.",
    "vllm:request_generation_tokens": "Number of generation tokens processed.",
    "vllm:iteration_tokens_total": "Histogram of number of tokens per engine_step.",
    "vllm:request_max_num_generation_tokens": "Histogram of maximum number of requested generation tokens.",
    "vllm:request_params_n": "Histogram of the n request parameter.",
    "vllm:request_params_max_tokens": "Histogram of the max_tokens request parameter.",
    "vllm:time_to_first_token_seconds": "Histogram of time to first token in seconds.",
    "vllm:inter_token_latency_seconds": "Histogram of inter-token latency in seconds.",
    "vllm:request_time_per_output_token_seconds": "Histogram of time_per_output_token_seconds per request.",
    "vllm:e2e_request_latency_seconds": "Histogram of e2e request latency in seconds.",
    "vllm:request_queue_time_seconds": "Histogram of time spent in WAITING phase for request.",
    "vllm:request_inference_time_seconds": "Histogram of time spent in RUNNING phase for request.",
    "vllm:request_prefill_time_seconds": "Histogram of time spent in PREFILL phase for request.",
    "vllm:request_decode_time_seconds": "Histogram of time spent in DECODE phase for request.",
    "vllm:request_num_preemptions": "Histogram of the number of times a request was preempted.",
    "vllm:request_prefill_kv_computed_tokens": "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
    "vllm:cache_config_info": "Information of the LLMEngine CacheConfig",
    "vllm:spec_decode_num_drafts_total": "Number of spec decoding drafts.",
    "vllm:spec_decode_num_draft_tokens_total": "Number of draft tokens.",
    "vllm:spec_decode_num_accepted_tokens_total": "Number of accepted tokens.",
    "vllm:spec_decode_num_accepted_tokens_per_pos_total": "Accepted tokens per draft position.",
    # dcgm-exporter's names and units (emulated: see EmulatedGPU)
    "DCGM_FI_DEV_GPU_UTIL": "GPU utilization (in %).",
    "DCGM_FI_DEV_FB_USED": "Framebuffer memory used (in MiB).",
    "DCGM_FI_DEV_FB_FREE": "Framebuffer memory free (in MiB).",
}


class EmulatedGPU:
    """The emulated GPU as dcgm-exporter would report it, for resource monitoring.

    Memory used (MiB) = non-PyTorch memory + weights + KV blocks in use * block bytes
                        + activation bytes per token * tokens of the step in flight;
    utilisation (%) = share of the last `window_s` seconds during which a step was computing
    (NVML's definition: time a kernel ran over the sample period; on the H200 it tracked the
    duty cycle of back-to-back decode steps within a point, docs/profiles/).

    What is modelled: the memory that the KV blocks and one step's activations fill, which is
    what moves under load. A real vLLM reserves its whole KV pool at start, so a real
    DCGM_FI_DEV_FB_USED stays flat near gpu_memory_utilization of the card and its movement
    shows in vllm:kv_cache_usage_perc instead.
    """

    def __init__(
        self,
        memory: GPUMemory,
        kv_block_bytes: int,
        engine_id: str,
        window_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.memory = memory
        self.kv_block_bytes = kv_block_bytes
        self.uuid = f"GPU-emulated-{engine_id}"
        self.window_s = window_s
        self.clock = clock  # the engine loop's clock, which stamps the steps
        self.kv_blocks_in_use = 0
        self.weights_resident = True  # False while the engine sleeps (vLLM's sleep mode)
        self.steps: deque[tuple[float, float, int]] = deque()  # (start, end, tokens)

    def step(self, start: float, end: float, kv_blocks_in_use: int, tokens: int) -> None:
        self.kv_blocks_in_use = kv_blocks_in_use
        steps = self.steps
        steps.append((start, end, tokens))
        horizon = end - self.window_s
        while steps and steps[0][1] < horizon:
            steps.popleft()

    def utilisation(self, now: float) -> float:
        """Busy fraction of [now - window, now]."""
        low = now - self.window_s
        busy = sum(max(0.0, min(end, now) - max(start, low)) for start, end, _ in self.steps)
        return min(1.0, busy / self.window_s)

    def used_bytes(self, now: float) -> int:
        m = self.memory
        in_flight = (
            self.steps[-1] if self.steps and self.steps[-1][0] <= now < self.steps[-1][1] else None
        )
        activations = m.activation_bytes_per_token * in_flight[2] if in_flight else 0
        return (
            m.non_torch_bytes
            + (m.weights_bytes if self.weights_resident else 0)
            + self.kv_blocks_in_use * self.kv_block_bytes
            + activations
        )

    def collect(self) -> Iterator[Metric]:
        return self.collect_at(self.clock())

    def collect_at(self, now: float) -> Iterator[Metric]:
        labels = ["gpu", "UUID", "device", "modelName", "Hostname"]
        values = ["0", self.uuid, "nvidia0", "NVIDIA H200 (emulated)", socket.gethostname()]
        used = min(self.used_bytes(now), self.memory.total_bytes)
        for name, value in (
            ("DCGM_FI_DEV_GPU_UTIL", round(100 * self.utilisation(now))),
            ("DCGM_FI_DEV_FB_USED", used // 2**20),
            ("DCGM_FI_DEV_FB_FREE", (self.memory.total_bytes - used) // 2**20),
        ):
            family = GaugeMetricFamily(name, HELP[name], labels=labels)
            family.add_metric(values, float(value))
            yield family


class SpecDecodeCounters:
    """vLLM's speculative-decoding counters, copied from the scheduler's tallies."""

    def __init__(self, num_speculative_tokens: int) -> None:
        self.drafts = Counter()
        self.draft_tokens = Counter()
        self.accepted_tokens = Counter()
        self.accepted_per_pos = {str(i): Counter() for i in range(num_speculative_tokens)}

    def read(self, scheduler: Scheduler) -> None:
        self.drafts.value = scheduler.spec_drafts
        self.draft_tokens.value = scheduler.spec_draft_tokens
        self.accepted_tokens.value = scheduler.spec_accepted_tokens
        for position, count in enumerate(scheduler.spec_accepted_per_pos):
            self.accepted_per_pos[str(position)].value = count


class EngineMetrics:
    """Every vLLM metric this engine exposes, with labels model_name and engine."""

    def __init__(self, model_name: str, engine: str = "0", kv_connector: bool = False) -> None:
        self.model_name = model_name
        self.engine = engine
        self.kv_connector = kv_connector
        self.cache_config_info: dict[str, str] = {}
        self.gpu: EmulatedGPU | None = None
        self.spec: SpecDecodeCounters | None = None
        # Reads the engine's live state into the gauges before each scrape (the engine sets it).
        self.read_gauges: Callable[[], None] = lambda: None
        # gauges, refreshed by the engine loop
        self.num_running = 0
        self.num_waiting = 0
        self.num_waiting_deferred = 0
        self.kv_fetch_waiting_to_start = 0
        self.kv_fetch_in_progress = 0
        self.kv_fetch_completed_waiting = 0
        self.kv_cache_usage = 0.0
        self.lora: LoraAdapters | None = None  # vllm:lora_requests_info with --enable-lora
        self.sleep_state = {"awake": 1.0, "weights_offloaded": 0.0, "discard_all": 0.0}
        # counters
        c = Counter
        self.prefix_cache_queries, self.prefix_cache_hits = c(), c()
        self.external_prefix_cache_queries, self.external_prefix_cache_hits = c(), c()
        self.num_preemptions = c()
        self.prompt_tokens, self.generation_tokens = c(), c()
        self.prompt_tokens_cached = c()
        self.prompt_tokens_by_source = {s: c() for s in PROMPT_SOURCES}
        self.prompt_tokens_cached_by_source = {s: c() for s in CACHED_SOURCES}
        self.request_success = {r: c() for r in FINISHED_REASONS}
        self.nixl_failed_transfers, self.nixl_failed_notifications = c(), c()
        self.nixl_kv_expired, self.nixl_notifications_after_expiry = c(), c()
        self.zero_counters = {
            "vllm:estimated_flops_per_gpu": c(),
            "vllm:estimated_read_bytes_per_gpu": c(),
            "vllm:estimated_write_bytes_per_gpu": c(),
            "vllm:mm_cache_queries": c(),
            "vllm:mm_cache_hits": c(),
        }
        self.admission_rejections = {"max_num_queued_reqs": c(), "max_num_queued_tokens": c()}
        # histograms
        h = Histogram
        self.request_prompt_tokens = h(TOKEN_BUCKETS)
        self.request_generation_tokens = h(TOKEN_BUCKETS)
        self.iteration_tokens = h(ITERATION_TOKEN_BUCKETS)
        self.request_max_num_generation_tokens = h(TOKEN_BUCKETS)
        self.request_params_n = h(N_BUCKETS)
        self.request_params_max_tokens = h(TOKEN_BUCKETS)
        self.ttft = h(TTFT_BUCKETS)
        self.itl = h(ITL_BUCKETS)
        self.tpot = h(ITL_BUCKETS)
        self.e2e = h(REQUEST_TIME_BUCKETS)
        self.queue_time = h(REQUEST_TIME_BUCKETS)
        self.inference_time = h(REQUEST_TIME_BUCKETS)
        self.prefill_time = h(REQUEST_TIME_BUCKETS)
        self.decode_time = h(REQUEST_TIME_BUCKETS)
        self.request_num_preemptions = h(PREEMPTION_BUCKETS)
        self.prefill_kv_computed = h(TOKEN_BUCKETS)
        self.nixl_xfer_time = h(NIXL_TIME_BUCKETS)
        self.nixl_post_time = h(NIXL_POST_BUCKETS)
        self.nixl_bytes = h(NIXL_BYTES_BUCKETS)
        self.nixl_descriptors = h(NIXL_DESCRIPTOR_BUCKETS)

    def histograms(self) -> list[tuple[str, Histogram]]:
        out = [
            ("vllm:request_prompt_tokens", self.request_prompt_tokens),
            ("vllm:request_generation_tokens", self.request_generation_tokens),
            ("vllm:iteration_tokens_total", self.iteration_tokens),
            ("vllm:request_max_num_generation_tokens", self.request_max_num_generation_tokens),
            ("vllm:request_params_n", self.request_params_n),
            ("vllm:request_params_max_tokens", self.request_params_max_tokens),
            ("vllm:time_to_first_token_seconds", self.ttft),
            ("vllm:inter_token_latency_seconds", self.itl),
            ("vllm:request_time_per_output_token_seconds", self.tpot),
            ("vllm:e2e_request_latency_seconds", self.e2e),
            ("vllm:request_queue_time_seconds", self.queue_time),
            ("vllm:request_inference_time_seconds", self.inference_time),
            ("vllm:request_prefill_time_seconds", self.prefill_time),
            ("vllm:request_decode_time_seconds", self.decode_time),
            ("vllm:request_num_preemptions", self.request_num_preemptions),
            ("vllm:request_prefill_kv_computed_tokens", self.prefill_kv_computed),
        ]
        if self.kv_connector:
            out = [
                ("vllm:nixl_xfer_time_seconds", self.nixl_xfer_time),
                ("vllm:nixl_post_time_seconds", self.nixl_post_time),
                ("vllm:nixl_bytes_transferred", self.nixl_bytes),
                ("vllm:nixl_num_descriptors", self.nixl_descriptors),
                *out,
            ]
        return out

    def collect(self) -> Iterator[Metric]:
        """Families in vLLM's order (prometheus_client's collector protocol)."""
        self.read_gauges()
        yield from self._state_families()
        yield from self._counter_families()
        yield from self._histogram_families()
        yield self._cache_config_family()
        if self.gpu is not None:
            yield from self.gpu.collect()

    # The engine's own labels: every family but admission rejections carries both.
    _BASE_LABELS = ("engine", "model_name")

    @staticmethod
    def _lora_family(lora: LoraAdapters) -> GaugeMetricFamily:
        """vLLM's LoRA info gauge: no engine or model label; every label set it has seen, each
        valued with the time it was last current."""
        family = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        for (running, waiting), when in lora.info.items():
            family.add_metric([str(lora.config.max_loras), running, waiting], when)
        return family

    def _counter(self, name: str, value: Counter) -> CounterMetricFamily:
        family = CounterMetricFamily(name, HELP[name + "_total"], labels=self._BASE_LABELS)
        family.add_metric([self.engine, self.model_name], value.value, created=value.created)
        return family

    def _labeled_counter(
        self, name: str, label: str, by: dict[str, Counter]
    ) -> CounterMetricFamily:
        family = CounterMetricFamily(
            name, HELP[name + "_total"], labels=[*self._BASE_LABELS, label]
        )
        for key, value in by.items():
            family.add_metric(
                [self.engine, self.model_name, key], value.value, created=value.created
            )
        return family

    def _gauge(self, name: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, HELP[name], labels=self._BASE_LABELS)
        family.add_metric([self.engine, self.model_name], value)
        return family

    def _labeled_gauge(self, name: str, label: str, by: dict[str, float]) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, HELP[name], labels=[*self._BASE_LABELS, label])
        for key, value in by.items():
            family.add_metric([self.engine, self.model_name, key], value)
        return family

    def _state_families(self) -> Iterator[Metric]:
        """NIXL failure counters, then the gauges of the engine's queues and cache."""
        if self.kv_connector:
            yield self._counter("vllm:nixl_num_failed_transfers", self.nixl_failed_transfers)
            yield self._counter(
                "vllm:nixl_num_failed_notifications", self.nixl_failed_notifications
            )
            yield self._counter("vllm:nixl_num_kv_expired_reqs", self.nixl_kv_expired)
            yield self._counter(
                "vllm:nixl_num_notifications_after_expiry", self.nixl_notifications_after_expiry
            )
        for name in (
            "vllm:estimated_flops_per_gpu",
            "vllm:estimated_read_bytes_per_gpu",
            "vllm:estimated_write_bytes_per_gpu",
        ):
            yield self._counter(name, self.zero_counters[name])
        yield self._gauge("vllm:num_requests_running", self.num_running)
        yield self._gauge("vllm:num_requests_waiting", self.num_waiting)
        deferred = self.num_waiting_deferred
        yield self._labeled_gauge(
            "vllm:num_requests_waiting_by_reason",
            "reason",
            {"capacity": self.num_waiting - deferred, "deferred": deferred},
        )
        if self.kv_connector:
            yield self._labeled_gauge(
                "vllm:num_requests_kv_fetch_by_stage",
                "stage",
                {
                    "waiting_to_start": self.kv_fetch_waiting_to_start,
                    "in_progress": self.kv_fetch_in_progress,
                    "completed_waiting": self.kv_fetch_completed_waiting,
                },
            )
        yield self._labeled_gauge(
            "vllm:engine_sleep_state",
            "sleep_state",
            self.sleep_state,
        )
        yield self._gauge("vllm:kv_cache_usage_perc", self.kv_cache_usage)
        if self.lora is not None:
            yield self._lora_family(self.lora)

    def _counter_families(self) -> Iterator[Metric]:
        """Prefix-cache, token, request and admission counters."""
        counter = self._counter
        yield counter("vllm:prefix_cache_queries", self.prefix_cache_queries)
        yield counter("vllm:prefix_cache_hits", self.prefix_cache_hits)
        yield counter("vllm:external_prefix_cache_queries", self.external_prefix_cache_queries)
        yield counter("vllm:external_prefix_cache_hits", self.external_prefix_cache_hits)
        yield counter("vllm:mm_cache_queries", self.zero_counters["vllm:mm_cache_queries"])
        yield counter("vllm:mm_cache_hits", self.zero_counters["vllm:mm_cache_hits"])
        yield counter("vllm:num_preemptions", self.num_preemptions)
        yield counter("vllm:prompt_tokens", self.prompt_tokens)
        yield self._labeled_counter(
            "vllm:prompt_tokens_by_source", "source", self.prompt_tokens_by_source
        )
        yield counter("vllm:prompt_tokens_cached", self.prompt_tokens_cached)
        yield self._labeled_counter(
            "vllm:prompt_tokens_cached_by_source", "source", self.prompt_tokens_cached_by_source
        )
        yield counter("vllm:generation_tokens", self.generation_tokens)
        if self.spec is not None:
            yield counter("vllm:spec_decode_num_drafts", self.spec.drafts)
            yield counter("vllm:spec_decode_num_draft_tokens", self.spec.draft_tokens)
            yield counter("vllm:spec_decode_num_accepted_tokens", self.spec.accepted_tokens)
            yield self._labeled_counter(
                "vllm:spec_decode_num_accepted_tokens_per_pos",
                "position",
                self.spec.accepted_per_pos,
            )
        yield self._labeled_counter("vllm:request_success", "finished_reason", self.request_success)
        rejections = CounterMetricFamily(
            "vllm:admission_rejections",
            HELP["vllm:admission_rejections_total"],
            labels=["model_name", "reason"],
        )
        for reason, value in self.admission_rejections.items():
            rejections.add_metric([self.model_name, reason], value.value, created=value.created)
        yield rejections

    def _histogram_families(self) -> Iterator[Metric]:
        labels = {"engine": self.engine, "model_name": self.model_name}
        for name, histogram in self.histograms():
            family = HistogramMetricFamily(name, HELP[name], labels=self._BASE_LABELS)
            family.add_metric([self.engine, self.model_name], histogram.cumulative(), histogram.sum)
            family.add_sample(name + "_created", labels, histogram.created)
            yield family

    def _cache_config_family(self) -> GaugeMetricFamily:
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            HELP["vllm:cache_config_info"],
            labels=sorted([*self.cache_config_info, "engine"]),
        )
        labels = {**self.cache_config_info, "engine": self.engine}
        info.add_metric([labels[k] for k in sorted(labels)], 1.0)
        return info


def build_registry(metrics: EngineMetrics) -> CollectorRegistry:
    """A registry with the process/platform/gc collectors (as vLLM has) and the engine's metrics."""
    registry = CollectorRegistry(auto_describe=False)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    registry.register(metrics)
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
