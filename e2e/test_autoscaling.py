"""The autoscaler's closed loop on the real control plane with a real Prometheus.

Prometheus (Debian's server) discovers the engine pods from the test apiserver (HTTP service
discovery that emits kubernetes_sd's pod labels, as Debian builds Prometheus without kubernetes_sd;
the relabelling is the documented one) and scrapes the emulator processes on their pod IPs; the operator (installed by Helm,
running with the chart's RBAC) reads it. Long prompts through the router overload the single
prefill pod -> TTFT breaches its target -> the prefill pool grows -> the new pods' engines serve ->
TTFT returns under target; the decode pool, whose ITL stays low, does not move -> the load stops ->
both pools are at min once the stabilization window has passed. Bounded: each phase has a deadline
and the load generator a request cap.

Set TANDEM_AUTOSCALING_REPORT=DIR to also write the run's timeline (JSON, a Markdown table and a
PNG plot) into DIR; docs/autoscaling.md shows one such run.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import os
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client as k8s
from kubernetes import watch as k8s_watch

from e2e.conftest import ENGINE_EXTRA_ARGS
from e2e.harness.cluster import ControlPlane
from e2e.harness.kube import eventually
from e2e.harness.podrunner import PodRunner, RunningPod
from tandem.common.capacity import StepCost

# The autoscaling suite's Prometheus and load helpers, and the process helpers they build on.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "autoscaling"))
from load_generator import drive
from pod_discovery import pod_discovery
from prometheus_process import PrometheusProcess, engine_pods_job

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

NAME = NAMESPACE = "autoscale"
MODEL = "tiny-autoscale"
GROUP, VERSION, PLURAL = "tandem.dev", "v1alpha1", "servingclusters"
POOLS = ("prefill", "decode")
PROFILE = (
    Path(__file__).resolve().parent.parent / "tests" / "autoscaling" / "small-gpu-profile.yaml"
)
TARGET_TTFT_S = 2.5  # a bucket bound of vLLM's TTFT histogram (see docs: Tuning)
TARGET_ITL_S = 0.06
WINDOW_S = 20  # scale-down stabilization
# Load: 256-word prompts at 2/s, about 1.3x what one prefill engine of PROFILE can prefill.
RATE_PER_S = 2.0
PROMPT_WORDS = 256


def speedup() -> float:
    """The emulator speed-up every engine pod runs with (conftest's ENGINE_EXTRA_ARGS)."""
    args = list(ENGINE_EXTRA_ARGS)
    return float(args[args.index("--speedup") + 1]) if "--speedup" in args else 1.0


def slowed_profile(workdir: Path) -> Path:
    """PROFILE with every step time multiplied by the speed-up, so engines run at PROFILE's pace."""
    profile = yaml.safe_load(PROFILE.read_text())
    factor = speedup()
    profile["step"] = {key: value * factor for key, value in profile["step"].items()}
    path = workdir / "autoscale-profile.yaml"
    path.write_text(yaml.safe_dump(profile))
    return path


def manifest(prometheus_url: str, profile: Path) -> dict[str, Any]:
    pool_resources = {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"nvidia.com/gpu": 1}}
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "ServingCluster",
        "metadata": {"name": NAME, "namespace": NAMESPACE},
        "spec": {
            "model": {"name": "tiny", "servedName": MODEL},
            "engine": {"extraArgs": ["--timing-profile", str(profile)]},
            "prefill": {"replicas": 1, "resources": pool_resources},
            "decode": {"replicas": 1, "resources": pool_resources},
            "router": {"replicas": 1, "disaggregation": {"mode": "always"}},
            "monitoring": {"enabled": False},
            "autoscaling": {
                "enabled": True,
                "prometheusURL": prometheus_url,
                "intervalSeconds": 2,
                "metricsWindowSeconds": 8,
                "scaleDownStabilizationSeconds": WINDOW_S,
                "prefill": {"min": 1, "max": 3, "targetTTFTSeconds": TARGET_TTFT_S},
                "decode": {
                    "min": 1,
                    "max": 2,
                    "targetITLSeconds": TARGET_ITL_S,
                    "maxKVUsage": 0.85,
                },
            },
        },
    }


