"""Command line: vLLM `serve` flags with vLLM's names and meaning, plus the emulator's own options."""

from __future__ import annotations

import argparse
import json
import logging
import os
from typing import Any

from tandem.emulator.config import (
    EngineConfig,
    Faults,
    KVTransferConfig,
    LoraConfig,
    SpeculativeConfig,
)
from tandem.emulator.kv_events import KVEventsConfig
from tandem.emulator.profile import available_profiles, default_profile_name

log = logging.getLogger("tandem.emulator")

# vLLM flags without a value: an unknown one of these must not swallow the next argument.
VLLM_BOOLEAN_FLAGS = {
    "--trust-remote-code",
    "--enforce-eager",
    "--disable-log-requests",
    "--disable-log-stats",
    "--enable-log-requests",
    "--disable-custom-all-reduce",
    "--enable-lora",
    "--enable-auto-tool-choice",
    "--disable-fastapi-docs",
    "--disable-frontend-multiprocessing",
    "--enable-prompt-tokens-details",
    "--enable-force-include-usage",
    "--no-enable-chunked-prefill",
    "--async-scheduling",
    "--enable-expert-parallel",
    "--skip-tokenizer-init",
    "--disable-uvicorn-access-log",
    "--headless",
    "--enable-log-outputs",
    "--return-tokens-as-token-ids",
    "--disable-sliding-window",
    "--enable-chunked-prefill",
    "--no-enable-prefix-caching",
}


