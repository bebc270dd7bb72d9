"""`tandem router`: run the KV-aware prefill/decode router from a config file or from flags."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys

from pydantic import ValidationError

from tandem.router.config import RouterConfig, StaticDiscovery, StaticEndpoint

EPILOG = """\
static engines:  --prefill URL, --decode URL (repeatable); a URL given as both, or as --worker URL,
                 serves prefill and decode itself (colocated).
KV events:       --kv-events ENGINE_URL=PUB_ENDPOINT[,REPLAY_ENDPOINT], e.g.
                 --kv-events http://127.0.0.1:8101=tcp://127.0.0.1:5557,tcp://127.0.0.1:5558
                 (exact prefix index; needs --tokenizer). Without it the router uses the
                 approximate index built from its own routing history.
KV handoff:      --side-channel ENGINE_URL=PORT: a prefill engine's VLLM_NIXL_SIDE_CHANNEL_PORT
                 (default 5600); its answers must name its own host and this port.
trust:           --admin-key KEY makes a client trusted (priority and x-tandem-debug headers
                 honoured, /metrics and /engines served); --trust-all-clients trusts everyone;
                 --admin-port PORT serves /metrics and /engines there only.
processes:       --processes N runs N router processes on one port (SO_REUSEPORT) under a
                 supervisor that restarts them and serves --admin-port (required) with their
                 metrics merged; admission limits are split among them (docs/router.md).
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tandem router",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--config", help="RouterConfig YAML (what the operator renders); flags override it"
    )
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument(
        "--processes", type=int, help="router processes sharing the port (needs --admin-port)"
    )
    p.add_argument(
        "--model", "--served-model-name", dest="model", help="the model name clients send"
    )
    p.add_argument("--prefill", action="append", default=[], metavar="URL")
    p.add_argument("--decode", action="append", default=[], metavar="URL")
    p.add_argument("--worker", action="append", default=[], metavar="URL")
    p.add_argument(
        "--kv-events", action="append", default=[], metavar="URL=tcp://HOST:PORT[,tcp://HOST:PORT]"
    )
    p.add_argument(
        "--no-kv-events", action="store_true", help="ignore KV events; approximate index only"
    )
    p.add_argument("--side-channel", action="append", default=[], metavar="URL=PORT")
    p.add_argument("--block-size", type=int)
    p.add_argument("--hash-algo", choices=["sha256", "sha256_cbor"])
    p.add_argument("--hash-seed", help="the engines' PYTHONHASHSEED")
    p.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="directory with the model's tokenizer.json, or tandem-fallback (emulators without one)",
    )
    p.add_argument(
        "--chat-template",
        metavar="FILE_OR_TEXT",
        help="the engines' --chat-template, when they override the model's own",
    )
    p.add_argument(
        "--render-url",
        metavar="URL",
        help="vLLM's renderer (vllm launch render MODEL) for requests the router cannot tokenize",
    )
    p.add_argument(
        "--render-mode",
        choices=["local", "remote"],
        help="local: render in the router, the renderer only as fallback; remote: always ask it",
    )
    p.add_argument(
        "--pending-block-seconds",
        type=float,
        help="how long blocks of a sent request count as cached before its KV events arrive",
    )
    p.add_argument(
        "--policy",
        choices=["weighted", "predictive"],
        help="placement: weighted scorers, or predicted TTFT/TPOT against SLO targets",
    )
    p.add_argument("--prefix-weight", type=float)
    p.add_argument("--queue-weight", type=float)
    p.add_argument("--kv-usage-weight", type=float)
    p.add_argument("--load-bound-factor", type=float)
    p.add_argument("--load-bound-slack", type=float)
    p.add_argument("--spread-weight", type=float)
    p.add_argument("--affinity-weight", type=float)
    p.add_argument("--lora-affinity-weight", type=float)
    p.add_argument("--session-load-bound-factor", type=float)
    p.add_argument("--running-weight", type=float)
    p.add_argument("--disaggregation", choices=["auto", "always", "never"])
    p.add_argument("--min-uncached-tokens", type=int)
    p.add_argument("--max-queue", type=int)
    p.add_argument("--max-in-flight", type=int)
    p.add_argument(
        "--engine-wait-seconds",
        type=float,
        help="hold a request this long for a decode engine to become ready (scale from zero)",
    )
    p.add_argument("--api-key", action="append", default=[], help="a client API key (repeatable)")
    p.add_argument(
        "--client-keys-file", help="client API keys, one per line; re-read when the file changes"
    )
    p.add_argument(
        "--engine-key-file", help="key sent to every engine as Authorization: Bearer (--api-key)"
    )
    p.add_argument(
        "--admin-key", action="append", default=[], help="a trusted client's key (repeatable)"
    )
    p.add_argument("--admin-port", type=int)
    p.add_argument("--trust-all-clients", action="store_true")
    p.add_argument("--max-connections", type=int)
    p.add_argument("--header-timeout", type=float, help="seconds to receive a request head")
    p.add_argument("--body-timeout", type=float, help="seconds to receive a request body")
    p.add_argument("--idle-timeout", type=float, help="seconds a keep-alive connection may idle")
    p.add_argument(
        "--decode-idle-seconds", type=float, help="longest silence inside a decode stream"
    )
    p.add_argument("--connect-seconds", type=float, help="limit of connecting to an engine")
    p.add_argument("--prefill-seconds", type=float, help="limit of one prefill request")
    p.add_argument("--request-seconds", type=float, help="limit of a whole request")
    p.add_argument("--log-level")
    p.add_argument(
        "--epp-port", type=int, help="serve the endpoint picker (Envoy ext_proc gRPC) on this port"
    )
    p.add_argument(
        "--epp-relay",
        action="append",
        default=[],
        metavar="URL=HOST:PORT",
        help="the P/D relay beside a decode engine (`tandem relay`), for the endpoint picker",
    )
    return p