class Timeline:
    """Every autoscaler evaluation, as it lands in status (a watch on the ServingCluster).

    One row per evaluation: its time (from lastEvaluationTime), the load phase, and for each pool
    the status the autoscaler wrote (replicas, current, ready, decision, reason, observed).
    """

    def __init__(self, custom: k8s.CustomObjectsApi) -> None:
        self.custom = custom
        self.rows: list[dict[str, Any]] = []
        self.phase = "idle"
        self._t0: float | None = None
        self._seen: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="autoscaling-timeline", daemon=True)

    def __enter__(self) -> Timeline:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop.is_set():
            stream = k8s_watch.Watch()
            try:
                for event in stream.stream(
                    self.custom.list_namespaced_custom_object, GROUP, VERSION, NAMESPACE, PLURAL,
                    field_selector=f"metadata.name={NAME}", timeout_seconds=2,
                ):  # fmt: skip
                    self._record(event["object"])
                    if self._stop.is_set():
                        stream.stop()
            except (k8s.ApiException, OSError, ValueError):
                time.sleep(0.5)

    def _record(self, body: dict[str, Any]) -> None:
        scaling = (body.get("status") or {}).get("autoscaling") or {}
        stamps = {pool: (scaling.get(pool) or {}).get("lastEvaluationTime") for pool in POOLS}
        stamp = max((s for s in stamps.values() if s), default=None)
        if stamp is None or stamp in self._seen or any(s != stamp for s in stamps.values()):
            return
        self._seen.add(stamp)
        at = datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
        self._t0 = at if self._t0 is None else self._t0
        row: dict[str, Any] = {"t": round(at - self._t0, 3), "phase": self.phase}
        row.update({pool: dict(scaling[pool]) for pool in POOLS})
        self.rows.append(row)

    def last(self, pool: str) -> dict[str, Any]:
        return dict(self.rows[-1][pool]) if self.rows else {}


def served(pod: RunningPod) -> float:
    """Requests an engine finished (its own /metrics); 0 while it does not answer yet."""
    try:
        with urllib.request.urlopen(f"http://{pod.ip}:8000/metrics", timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return 0.0
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:request_success_total{")
    )


@pytest.fixture(scope="module")
def prometheus(api: k8s.ApiClient) -> Iterator[PrometheusProcess]:
    with pod_discovery(api, [NAMESPACE]) as discovery_url:
        server = PrometheusProcess([engine_pods_job(discovery_url)]).start()
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture(scope="module")
def autoscaled(
    tandem_release: RunningPod,
    prometheus: PrometheusProcess,
    api: k8s.ApiClient,
    control_plane: ControlPlane,
) -> Iterator[dict[str, Any]]:
    core = k8s.CoreV1Api(api)
    core.create_namespace({"metadata": {"name": NAMESPACE}})
    custom = k8s.CustomObjectsApi(api)
    body = manifest(prometheus.url, slowed_profile(control_plane.workdir))
    custom.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, body)
    try:
        yield body
    finally:
        custom.delete_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, NAME)
        core.delete_namespace(NAMESPACE)


