"""The operator at scale on the real control plane of the e2e harness (etcd, kube-apiserver,
controller-manager, scheduler, KWOK): apply → children latency, a burst of N ServingClusters,
the operator's peak RSS and its apiserver requests per ServingCluster.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/operator_scale.py --clusters 100 500
    ... --operator-tree ../other-checkout     # the same measurement of another checkout's operator

Method. The operator runs as its own process (`tandem operator -n bench`, the code of
`--operator-tree`) with a ServiceAccount token bound to cluster-admin, so the apiserver's audit
log (level Metadata, that user only, stage ResponseComplete) holds exactly its requests: they are
counted at the apiserver, never by the operator itself. Per cluster count N, on a fresh control
plane:

1. apply → children: `--sequential` ServingClusters created one at a time; the time from the
   create returning to its 3 Deployments (the last kind applied) and the pools' 2
   PodDisruptionBudgets existing; the median. Existing = the audit log holds the operator's
   successful apply of each, so watching for them costs the API server nothing.
2. burst: N ServingClusters created at once (8 client threads); the time until all their
   children exist (after `--burst-limit-s`, how many had them instead, and the run goes on), and
   how many had them every 30 s.
3. settle: after the children exist, the run goes on until the operator has sent no request for
   `--quiet-s` seconds (or `--settle-s` passed): the Deployments' rollouts (KWOK runs the pods) drive the operator's
   status refreshes, which belong to the cost of a burst.

Requests per reconcile = the operator's requests from the burst's first create to the end of the
settle window, divided by N. Also printed: the split by verb and resource, how many status patches
were sent, whether every Deployment watch carried a labelSelector, VmHWM (peak RSS) of the
operator, and the CPU seconds of every process (control-plane components and operator) until the
children existed and until the end: which of them the machine's cores went to. The machine is
shared: the load average is printed beside every timing.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kubernetes import client as k8s

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from e2e.harness.binaries import Binaries  # noqa: E402
from e2e.harness.cluster import ControlPlane  # noqa: E402
from tandem.operator.crd import custom_resource_definition  # noqa: E402

NAMESPACE = "bench"
OPERATOR_SA = "tandem-operator"
OPERATOR_USER = f"system:serviceaccount:{NAMESPACE}:{OPERATOR_SA}"
GROUP, VERSION, PLURAL = "tandem.dev", "v1alpha1", "servingclusters"
SERVICE_RANGE = "10.0.0.0/16"
AUDIT_POLICY = f"""apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: Metadata
    users: ["{OPERATOR_USER}"]
  - level: None
"""


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process and its reaped children (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    utime, stime, cutime, cstime = (int(f) for f in fields[11:15])
    return (utime + stime + cutime + cstime) / os.sysconf("SC_CLK_TCK")


def manifest(name: str) -> dict[str, Any]:
    """A ServingCluster without GPUs, so KWOK schedules and runs every pod."""
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "ServingCluster",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"model": {"name": "meta-llama/Llama-3.1-8B-Instruct"}},
    }


class Audit:
    """The operator's requests from the apiserver's audit log (JSON lines), read incrementally:
    each call parses only the lines written since the last one."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.found: list[dict[str, Any]] = []
        # (resource, name) of every object the operator applied successfully, by the cluster
        # its name starts with (children are named CLUSTER-ROLE).
        self.applied: dict[str, set[tuple[str, str]]] = collections.defaultdict(set)

    def events(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return self.found
        with self.path.open("rb") as log:
            log.seek(self.offset)
            chunk = log.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]  # a line being written waits for the next call
        self.offset += len(complete)
        for line in complete.splitlines():
            event = json.loads(line)
            if event.get("stage") != "ResponseComplete":
                continue
            self.found.append(event)
            ref = event.get("objectRef", {})
            if event["verb"] == "patch" and event.get("responseStatus", {}).get("code", 0) < 300:
                name = ref.get("name", "")
                self.applied[name.rsplit("-", 1)[0]].add((ref.get("resource", ""), name))
        return self.found

    def since(self, start_ts: float) -> list[dict[str, Any]]:
        """Requests the operator made from `start_ts` (epoch seconds) on."""
        return [e for e in self.events() if _epoch(e["requestReceivedTimestamp"]) >= start_ts]


def _epoch(stamp: str) -> float:
    import datetime

    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