def _kv_events(values: list[str]) -> dict[str, tuple[str, str | None]]:
    out: dict[str, tuple[str, str | None]] = {}
    for value in values:
        url, sep, endpoints = value.partition("=")
        if not sep or (not endpoints.startswith("tcp://") and not endpoints.startswith("ipc://")):
            raise SystemExit(
                f"--kv-events wants ENGINE_URL=tcp://HOST:PORT[,tcp://HOST:PORT], got {value!r}"
            )
        pub, _, replay = endpoints.partition(",")
        out[url.rstrip("/")] = (pub, replay or None)
    return out


def _side_channels(values: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for value in values:
        url, sep, port = value.rpartition("=")
        if not sep or not port.isdigit():
            raise SystemExit(f"--side-channel wants ENGINE_URL=PORT, got {value!r}")
        out[url.rstrip("/")] = int(port)
    return out


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    data: dict[str, object] = {}
    if args.config:
        data = RouterConfig.from_yaml_file(args.config).model_dump(by_alias=True, exclude_none=True)
    if args.prefill or args.decode or args.worker:
        events = _kv_events(args.kv_events)
        side_channels = _side_channels(args.side_channel)

        def endpoint(url: str) -> StaticEndpoint:
            pub, replay = events.get(url.rstrip("/"), (None, None))
            return StaticEndpoint(
                url=url.rstrip("/"),
                kv_events=pub,
                kv_events_replay=replay,
                side_channel_port=side_channels.get(url.rstrip("/")),
            )

        data["static"] = StaticDiscovery(
            prefill=[endpoint(u) for u in args.prefill],
            decode=[endpoint(u) for u in args.decode],
            workers=[endpoint(u) for u in args.worker],
        ).model_dump(by_alias=True, exclude_none=True)
        data.pop("kubernetes", None)
    flat = {
        "host": args.host,
        "port": args.port,
        "processes": args.processes,
        "servedModelName": args.model,
        "blockSize": args.block_size,
        "hashAlgo": args.hash_algo,
        "hashSeed": args.hash_seed,
        "tokenizer": args.tokenizer,
        "chatTemplate": args.chat_template,
        "pendingBlockSeconds": args.pending_block_seconds,
        "renderUrl": args.render_url,
        "renderMode": args.render_mode,
        "logLevel": args.log_level,
    }
    data.update({k: v for k, v in flat.items() if v is not None})
    if args.no_kv_events:
        data["kvEvents"] = False
    if args.api_key:
        data["apiKeys"] = args.api_key
    for key, value in (
        ("clientKeysFile", args.client_keys_file),
        ("engineKeyFile", args.engine_key_file),
    ):
        if value is not None:
            auth = data.setdefault("auth", {})
            assert isinstance(auth, dict)
            auth[key] = value
    for section, key, value in (
        ("scoring", "policy", args.policy),
        ("scoring", "prefixWeight", args.prefix_weight),
        ("scoring", "queueWeight", args.queue_weight),
        ("scoring", "kvUsageWeight", args.kv_usage_weight),
        ("scoring", "loadBoundFactor", args.load_bound_factor),
        ("scoring", "loadBoundSlack", args.load_bound_slack),
        ("scoring", "spreadWeight", args.spread_weight),
        ("scoring", "affinityWeight", args.affinity_weight),
        ("scoring", "loraAffinityWeight", args.lora_affinity_weight),
        ("scoring", "sessionLoadBoundFactor", args.session_load_bound_factor),
        ("scoring", "runningWeight", args.running_weight),
        ("disaggregation", "mode", args.disaggregation),
        ("disaggregation", "minUncachedTokens", args.min_uncached_tokens),
        ("admission", "maxQueue", args.max_queue),
        ("admission", "maxInFlight", args.max_in_flight),
        ("admission", "engineWaitSeconds", args.engine_wait_seconds),
        ("timeouts", "decodeIdleSeconds", args.decode_idle_seconds),
        ("timeouts", "connectSeconds", args.connect_seconds),
        ("timeouts", "prefillSeconds", args.prefill_seconds),
        ("timeouts", "requestSeconds", args.request_seconds),
        ("http", "maxConnections", args.max_connections),
        ("http", "headerTimeoutSeconds", args.header_timeout),
        ("http", "bodyTimeoutSeconds", args.body_timeout),
        ("http", "idleTimeoutSeconds", args.idle_timeout),
        ("trust", "adminPort", args.admin_port),
        ("trust", "adminKeys", args.admin_key or None),
        ("trust", "trustAllClients", args.trust_all_clients or None),
    ):
        if value is not None:
            section_data = data.setdefault(section, {})
            assert isinstance(section_data, dict)
            section_data[key] = value
    if args.epp_port is not None or args.epp_relay:
        epp = data.setdefault("epp", {})
        assert isinstance(epp, dict)
        if args.epp_port is not None:
            epp["port"] = args.epp_port
        if args.epp_relay:
            epp["relays"] = dict(v.split("=", 1) for v in args.epp_relay)
    return RouterConfig.model_validate(data)


async def serve(config: RouterConfig) -> int:
    """Run one router process until SIGTERM or SIGINT (a supervisor's worker when started by one:
    the port shared, its admin port private and reported); the exit status."""
    from tandem.router.service import RouterService
    from tandem.router.supervisor import ADMIN_HOST, WorkerLink

    link = WorkerLink.from_env()
    if link is not None:
        link.bind_to_supervisor()
    service = RouterService(
        config,
        reuse_port=link is not None,
        admin_host=ADMIN_HOST if link is not None else None,
    )
    await service.start()
    if link is not None and service.admin_port is not None:
        link.ready(service.admin_port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await service.stop()
    return 0


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
    except ValidationError as exc:
        print(f"tandem router: invalid configuration:\n{exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if config.processes > 1:
        from tandem.router.supervisor import supervise

        run = supervise(config)
    else:
        run = serve(config)
    try:
        import uvloop
    except ImportError:
        return asyncio.run(run)
    return uvloop.run(run)
