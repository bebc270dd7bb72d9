"""`tandem up`'s scale to zero: stop a cluster's engines after its idle window and start them
again when its router holds requests, by the operator's own rules (autoscaling/zero.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, ConfigDict

from tandem.common.roles import Role
from tandem.local.plan import LocalPlan, ProcessSpec
from tandem.local.supervisor import Child, Supervisor
from tandem.operator.api import ServingCluster
from tandem.operator.autoscaling.zero import RouterDemand, ZeroMemory, ZeroPolicy, zero_steps

log = logging.getLogger("tandem.local.zero")


class RouterCounts(BaseModel):
    """The router's counters at one read: requests arrived, and requests P/D would have taken."""

    model_config = ConfigDict(frozen=True)

    arrivals: float = 0.0
    prefill_wanted: float = 0.0


def _sums(text: str) -> dict[str, float]:
    """Each sample name of a Prometheus exposition with its values summed over labels."""
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    return sums


def router_demand(text: str, previous: RouterCounts | None) -> tuple[RouterDemand, RouterCounts]:
    """The router's /metrics as the demand the zero rules read, with the counters to pass next:

        held      = tandem_router_engine_wait_requests
        in_flight = sum of tandem_router_engine_in_flight
        arrived   = tandem_router_arrivals_total - its previous read (0 at the first read, and
                    after a router restart, when the counter went back)
        wanted    = the same for tandem_router_prefill_wanted_total
    The window of `arrived` and `wanted` is the time between two reads."""
    sums = _sums(text)
    counts = RouterCounts(
        arrivals=sums.get("tandem_router_arrivals_total", 0.0),
        prefill_wanted=sums.get("tandem_router_prefill_wanted_total", 0.0),
    )
    before = previous or counts
    demand = RouterDemand(
        routers=1,
        held=sums.get("tandem_router_engine_wait_requests", 0.0),
        in_flight=sums.get("tandem_router_engine_in_flight", 0.0),
        arrived=max(0.0, counts.arrivals - before.arrivals),
        prefill_wanted=max(0.0, counts.prefill_wanted - before.prefill_wanted),
    )
    return demand, counts


def pool_of(spec: ProcessSpec) -> Role:
    """The pool an engine process belongs to (a colocated worker is the decode pool)."""
    return "prefill" if spec.role == "prefill" else "decode"


def zero_policy(sc: ServingCluster, engines: Sequence[ProcessSpec]) -> ZeroPolicy:
    """The cluster's scale-to-zero settings; a pool wakes to every engine the run planned."""
    planned = {pool: sum(pool_of(e) == pool for e in engines) for pool in ("prefill", "decode")}
    return ZeroPolicy(
        idle_s=sc.spec.autoscaling.scale_to_zero.idle_seconds,
        mode=sc.spec.router.disaggregation.mode,
        decode_min=max(1, planned["decode"]),
        prefill_min=max(1, planned["prefill"]),
    )


class LocalZero:
    """The loop: every `poll_s` read the router's /metrics, apply the zero rules, stop or start
    the engine processes of each pool. `report` receives one line per change."""

    def __init__(
        self,
        sc: ServingCluster,
        plan: LocalPlan,
        supervisor: Supervisor,
        running: Sequence[Child],
        report: Callable[[str], None],
        poll_s: float = 0.5,
    ) -> None:
        self.plan = plan
        self.supervisor = supervisor
        self.report = report
        self.poll_s = poll_s
        self.policy = zero_policy(sc, plan.engines)
        self.pools: dict[Role, list[ProcessSpec]] = {}
        for spec in plan.engines:
            self.pools.setdefault(pool_of(spec), []).append(spec)
        self.running: dict[Role, list[Child]] = {pool: [] for pool in self.pools}
        for child in running:
            self.running[pool_of(child.spec)].append(child)
        self.memory = ZeroMemory()
        self.counts: RouterCounts | None = None

    async def read_demand(self, session: aiohttp.ClientSession) -> RouterDemand | None:
        try:
            async with session.get(
                self.plan.metrics_urls()["router"], timeout=aiohttp.ClientTimeout(total=2)
            ) as response:
                text = await response.text()
        except (aiohttp.ClientError, TimeoutError):
            return None
        demand, self.counts = router_demand(text, self.counts)
        return demand

    async def step(self, demand: RouterDemand | None, now: float) -> None:
        """One evaluation: apply the zero rules to the pools as they run now."""
        sizes: Mapping[Role, int] = {pool: len(c) for pool, c in self.running.items()}
        steps, self.memory = zero_steps(self.policy, demand, sizes, self.memory, now)
        for pool, step in steps.items():
            if step.desired == 0 and self.running[pool]:
                children, self.running[pool] = self.running[pool], []
                self.report(step.message)
                await self.supervisor.stop_children(children)
            elif step.desired > 0 and not self.running[pool]:
                self.report(f"{step.message}; starting {len(self.pools[pool])} engine(s)")
                self.running[pool] = [await self.supervisor.start(s) for s in self.pools[pool]]

    async def run(self) -> None:
        async with aiohttp.ClientSession() as session:
            while True:
                try:
                    await self.step(await self.read_demand(session), time.monotonic())
                except Exception:  # one failed pass must not end scale-to-zero; the next retries
                    log.exception("scale-to-zero pass failed")
                await asyncio.sleep(self.poll_s)


async def stop_task(task: asyncio.Task[None] | None) -> None:
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