def test_load_grows_the_breaching_pool_and_idle_shrinks_it_back(
    autoscaled: dict[str, Any],
    api: k8s.ApiClient,
    pod_runner: PodRunner,
    prometheus: PrometheusProcess,
) -> None:
    custom, core = k8s.CustomObjectsApi(api), k8s.CoreV1Api(api)

    def running(role: str) -> list[RunningPod]:
        return [p for p in pod_runner.by_role(role, NAMESPACE) if p.child.alive()]

    def details() -> str:
        return f"timeline tail: {json.dumps(timeline.rows[-5:], indent=1)}\n{pod_runner.report()}"

    report_dir = os.environ.get("TANDEM_AUTOSCALING_REPORT")
    spec = autoscaled["spec"]["autoscaling"]
    with Timeline(custom) as timeline, _report_on_exit(report_dir, timeline, spec):
        # Start: one pod per pool, serving, scraped, and the autoscaler holding them at min.
        eventually(lambda: len(running("prefill")) == 1 and len(running("decode")) == 1 and running("router"),
                   timeout_s=120, what="one prefill, one decode and a router process", details=details)  # fmt: skip
        prometheus.wait_for_targets(2, timeout_s=60)
        eventually(lambda: timeline.last("prefill").get("decision") in {"Steady", "Stabilizing"},
                   timeout_s=60, what="a first autoscaling decision with metrics", details=details)  # fmt: skip
        [router] = running("router")
        [first_prefill] = running("prefill")

        # Load: the prefill pool's TTFT breaches; it grows; new engines serve; TTFT recovers.
        timeline.phase = "load"
        stop = asyncio.Event()
        loop = asyncio.new_event_loop()
        load_thread = threading.Thread(
            target=lambda: loop.run_until_complete(
                drive(f"http://{router.ip}:8000", MODEL, RATE_PER_S, 150, PROMPT_WORDS, 4,
                      max_requests=900, timeout_s=120, stop=stop)
            ),
            name="autoscaling-load",
        )  # fmt: skip
        load_thread.start()
        try:
            grown = eventually(
                lambda: timeline.last("prefill").get("replicas", 0) >= 2 and timeline.last("prefill"),
                timeout_s=60, what="the prefill pool to grow", details=details,
            )  # fmt: skip
            assert grown["decision"] in {"ScaledUp", "Steady", "Stabilizing"}

            def new_engines_serve() -> bool:
                fresh = [p for p in running("prefill") if p.name != first_prefill.name]
                return len(fresh) >= 1 and all(served(p) > 0 for p in fresh)

            eventually(new_engines_serve, timeout_s=60, interval_s=1, what="the new prefill engines to serve",
                       details=details)  # fmt: skip

            recovered_rows: list[float] = []

            def recovered() -> bool:
                """TTFT under target on two evaluations in a row, with the offered load served."""
                row = timeline.rows[-1] if timeline.rows else {"t": None, "prefill": {}}
                observed = row["prefill"].get("observed") or {}
                latency = observed.get("latencySeconds")
                good = (
                    latency is not None
                    and latency <= TARGET_TTFT_S
                    and observed.get("engines", 0) >= 2
                    and (observed.get("requestRate") or 0) >= 0.6 * RATE_PER_S
                )
                if not good:
                    recovered_rows.clear()
                elif row["t"] not in recovered_rows:
                    recovered_rows.append(row["t"])
                return len(recovered_rows) >= 2

            # The first engine's backlog drains and the window (8 s) moves past it.
            eventually(recovered, timeout_s=120, interval_s=1, what="TTFT p90 back under its target",
                       details=details)  # fmt: skip
        finally:
            loop.call_soon_threadsafe(stop.set)
            load_thread.join(timeout=150)
            loop.close()
        peak_prefill = max(row["prefill"]["replicas"] for row in timeline.rows)
        assert 2 <= peak_prefill <= 3
        assert max(row["decode"]["replicas"] for row in timeline.rows) <= 2
        assert_growth_follows_own_signal(timeline.rows)

        # Idle: both pools shrink to min, and only after the stabilization window.
        timeline.phase = "idle"
        eventually(
            lambda: timeline.last("prefill").get("replicas") == 1 and len(running("prefill")) == 1,
            timeout_s=WINDOW_S + 60, interval_s=1, what="the prefill pool back at min", details=details,
        )  # fmt: skip
        assert timeline.last("decode").get("replicas") == 1
        assert_no_early_scale_down(timeline.rows, "prefill")

    events = core.list_namespaced_event(
        NAMESPACE, field_selector=f"involvedObject.name={NAME}"
    ).items
    reasons = {event.reason for event in events}
    assert {"ScaledUp", "ScaledDown"} <= reasons, reasons
    body = custom.get_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, NAME)
    conditions = {c["type"]: c for c in body["status"].get("conditions", [])}
    assert conditions.get("MetricsUnavailable", {}).get("status") in {None, "False"}
    assert body["status"]["autoscaling"]["prefill"]["replicas"] == 1


def test_prometheus_unreachable_holds_the_pools_and_says_so(
    autoscaled: dict[str, Any], api: k8s.ApiClient
) -> None:
    custom, core = k8s.CustomObjectsApi(api), k8s.CoreV1Api(api)
    before = custom.get_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, NAME)
    sizes = {pool: before["status"]["autoscaling"][pool]["replicas"] for pool in POOLS}
    custom.patch_namespaced_custom_object(
        GROUP,
        VERSION,
        NAMESPACE,
        PLURAL,
        NAME,
        {"spec": {"autoscaling": {"prometheusURL": "http://127.0.0.1:9"}}},
    )

    def unavailable() -> dict[str, Any] | None:
        body = custom.get_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, NAME)
        conditions = {c["type"]: c for c in body["status"].get("conditions", [])}
        condition = conditions.get("MetricsUnavailable", {})
        return body if condition.get("status") == "True" else None

    body = eventually(unavailable, timeout_s=30, what="MetricsUnavailable=True")
    message = {c["type"]: c for c in body["status"]["conditions"]}["MetricsUnavailable"]["message"]
    assert "127.0.0.1:9" in message
    for pool in POOLS:
        status = body["status"]["autoscaling"][pool]
        assert (status["decision"], status["replicas"]) == ("MetricsUnavailable", sizes[pool])
    events = core.list_namespaced_event(
        NAMESPACE, field_selector=f"involvedObject.name={NAME}"
    ).items
    assert "MetricsUnavailable" in {event.reason for event in events}