class Bench:
    def __init__(self, plane: ControlPlane, operator_tree: Path, workdir: Path) -> None:
        self.plane = plane
        self.operator_tree = operator_tree
        self.workdir = workdir
        self.api = plane.api_client()
        self.core = k8s.CoreV1Api(self.api)
        self.custom = k8s.CustomObjectsApi(self.api)
        self.audit = Audit(workdir / "audit.log")
        self.operator: subprocess.Popen[bytes] | None = None

    def prepare(self) -> None:
        k8s.ApiextensionsV1Api(self.api).create_custom_resource_definition(
            custom_resource_definition()
        )
        self.core.create_namespace({"metadata": {"name": NAMESPACE}})
        self.core.create_namespaced_service_account(NAMESPACE, {"metadata": {"name": OPERATOR_SA}})
        k8s.RbacAuthorizationV1Api(self.api).create_cluster_role_binding(
            {
                "metadata": {"name": "bench-operator"},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "ClusterRole",
                    "name": "cluster-admin",
                },
                "subjects": [
                    {"kind": "ServiceAccount", "name": OPERATOR_SA, "namespace": NAMESPACE}
                ],
            }
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the CRD is served once established
            try:
                self.custom.list_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL)
                return
            except k8s.ApiException:
                time.sleep(0.2)
        raise RuntimeError("the ServingCluster CRD was not served within 30 s")

    def start_operator(self) -> None:
        kubeconfig = self.plane.service_account_kubeconfig(NAMESPACE, OPERATOR_SA)
        env = {
            **os.environ,
            "KUBECONFIG": str(kubeconfig),
            "PYTHONPATH": str(self.operator_tree),
        }
        log = (self.workdir / "operator.log").open("wb")
        self.operator = subprocess.Popen(
            [sys.executable, "-m", "tandem.cli", "operator", "-n", NAMESPACE],
            env=env,
            cwd=self.operator_tree,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        # Ready once it has listed the ServingClusters (its first request on them).
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if any(
                e["objectRef"].get("resource") == PLURAL and e["verb"] in {"list", "watch"}
                for e in self.audit.events()
                if "objectRef" in e
            ):
                return
            if self.operator.poll() is not None:
                raise RuntimeError(f"operator exited: {self.workdir / 'operator.log'}")
            time.sleep(0.2)
        raise RuntimeError("the operator did not start watching within 60 s")

    def stop_operator(self) -> int:
        """Stops the operator; returns its peak RSS (VmHWM) in KiB."""
        assert self.operator is not None
        status = Path(f"/proc/{self.operator.pid}/status").read_text()
        peak = next(
            int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM")
        )
        self.operator.terminate()
        try:
            self.operator.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.operator.kill()
            self.operator.wait()
        return peak

    def processes(self) -> dict[str, int]:
        """Pid of every control-plane component and of the operator."""
        pids = {name: child.pid for name, child in self.plane.children.items()}
        if self.operator is not None:
            pids["operator"] = self.operator.pid
        return pids

    def cpu(self) -> dict[str, float]:
        return {name: cpu_seconds(pid) for name, pid in self.processes().items()}

    def children_done(self, names: set[str]) -> set[str]:
        """The clusters among `names` whose 3 Deployments (the last kind applied) and the pools'
        2 PDBs exist: read from the audit log, the operator's applies the API server answered
        with success, so that polling costs the API server nothing (listing 500 clusters'
        children twice a second took it about 0.6 s a time)."""
        self.audit.events()
        applied = self.audit.applied
        return {
            name
            for name in names
            if {("deployments", f"{name}-{role}") for role in ("prefill", "decode", "router")}
            | {("poddisruptionbudgets", f"{name}-{role}") for role in ("prefill", "decode")}
            <= applied.get(name, set())
        }

    def create(self, name: str) -> None:
        self.custom.create_namespaced_custom_object(
            GROUP, VERSION, NAMESPACE, PLURAL, manifest(name)
        )

    def sequential(self, count: int) -> list[float]:
        latencies = []
        for i in range(count):
            name = f"seq-{i}"
            self.create(name)
            start = time.monotonic()
            while not self.children_done({name}):
                if time.monotonic() - start > 60:
                    raise RuntimeError(f"{name}: children not there within 60 s")
                time.sleep(0.02)
            latencies.append(time.monotonic() - start)
        return latencies

    def burst(
        self, count: int, settle_s: float, quiet_s: float, burst_limit_s: float
    ) -> dict[str, Any]:
        names = {f"burst-{i}" for i in range(count)}
        cpu_before = self.cpu()
        start_wall, start = time.time(), time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(self.create, sorted(names)))
        created_s = time.monotonic() - start
        progress: list[tuple[float, int]] = []  # (seconds since the first create, clusters done)
        while (done := len(self.children_done(names))) < count:
            elapsed = time.monotonic() - start
            if not progress or elapsed - progress[-1][0] >= 30:
                progress.append((round(elapsed, 1), done))
            if elapsed > burst_limit_s:
                break  # reported as not all done: how many were, and the requests so far
            time.sleep(0.5)
        children_s = time.monotonic() - start
        load_at_children = load_average()
        cpu_at_children = self.cpu()
        seen, last_change = 0, time.monotonic()
        while time.monotonic() - start - children_s < settle_s:
            time.sleep(1.0)
            now = len(self.audit.since(start_wall))
            if now != seen:
                seen, last_change = now, time.monotonic()
            elif time.monotonic() - last_change >= quiet_s:
                break
        settled_s = time.monotonic() - start
        cpu_settled = self.cpu()
        requests = self.audit.since(start_wall)
        by_kind = collections.Counter(
            f"{e['verb']} {e.get('objectRef', {}).get('resource', '?')}"
            + (
                f"/{e['objectRef']['subresource']}"
                if e.get("objectRef", {}).get("subresource")
                else ""
            )
            for e in requests
        )
        return {
            "clusters": count,
            "create_s": round(created_s, 2),
            "all_children_s": round(children_s, 2) if done == count else None,
            "children_done_at_limit": None if done == count else done,
            "load_at_children": load_at_children,
            "progress": progress,
            "settled_s": round(settled_s, 1),
            "requests": len(requests),
            "requests_per_cluster": round(len(requests) / count, 1),
            "status_patches": by_kind["patch servingclusters/status"],
            "events_posted": by_kind["create events"] + by_kind["patch events"],
            "by_kind": dict(by_kind.most_common()),
            # CPU seconds each process spent from the first create until the children existed,
            # and over the whole burst + settle: which of them the 2 cores went to.
            "cpu_s_to_children": {
                name: round(cpu_at_children[name] - cpu_before[name], 1) for name in cpu_before
            },
            "cpu_s_total": {
                name: round(cpu_settled[name] - cpu_before[name], 1) for name in cpu_before
            },
        }

    def deployment_watches(self) -> list[str]:
        return [
            e["requestURI"]
            for e in self.audit.events()
            if e["verb"] == "watch" and e.get("objectRef", {}).get("resource") == "deployments"
        ]