def _json_arg(value: str) -> dict[str, Any]:
    data = json.loads(value)
    if not isinstance(data, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return data


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tandem emulate",
        description="A vLLM-compatible engine emulator. Takes `vllm serve` flags; other vLLM flags "
        "are accepted with a warning.",
    )
    p.add_argument("model_tag", nargs="?", help="the model, as in `vllm serve MODEL`")
    v = p.add_argument_group("vLLM flags")
    v.add_argument("--model", help="model name or a local directory (tokenizer.json, config.json)")
    v.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    v.add_argument("--served-model-name", nargs="+", default=None)
    v.add_argument("--host", default=None)
    v.add_argument("--port", type=int, default=8000)
    v.add_argument("--block-size", type=int, default=16)
    v.add_argument("--max-num-seqs", type=int, default=1024)
    v.add_argument("--max-num-batched-tokens", type=int, default=8192)
    v.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=0,
        help="the most prompt tokens one request computes in a step (0: no bound but the budget)",
    )
    v.add_argument(
        "--max-model-len", type=str, default=None, help="tokens; 1k/1K/1m suffixes allowed"
    )
    v.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    v.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    v.add_argument(
        "--prefix-caching-hash-algo",
        default="sha256",
        choices=["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"],
    )
    v.add_argument("--num-gpu-blocks-override", type=int, default=None)
    v.add_argument("--gpu-memory-utilization", type=float, default=0.92)
    v.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    v.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    v.add_argument("--data-parallel-rank", "-dpn", type=int, default=0)
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--kv-transfer-config", type=_json_arg, default=None)
    v.add_argument("--kv-events-config", type=_json_arg, default=None)
    v.add_argument("--speculative-config", type=_json_arg, default=None)
    v.add_argument("--enable-lora", action="store_true")
    v.add_argument("--max-loras", type=int, default=1)
    v.add_argument("--max-lora-rank", type=int, default=16)
    v.add_argument("--max-cpu-loras", type=int, default=None)
    v.add_argument("--lora-modules", nargs="+", default=[], help="NAME=PATH or vLLM's JSON form")
    v.add_argument("--api-key", default=None)
    v.add_argument("--enable-server-load-tracking", action="store_true")
    v.add_argument("--enable-request-id-headers", action="store_true")
    v.add_argument(
        "--enable-sleep-mode",
        action="store_true",
        help="/sleep, /wake_up, /is_sleeping (with VLLM_SERVER_DEV_MODE=1), as vLLM on a GPU",
    )
    v.add_argument(
        "--shutdown-timeout",
        type=int,
        default=0,
        help="seconds to drain in-flight requests on SIGTERM (0: abort them)",
    )
    e = p.add_argument_group("emulator options")
    e.add_argument(
        "--timing-profile",
        default=None,
        help=f"profile name ({', '.join(available_profiles())}) or YAML path; "
        f"default {default_profile_name()}",
    )
    e.add_argument("--speedup", type=float, default=1.0, help="divide every simulated time by this")
    e.add_argument(
        "--kv-events-bind-host",
        default=None,
        help="bind the KV-event PUB/replay sockets on this host (any tcp endpoint)",
    )
    e.add_argument(
        "--kv-handshake-timeout",
        type=float,
        default=5.0,
        help="seconds to wait for a prefill engine's NIXL side channel (default 5)",
    )
    e.add_argument(
        "--no-nixl",
        action="store_true",
        help="P/D without moving KV bytes through NIXL (metadata and timing only)",
    )
    e.add_argument(
        "--spec-acceptance-rate",
        type=float,
        default=0.7,
        help="with --speculative-config: the chance that a drafted token is accepted, for requests "
        "that give none in vllm_xargs.spec_acceptance_rate (default 0.7)",
    )
    e.add_argument(
        "--batching",
        choices=["continuous", "static"],
        default="continuous",
        help="static: requests are admitted only when the running batch has drained (no joining "
        "mid-flight), for comparison with vLLM's continuous batching",
    )
    e.add_argument(
        "--static-batch-wait",
        type=float,
        default=0.1,
        help="with --batching static: seconds an idle engine waits for a fuller batch after the "
        "first request arrives (the dynamic batchers' max queue delay; default 0.1)",
    )
    e.add_argument(
        "--shared-gpu",
        metavar="LOCK_FILE",
        default=None,
        help="engines given the same lock file emulate one GPU: their steps take turns, as "
        "CUDA time-slices two processes' kernels without MPS",
    )
    e.add_argument("--startup-delay", type=float, default=0.0, help="seconds before the port opens")
    e.add_argument(
        "--error-rate", type=float, default=0.0, help="fraction of requests answered 500"
    )
    e.add_argument("--crash-after-requests", type=int, default=0, help="exit(1) after N requests")
    e.add_argument(
        "--slow-token-probability",
        type=float,
        default=0.0,
        help="probability that an engine step is slowed by --slow-token-delay",
    )
    e.add_argument(
        "--slow-token-delay", type=float, default=0.0, help="seconds added to a slow step"
    )
    e.add_argument(
        "--stall-after-tokens",
        type=int,
        default=0,
        help="streams stop producing after N tokens (until the client disconnects)",
    )
    e.add_argument("--stall-rate", type=float, default=1.0, help="fraction of requests that stall")
    e.add_argument(
        "--health-delay",
        type=float,
        default=0.0,
        help="seconds /health takes to answer while requests run (an API server too busy to "
        "answer its probes)",
    )
    e.add_argument("--fault-seed", type=int, default=0)
    e.add_argument(
        "--lora-swap-time",
        type=float,
        default=0.002,
        help="seconds a step spends bringing an adapter into a free GPU slot",
    )
    e.add_argument(
        "--lora-load-time",
        type=float,
        default=0.05,
        help="seconds more when the adapter is not in CPU memory (--max-cpu-loras) either",
    )
    e.add_argument("--log-level", default="info")
    return p