def test_planner_mode_sizes_prefill_from_the_offered_load(
    autoscaled: dict[str, Any],
    api: k8s.ApiClient,
    pod_runner: PodRunner,
    prometheus: PrometheusProcess,
) -> None:
    """`mode: planner`, seeded with the engines' own profile: the prompt-heavy load grows the
    prefill pool from its token rate, decode stays at min, and status shows the plan's inputs.

    The seed is PROFILE's step, not the slowed profile the engines are given: they run that one
    `speedup()` times faster, so in the wall-clock seconds of their metrics (which the planner
    reads) they step at PROFILE's pace. Seeded 10x slower, the planner sizes decode for
    1 / (0.15 + 0.015) s = 6.06 output tokens/s per engine (the ITL target below the step's base
    cost): decode grows to 2 once the output rate passes 6.06 x 0.8 = 4.85 tokens/s, which this
    load's 2 requests/s x 4 tokens reaches, so decode stayed at 1 only when prefill's growth was
    seen first. Seeded right, one decode engine serves 500 tokens/s at the ITL target."""
    custom = k8s.CustomObjectsApi(api)
    step = yaml.safe_load(PROFILE.read_text())["step"]
    seed = {StepCost.model_fields[key].alias: value for key, value in step.items()}
    custom.patch_namespaced_custom_object(
        GROUP, VERSION, NAMESPACE, PLURAL, NAME,
        {"spec": {"autoscaling": {"prometheusURL": prometheus.url, "mode": "planner",
                                  "planner": {"startupSeconds": 5, "step": seed}}}},
    )  # fmt: skip

    def planned(pool: str) -> dict[str, Any]:
        body = custom.get_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, NAME)
        status = (body.get("status") or {}).get("autoscaling", {}).get(pool) or {}
        return status if status.get("planner") else {}

    eventually(lambda: planned("prefill"), timeout_s=60, what="a first plan in status")
    [router] = [p for p in pod_runner.by_role("router", NAMESPACE) if p.child.alive()]
    stop = asyncio.Event()
    loop = asyncio.new_event_loop()
    load_thread = threading.Thread(
        target=lambda: loop.run_until_complete(
            drive(f"http://{router.ip}:8000", MODEL, RATE_PER_S, 90, PROMPT_WORDS, 4,
                  max_requests=400, timeout_s=120, stop=stop)
        ),
        name="planner-load",
    )  # fmt: skip
    load_thread.start()
    try:
        # Grown, on a plan whose window holds served prompts (the first growth may come from
        # the standing queue alone, before any prompt finished in the window).
        grown = eventually(
            lambda: (s := planned("prefill")).get("replicas", 0) >= 2
            and s["planner"]["demandTokensPerSecond"] > 0 and s,
            timeout_s=90, what="the planner to grow prefill on the served load",
        )  # fmt: skip
    finally:
        loop.call_soon_threadsafe(stop.set)
        load_thread.join(timeout=150)
        loop.close()
    plan = grown["planner"]
    assert "uncached prompt tokens/s" in grown["reason"]
    # The seed is this profile: one engine prefills ~1 / 2.4 ms = ~416 tokens/s (the slowdown
    # learned on a loaded machine may lower it).
    assert 0 < plan["capacityTokensPerSecond"] <= 416 * 1.05
    assert plan["promptTokensPerRequest"] >= PROMPT_WORDS
    assert planned("decode").get("replicas") == 1


def assert_growth_follows_own_signal(rows: list[dict[str, Any]]) -> None:
    """A pool grows only on an evaluation where its own signal breached its target."""
    targets = {"prefill": TARGET_TTFT_S, "decode": TARGET_ITL_S}
    for row in rows:
        for pool in POOLS:
            status = row[pool]
            if status["replicas"] <= status["current"]:
                continue
            observed = status.get("observed") or {}
            latency_breach = (observed.get("latencySeconds") or 0) > targets[pool] * 1.1
            kv_breach = pool == "decode" and (observed.get("kvUsage") or 0) > 0.85 * 1.1
            assert latency_breach or kv_breach, (pool, status)


