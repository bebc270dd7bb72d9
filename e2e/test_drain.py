"""Drain-safe removal on the real control plane: under continuous load through the router, an
eviction (with the pool's PodDisruptionBudget refusing a second one), a rolling update of each
pool's image and a decode scale-down, with zero failed requests.

Each removed engine pod goes the way a kubelet takes it (e2e/harness/termination.py): the
rendered preStop sleep, SIGTERM, the emulator's vLLM-faithful drain (`--shutdown-timeout`,
docs/protocols.md §9), exit, then the Pod object goes. New engine pods turn Ready only when their
process answers /health (e2e/harness/readiness.py), so each rollout step waits for its new pod.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client as k8s

from e2e.harness.kube import eventually
from e2e.harness.load import Load
from e2e.harness.podrunner import PodRunner, RunningPod
from e2e.harness.termination import TerminationRecord

pytestmark = pytest.mark.e2e

NAMESPACE = "drain"
NAME = "drain"
MODEL = "drain-model"
GROUP, VERSION, PLURAL = "tandem.dev", "v1alpha1", "servingclusters"
GRACE_S = 30
PRE_STOP_S = 2


def _manifest() -> dict[str, Any]:
    pool = {
        "replicas": 2,
        "terminationGracePeriodSeconds": GRACE_S,
        "drain": {"preStopSeconds": PRE_STOP_S},
    }
    return {
        "apiVersion": "tandem.dev/v1alpha1",
        "kind": "ServingCluster",
        "metadata": {"name": NAME, "namespace": NAMESPACE},
        "spec": {
            "model": {"name": "meta-llama/Llama-3.1-8B-Instruct", "servedName": MODEL},
            "prefill": pool,
            "decode": pool,
            "router": {"replicas": 1, "disaggregation": {"mode": "always"}},
        },
    }


class Pools:
    def __init__(self, api: k8s.ApiClient, runner: PodRunner) -> None:
        self.core = k8s.CoreV1Api(api)
        self.apps = k8s.AppsV1Api(api)
        self.policy = k8s.PolicyV1Api(api)
        self.custom = k8s.CustomObjectsApi(api)
        self.runner = runner

    def patch(self, spec: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object(
            GROUP, VERSION, NAMESPACE, PLURAL, NAME, {"spec": spec}
        )

    def pods(self, role: str) -> list[k8s.V1Pod]:
        selector = f"tandem.dev/cluster={NAME},tandem.dev/role={role}"
        return list(self.core.list_namespaced_pod(NAMESPACE, label_selector=selector).items)

    def settled(self, role: str, count: int, image: str | None = None) -> bool:
        """`count` pods of `role`, none terminating, all Ready on `image`, each with a live process
        and the Deployment's rollout done."""
        pods = self.pods(role)
        if len(pods) != count or any(p.metadata.deletion_timestamp for p in pods):
            return False
        for pod in pods:
            conditions = {c.type: c.status for c in pod.status.conditions or []}
            if conditions.get("Ready") != "True":
                return False
            if image is not None and pod.spec.containers[0].image != image:
                return False
        names = {p.metadata.name for p in pods}
        running = {p.name for p in self.runner.by_role(role, NAMESPACE) if p.child.alive()}
        deployment = self.apps.read_namespaced_deployment(f"{NAME}-{role}", NAMESPACE).status
        return (
            names <= running
            and (deployment.updated_replicas or 0) == count
            and (deployment.available_replicas or 0) == count
        )

    def wait(self, role: str, count: int, image: str | None = None) -> None:
        def details() -> str:
            pods = [
                f"{p.metadata.name} deleting={bool(p.metadata.deletion_timestamp)} "
                f"{[(c.type, c.status) for c in p.status.conditions or []]}"
                for p in self.pods(role)
            ]
            deployment = self.apps.read_namespaced_deployment(f"{NAME}-{role}", NAMESPACE).status
            return f"{pods}\n{deployment}\n{self.runner.report()}"

        eventually(
            lambda: self.settled(role, count, image),
            timeout_s=90,
            what=f"{role} settled at {count} pods{f' on {image}' if image else ''}",
            details=details,
        )

    def router(self) -> RunningPod:
        def serving() -> RunningPod | None:
            routers = [p for p in self.runner.by_role("router", NAMESPACE) if p.child.alive()]
            return routers[0] if routers else None

        return eventually(serving, timeout_s=60, what="the router process")

    def evict(self, pod: k8s.V1Pod) -> int:
        """The eviction's HTTP status: 201 allowed, 429 refused by the budget."""
        eviction = k8s.V1Eviction(
            metadata=k8s.V1ObjectMeta(name=pod.metadata.name, namespace=NAMESPACE)
        )
        try:
            self.core.create_namespaced_pod_eviction(pod.metadata.name, NAMESPACE, eviction)
        except k8s.ApiException as error:
            return int(error.status)
        return 201