def run_one(
    binaries: Binaries, operator_tree: Path, count: int, args: argparse.Namespace
) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="tandem-opbench-"))
    policy = workdir / "audit-policy.yaml"
    policy.write_text(AUDIT_POLICY)
    plane = ControlPlane(
        workdir,
        binaries,
        apiserver_args=[
            f"--audit-policy-file={policy}",
            f"--audit-log-path={workdir / 'audit.log'}",
            "--audit-log-format=json",
            "--audit-log-mode=blocking",
            # Every ServingCluster takes two ClusterIPs (the router's Services): the harness's
            # /24 holds 126 clusters, after which every reconcile fails with "range is full".
            f"--service-cluster-ip-range={SERVICE_RANGE}",
        ],
    )
    plane.start()
    bench = Bench(plane, operator_tree, workdir)
    try:
        bench.prepare()
        bench.start_operator()
        latencies = bench.sequential(args.sequential)
        load_seq = load_average()
        result = bench.burst(count, args.settle_s, args.quiet_s, args.burst_limit_s)
        result["rss_peak_mib"] = round(bench.stop_operator() / 1024, 1)
        result["apply_to_children_median_s"] = round(statistics.median(latencies), 3)
        result["load_at_sequential"] = load_seq
        watches = bench.deployment_watches()
        result["deployment_watches"] = len(watches)
        result["deployment_watches_with_selector"] = sum("labelSelector" in w for w in watches)
        return result
    finally:
        if bench.operator is not None and bench.operator.poll() is None:
            bench.stop_operator()
        plane.stop()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"kept {workdir}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clusters", type=int, nargs="+", default=[100, 500])
    parser.add_argument("--operator-tree", type=Path, default=ROOT,
                        help="checkout whose operator code runs (default: this one)")  # fmt: skip
    parser.add_argument("--sequential", type=int, default=10, help="clusters applied one by one")
    parser.add_argument("--settle-s", type=float, default=120.0, help="longest settle window")
    parser.add_argument("--burst-limit-s", type=float, default=600.0,
                        help="give up waiting for a burst's children after this")  # fmt: skip
    parser.add_argument("--quiet-s", type=float, default=8.0, help="operator silence that ends it")
    parser.add_argument("--keep", action="store_true", help="keep the work folders and logs")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    binaries = Binaries.locate()
    results = []
    for count in args.clusters:
        result = {
            "operator_tree": str(args.operator_tree),
            **run_one(binaries, args.operator_tree.resolve(), count, args),
        }
        results.append(result)
        print(json.dumps(result), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