def split_known(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[list[str], list[str]]:
    """Separate the flags this parser knows from other vLLM flags (and their values)."""
    known_flags = {s for action in parser._actions for s in action.option_strings}
    known: list[str] = []
    unknown: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--") and "_" in arg.split("=", 1)[0]:
            name, eq, rest = arg.partition("=")
            arg = name.replace("_", "-") + eq + rest  # vLLM accepts --max_model_len too
        name = arg.split("=", 1)[0]
        if (
            arg.startswith("-")
            and len(arg) > 1
            and not arg[1].isdigit()
            and name not in known_flags
        ):
            unknown.append(arg)
            has_value = "=" in arg or name in VLLM_BOOLEAN_FLAGS
            if not has_value and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
                unknown.append(argv[i + 1])
                i += 1
        else:
            known.append(arg)
        i += 1
    return known, unknown


def lora_modules(values: list[str]) -> dict[str, str]:
    """--lora-modules as vLLM reads it: NAME=PATH, or a JSON object with name and path."""
    modules: dict[str, str] = {}
    for value in values:
        if value.lstrip().startswith("{"):
            data = _json_arg(value)
            name, path = data.get("name"), data.get("path")
        else:
            name, _, path = value.partition("=")
        if not name or not path:
            raise ValueError(f"--lora-modules {value!r}: expected NAME=PATH or a JSON object")
        modules[str(name)] = str(path)
    return modules


def lora_config(ns: argparse.Namespace) -> LoraConfig:
    return LoraConfig(
        max_loras=ns.max_loras,
        max_lora_rank=ns.max_lora_rank,
        max_cpu_loras=ns.max_cpu_loras,
        modules=lora_modules(ns.lora_modules),
        runtime_updates=os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower()
        in ("1", "true"),
        swap_s=ns.lora_swap_time,
        load_s=ns.lora_load_time,
    )


def parse_max_model_len(value: str | None) -> int | None:
    if value is None or value in ("-1", "auto"):
        return None
    text = value.strip()
    scale = {"k": 1000, "K": 1024, "m": 1000**2, "M": 1024**2}.get(text[-1:], 1)
    return int(float(text[:-1] if scale != 1 else text) * scale)


def parse_args(argv: list[str]) -> tuple[EngineConfig, list[str], str]:
    """(config, ignored vLLM flags, log level) from a `vllm serve`-style command line."""
    if argv and argv[0] == "serve":
        argv = argv[1:]
    parser = build_parser()
    known, unknown = split_known(parser, argv)
    ns = parser.parse_args(known)
    model = ns.model or ns.model_tag or EngineConfig.model_fields["model"].default
    config = EngineConfig(
        model=model,
        tokenizer=ns.tokenizer,
        served_model_names=ns.served_model_name or [],
        host=ns.host,
        port=ns.port,
        block_size=ns.block_size,
        max_num_seqs=ns.max_num_seqs,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        long_prefill_token_threshold=ns.long_prefill_token_threshold,
        max_model_len=parse_max_model_len(ns.max_model_len),
        enable_prefix_caching=ns.enable_prefix_caching,
        enable_chunked_prefill=ns.enable_chunked_prefill,
        prefix_caching_hash_algo=ns.prefix_caching_hash_algo,
        num_gpu_blocks_override=ns.num_gpu_blocks_override,
        gpu_memory_utilization=ns.gpu_memory_utilization,
        tensor_parallel_size=ns.tensor_parallel_size,
        pipeline_parallel_size=ns.pipeline_parallel_size,
        data_parallel_rank=ns.data_parallel_rank,
        seed=ns.seed,
        kv_transfer_config=KVTransferConfig.model_validate(ns.kv_transfer_config)
        if ns.kv_transfer_config
        else None,
        kv_events_config=KVEventsConfig.model_validate(ns.kv_events_config)
        if ns.kv_events_config
        else None,
        speculative_config=SpeculativeConfig.model_validate(ns.speculative_config)
        if ns.speculative_config
        else None,
        lora=lora_config(ns) if ns.enable_lora else None,
        api_key=ns.api_key or os.environ.get("VLLM_API_KEY") or None,
        enable_server_load_tracking=ns.enable_server_load_tracking,
        enable_request_id_headers=ns.enable_request_id_headers,
        enable_sleep_mode=ns.enable_sleep_mode,
        shutdown_timeout_s=ns.shutdown_timeout,
        timing_profile=ns.timing_profile,
        speedup=ns.speedup,
        kv_events_bind_host=ns.kv_events_bind_host,
        kv_handshake_timeout_s=ns.kv_handshake_timeout,
        use_nixl=not ns.no_nixl,
        spec_acceptance_rate=ns.spec_acceptance_rate,
        batching=ns.batching,
        static_batch_wait_s=ns.static_batch_wait,
        shared_gpu=ns.shared_gpu,
        faults=Faults(
            startup_delay_s=ns.startup_delay,
            error_rate=ns.error_rate,
            crash_after_requests=ns.crash_after_requests,
            slow_token_probability=ns.slow_token_probability,
            slow_token_delay_s=ns.slow_token_delay,
            stall_after_tokens=ns.stall_after_tokens,
            stall_rate=ns.stall_rate,
            health_delay_s=ns.health_delay,
            seed=ns.fault_seed,
        ),
    )
    return config, unknown, ns.log_level