@pytest.fixture(scope="module")
def pools(tandem_release: RunningPod, api: k8s.ApiClient, pod_runner: PodRunner) -> Iterator[Pools]:
    pools = Pools(api, pod_runner)
    pools.core.create_namespace({"metadata": {"name": NAMESPACE}})
    pools.custom.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, _manifest())
    try:
        yield pools
    finally:
        pools.custom.delete_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, NAME)
        pools.core.delete_namespace(NAMESPACE)


def _terminations(runner: PodRunner, role: str) -> list[TerminationRecord]:
    return [t for t in runner.terminations if t.namespace == NAMESPACE and t.role == role]


def test_each_pool_renders_a_budget_a_pre_stop_sleep_and_a_drain_timeout(pools: Pools) -> None:
    for role in ("prefill", "decode"):
        pools.wait(role, 2)
        budget = eventually(
            lambda role=role: (
                (b := pools.policy.read_namespaced_pod_disruption_budget(f"{NAME}-{role}", NAMESPACE))
                and b.status
                and b.status.expected_pods == 2
                and b
            ),
            timeout_s=60,
            what=f"the {role} budget counting 2 pods",
        )  # fmt: skip
        assert budget.spec.max_unavailable == 1
        [container] = pools.pods(role)[0].spec.containers
        assert container.lifecycle.pre_stop.sleep.seconds == PRE_STOP_S
        args = container.args
        # 30 s of grace: 2 s preStop, then vLLM drains for 28 - min(10, 28 // 3) = 19 s.
        assert args[args.index("--shutdown-timeout") + 1] == "19"


def test_eviction_rollouts_and_scale_down_under_load_fail_no_request(pools: Pools) -> None:
    for role in ("prefill", "decode"):
        pools.wait(role, 2)
    router = pools.router()
    url = f"http://{router.ip}:8000"
    eventually(
        lambda: Load(url, MODEL).request("warm up", 4, stream=False) is None,
        timeout_s=60,
        what="a first completion through the router",
        details=pools.runner.report,
    )
    eventually(
        lambda: (
            pools.policy.read_namespaced_pod_disruption_budget(f"{NAME}-prefill", NAMESPACE)
            .status.disruptions_allowed == 1
        ),
        timeout_s=60,
        what="the prefill budget allowing one disruption",
    )  # fmt: skip
    started = time.monotonic()
    # Four workers decode 16,000 tokens each, about 11 s at the emulator's tenfold speed and five
    # times the preStop, started 3 s apart so that at any moment some have most of their stream
    # left: those are still on a decode engine at its SIGTERM, and it is vLLM's own drain that
    # finishes them. Two more send short requests throughout.
    load = Load(url, MODEL, long_workers=4, long_tokens=16_000, long_stagger_s=3.0).start()
    steps: dict[str, tuple[float, float]] = {}
    try:
        time.sleep(2)
        # A node drain's eviction: the first is allowed, a second at once is refused.
        mark = time.monotonic()
        first, second = pools.pods("prefill")
        assert pools.evict(first) == 201
        assert pools.evict(second) == 429
        pools.wait("prefill", 2)
        steps["eviction"] = (mark, time.monotonic())
        for role in ("prefill", "decode"):
            mark = time.monotonic()
            image = f"vllm/vllm-openai:v0.32.0-{role}-next"
            pools.patch({role: {"image": image}})
            pools.wait(role, 2, image)
            steps[f"{role} rollout"] = (mark, time.monotonic())
        mark = time.monotonic()
        pools.patch({"decode": {"replicas": 1}})
        pools.wait("decode", 1)
        steps["decode scale-down"] = (mark, time.monotonic())
        time.sleep(1)
    finally:
        result = load.stop()
    elapsed = time.monotonic() - started
    prefill, decode = _terminations(pools.runner, "prefill"), _terminations(pools.runner, "decode")
    lines = [
        f"{t.role} {t.name}: preStop {t.pre_stop_s:.1f} s, {t.held_at_sigterm} requests held at "
        f"SIGTERM, exit {t.exit_after_sigterm_s:.2f} s after it, killed {t.killed}"
        for t in prefill + decode
    ]
    print(
        f"\nload: {result.sent} requests in {elapsed:.1f} s, {result.ok} ok, "
        f"{len(result.failures)} failed, longest {result.longest_s:.1f} s; steps: "
        + ", ".join(f"{k} {end - begin:.1f} s" for k, (begin, end) in steps.items())
        + "\n"
        + "\n".join(lines)
    )
    assert result.failures == [], result.failures[:10]
    assert result.ok == result.sent
    # The load ran through every step: each saw requests in flight (all of which were answered).
    covered = {step: result.overlapping(begin, end) for step, (begin, end) in steps.items()}
    assert all(covered.values()), covered
    # 1 evicted + 2 rolled prefill pods; 2 rolled + 1 scaled-down decode pods.
    assert len(prefill) == 3, lines
    assert len(decode) == 3, lines
    for record in prefill + decode:
        assert record.pre_stop == "sleep", record
        assert record.pre_stop_s >= PRE_STOP_S - 0.5, record
        assert not record.killed, record
        assert record.exit_code == 0, record
    assert not [p for p in pools.runner.exited if p.namespace == NAMESPACE]
    assert sum(t.held_at_sigterm or 0 for t in decode) >= 1, lines