def assert_no_early_scale_down(rows: list[dict[str, Any]], pool: str) -> None:
    """Every shrink comes a full window after the last evaluation that recommended the old size."""
    for index, row in enumerate(rows):
        status = row[pool]
        if status["replicas"] >= status["current"]:
            continue
        held = [r["t"] for r in rows[:index] if r[pool]["recommendation"] > status["replicas"]]
        assert held, f"a scale-down without a higher recommendation before it: {status}"
        assert row["t"] - held[-1] >= WINDOW_S - 0.5, (row, held[-1])


@contextlib.contextmanager
def _report_on_exit(
    directory: str | None, timeline: Timeline, autoscaling: dict[str, Any]
) -> Iterator[None]:
    """Write the report when asked, whether the run passed or failed."""
    try:
        yield
    finally:
        if directory and timeline.rows:
            write_report(Path(directory), timeline.rows, autoscaling)


def write_report(directory: Path, rows: list[dict[str, Any]], autoscaling: dict[str, Any]) -> None:
    """The run as closed-loop-run.json (the replay fixture of tests/autoscaling), a Markdown
    table (one row per change) and a PNG plot."""
    directory.mkdir(parents=True, exist_ok=True)
    run = {"autoscaling": {**autoscaling, "prometheusURL": "http://127.0.0.1:9090"}, "rows": rows}
    (directory / "closed-loop-run.json").write_text(json.dumps(run, indent=1))
    lines = [
        "| t (s) | phase | prefill pods (ready) | prefill TTFT p90 (s) | prefill waiting | decode pods (ready) | decode ITL p90 (s) | decision |",
        "|---:|---|---|---:|---:|---|---:|---|",
    ]
    previous = None
    for row in rows:
        p, d = row["prefill"], row["decode"]
        key = (row["phase"], p["replicas"], p["ready"], d["replicas"], d["ready"], p["decision"])
        if key == previous:
            continue
        previous = key
        po, do = p.get("observed") or {}, d.get("observed") or {}

        def fmt(value: Any) -> str:
            return "-" if value is None else f"{value:.3g}"

        lines.append(
            f"| {row['t']:.0f} | {row['phase']} | {p['replicas']} ({p['ready']}) | {fmt(po.get('latencySeconds'))} "
            f"| {fmt(po.get('waiting'))} | {d['replicas']} ({d['ready']}) | {fmt(do.get('latencySeconds'))} "
            f"| {p['decision'] or ''} |"
        )
    (directory / "autoscaling-e2e.md").write_text("\n".join(lines) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [row["t"] for row in rows]
    fig, (pods, ttft, itl) = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    pods.step(t, [row["prefill"]["replicas"] for row in rows], where="post", label="prefill pods")
    pods.step(t, [row["decode"]["replicas"] for row in rows], where="post", label="decode pods")
    pods.set_ylabel("replicas")
    pods.legend(loc="upper right")
    targets = {
        "prefill": autoscaling["prefill"]["targetTTFTSeconds"],
        "decode": autoscaling["decode"]["targetITLSeconds"],
    }
    for ax, pool, name in (
        (ttft, "prefill", "prefill TTFT p90"),
        (itl, "decode", "decode ITL p90"),
    ):
        values = [(row[pool].get("observed") or {}).get("latencySeconds") for row in rows]
        ax.plot(t, [v if v is not None else float("nan") for v in values], marker=".", label=name)
        ax.axhline(targets[pool], linestyle="--", color="grey", label="target")
        ax.set_yscale("log")
        ax.set_ylabel("seconds")
        ax.legend(loc="upper right")
    itl.set_xlabel("time since the first evaluation (s)")
    for ax in (pods, ttft, itl):
        for start, end in _phase_spans(rows, "load"):
            ax.axvspan(start, end, color="orange", alpha=0.15)
    fig.suptitle(
        "Closed loop: load on (shaded) -> pools grow on their own signals -> idle -> back to min"
    )
    fig.tight_layout()
    fig.savefig(directory / "autoscaling-e2e.png", dpi=100)
    plt.close(fig)


def _phase_spans(rows: list[dict[str, Any]], phase: str) -> list[tuple[float, float]]:
    spans: list[tuple[float, float]] = []
    start = None
    for row in rows:
        if row["phase"] == phase and start is None:
            start = row["t"]
        elif row["phase"] != phase and start is not None:
            spans.append((start, row["t"]))
            start = None
    if start is not None:
        spans.append((start, rows[-1]["t"]))
    return spans
