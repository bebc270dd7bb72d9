"""A running local cluster: load the manifest, plan ports, start engines then the router, stop all."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

from tandem.common.ports import bound_free_port
from tandem.local.plan import LOCALHOST, LocalOptions, LocalPlan, build_plan
from tandem.local.supervisor import Supervisor
from tandem.local.zero import LocalZero, stop_task
from tandem.operator.api import ServingCluster
from tandem.operator.manifest import load_manifest, parse_manifest

PROFILES_DIR = Path(__file__).resolve().parent.parent / "emulator" / "profiles"
DEFAULT_PROFILE = PROFILES_DIR / "h200-llama-3.1-8b.yaml"


def parse_set(text: str) -> tuple[list[str], Any]:
    """`spec.decode.replicas=1` -> (["spec", "decode", "replicas"], 1); the value is read as YAML."""
    path, eq, value = text.partition("=")
    if not eq or not path:
        raise ValueError(f"--set wants PATH=VALUE, got {text!r}")
    return path.split("."), yaml.safe_load(value)


def load_cluster(path: str | Path, sets: list[str] | None = None) -> ServingCluster:
    """The manifest's ServingCluster, with `--set` overrides applied before validation."""
    sc = load_manifest(path)
    if not sets:
        return sc
    document = sc.model_dump(mode="json", by_alias=True, exclude={"status"}, exclude_none=True)
    for item in sets:
        keys, value = parse_set(item)
        node = document
        for key in keys[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ValueError(f"--set {item}: {key} is not an object")
        node[keys[-1]] = value
    return parse_manifest(document)


class PortPool:
    """Free TCP ports on 127.0.0.1 outside the ephemeral range (see tandem.common.ports), held
    bound until released so two picks never collide."""

    def __init__(self) -> None:
        self._held: list[socket.socket] = []

    def take(self) -> int:
        sock = bound_free_port(LOCALHOST)
        self._held.append(sock)
        port: int = sock.getsockname()[1]
        return port

    def release(self) -> None:
        for sock in self._held:
            sock.close()
        self._held.clear()


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((LOCALHOST, port))
        except OSError:
            return False
    return True


class LocalCluster:
    """`async with LocalCluster(sc, options, run_dir) as plan:` — engines and router healthy inside."""

    def __init__(
        self,
        sc: ServingCluster,
        options: LocalOptions,
        run_dir: Path,
        startup_timeout_s: float | None = None,
        grace_s: float = 10.0,
        report: Callable[[str], None] = print,
    ) -> None:
        self.sc, self.options, self.run_dir = sc, options, run_dir
        self.startup_timeout_s = startup_timeout_s or (900.0 if options.engine == "vllm" else 120.0)
        self.supervisor = Supervisor(run_dir / "logs", grace_s)
        self.plan: LocalPlan | None = None
        # Scale to zero (spec.autoscaling.scaleToZero): its loop and where it reports changes.
        self.report = report
        self.zero: LocalZero | None = None
        self._zero_task: asyncio.Task[None] | None = None

    def make_plan(self) -> LocalPlan:
        ports = PortPool()
        try:
            return build_plan(self.sc, self.options, ports.take, self.run_dir, os.environ)
        finally:
            ports.release()

    async def start(self) -> LocalPlan:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        plan = self.plan = self.make_plan()
        (self.run_dir / "router.yaml").write_text(plan.router_config.to_yaml())
        engines = [await self.supervisor.start(spec) for spec in plan.engines]
        await self.supervisor.wait_healthy(engines, self.startup_timeout_s)
        if plan.tokenizer_fetch is not None:
            await self.supervisor.run_to_completion(plan.tokenizer_fetch, 300.0)
        router = await self.supervisor.start(plan.router)
        await self.supervisor.wait_healthy([router], 60.0)
        if self.sc.spec.autoscaling.scale_to_zero.enabled:
            self.zero = LocalZero(self.sc, plan, self.supervisor, engines, self.report)
            self._zero_task = asyncio.get_running_loop().create_task(self.zero.run())
        return plan

    async def stop(self) -> None:
        await stop_task(self._zero_task)
        self._zero_task = None
        await self.supervisor.stop()

    async def __aenter__(self) -> LocalPlan:
        try:
            return await self.start()
        except BaseException:
            with contextlib.suppress(Exception):
                await self.stop()
            raise

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()
