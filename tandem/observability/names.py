"""Public metric and label names the dashboards and rules query (router, engines, operator)."""

from __future__ import annotations

# Target labels the scrape configuration puts on every series: the Prometheus Operator adds
# `namespace` and `pod`; the PodMonitor/ServiceMonitor's podTargetLabels copy the pods' labels
# `tandem.dev/cluster` and `tandem.dev/role` as `tandem_dev_cluster` and `tandem_dev_role`.
NAMESPACE = "namespace"
CLUSTER = "tandem_dev_cluster"
ROLE = "tandem_dev_role"
POD = "pod"
# The label the router and the operator put on per-pool series (prefill, decode, worker, router).
POOL = "pool"

# The router (tandem/router/metrics.py and the gauges of tandem/router/service.py).
ROUTER_QUEUE = "tandem_router_queue_seconds"
ROUTER_PREFILL = "tandem_router_prefill_seconds"
ROUTER_KV_HANDOFF = "tandem_router_kv_handoff_seconds"
ROUTER_TTFT = "tandem_router_ttft_seconds"
ROUTER_ITL = "tandem_router_inter_token_seconds"
ROUTER_E2E = "tandem_router_e2e_seconds"
ROUTER_DECISION_TIME = "tandem_router_decision_seconds"
ROUTER_REQUESTS = "tandem_router_requests_total"
ROUTER_DECISIONS = "tandem_router_decisions_total"
ROUTER_PREFIX_QUERY_BLOCKS = "tandem_router_prefix_query_blocks_total"
ROUTER_PREFIX_HIT_BLOCKS = "tandem_router_prefix_hit_blocks_total"
ROUTER_RETRIES = "tandem_router_retries_total"
ROUTER_UPSTREAM_ERRORS = "tandem_router_upstream_errors_total"
ROUTER_REJECTED = "tandem_router_rejected_total"
ROUTER_DISCONNECTS = "tandem_router_client_disconnects_total"
ROUTER_ENGINE_IN_FLIGHT = "tandem_router_engine_in_flight"
ROUTER_ENGINE_HEALTHY = "tandem_router_engine_healthy"
ROUTER_QUEUE_WAITING = "tandem_router_queue_waiting"
ROUTER_INDEX_BLOCKS = "tandem_router_index_blocks"
ROUTER_KV_EVENT_LAG = "tandem_router_kv_event_lag_seconds"

# vLLM 0.32's engine metrics (the emulator serves the same names: tandem/emulator/metrics.py).
ENGINE_RUNNING = "vllm:num_requests_running"
ENGINE_WAITING = "vllm:num_requests_waiting"
ENGINE_KV_USAGE = "vllm:kv_cache_usage_perc"
ENGINE_PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
ENGINE_PREFIX_HITS = "vllm:prefix_cache_hits_total"
ENGINE_PREEMPTIONS = "vllm:num_preemptions_total"
ENGINE_PROMPT_TOKENS = "vllm:prompt_tokens_total"
ENGINE_PROMPT_TOKENS_BY_SOURCE = "vllm:prompt_tokens_by_source_total"
ENGINE_GENERATION_TOKENS = "vllm:generation_tokens_total"
ENGINE_QUEUE_TIME = "vllm:request_queue_time_seconds"
ENGINE_PREFILL_COMPUTED = "vllm:request_prefill_kv_computed_tokens"
ENGINE_NIXL_FAILED = "vllm:nixl_num_failed_transfers_total"
ENGINE_NIXL_EXPIRED = "vllm:nixl_num_kv_expired_reqs_total"

# The operator (tandem/operator/metrics.py).
OPERATOR_RECONCILES = "tandem_operator_reconciles_total"
OPERATOR_RECONCILE_DURATION = "tandem_operator_reconcile_duration_seconds"
OPERATOR_POOL_REPLICAS = "tandem_operator_pool_replicas"
AUTOSCALER_EVALUATIONS = "tandem_operator_autoscaler_evaluations_total"
AUTOSCALER_REPLICAS = "tandem_operator_autoscaler_replicas"
AUTOSCALER_SIGNAL = "tandem_operator_autoscaler_signal"
AUTOSCALER_TARGET = "tandem_operator_autoscaler_signal_target"
AUTOSCALER_LIMITED = "tandem_operator_autoscaler_limited"
AUTOSCALER_METRICS_AVAILABLE = "tandem_operator_autoscaler_metrics_available"
