"""The stand-in kubelet: runs one local process per Running pod on the KWOK node, and terminates it
as a kubelet does when the pod is deleted (preStop, SIGTERM, grace, SIGKILL: termination.py)."""

from __future__ import annotations

import base64
import datetime
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from kubernetes import client as k8s

from e2e.harness.cluster import NODE_NAME, ControlPlane
from e2e.harness.podspec import LaunchPlan, UnsupportedPod, plan_pod
from e2e.harness.processes import Child, Supervisor, log_tail
from e2e.harness.readiness import awaits_readiness, probe_passes, ready_patch
from e2e.harness.termination import RUNNER_ANNOTATION, TerminationRecord, grace_seconds, terminate

ROOT = Path(__file__).resolve().parents[2]  # this checkout: the pods run its package


@dataclass
class RunningPod:
    """A pod and the process standing in for its container."""

    namespace: str
    name: str
    uid: str
    ip: str
    role: str
    plan: LaunchPlan
    child: Child


class PodRunner:
    """Polls the pods bound to the KWOK node and keeps exactly one process per Running pod.

    Polling (every `interval_s`) rather than a watch keeps it simple and robust to apiserver
    restarts; a pod's process starts within one interval of it turning Running.
    """

    def __init__(
        self,
        plane: ControlPlane,
        *,
        label_selector: str | None = None,
        engine_extra_args: Sequence[str] = (),
        interval_s: float = 0.25,
    ) -> None:
        self.plane = plane
        self.label_selector = label_selector
        self.engine_extra_args = list(engine_extra_args)
        self.interval_s = interval_s
        self.workdir = plane.workdir / "pods"
        self.supervisor = Supervisor(self.workdir / "logs")
        # This interpreter running this checkout's package, wherever its virtualenv lives.
        self.tandem = (sys.executable, "-m", "tandem.cli")
        self.pods: dict[str, RunningPod] = {}
        self.exited: list[RunningPod] = []  # processes that died while their pod stayed
        self.history: list[RunningPod] = []  # every process started, in order
        self.errors: list[str] = []
        self.terminating: dict[str, RunningPod] = {}  # deleted pods whose process is stopping
        self.terminations: list[TerminationRecord] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pod-runner", daemon=True)
        self._core = k8s.CoreV1Api(plane.api_client())
        self._credentials: dict[tuple[str, str], Path] = {}
        self._terminators: list[threading.Thread] = []

    # -- public --------------------------------------------------------------------------------

    def start(self) -> PodRunner:
        self._thread.start()
        return self

    def stop(self) -> None:
        # Processes go first, gracefully, while the thread that started them still lives (they
        # are bound to it by PR_SET_PDEATHSIG); then the thread, then anything it started last.
        self._stop.set()
        with self._lock:
            for running in [*self.pods.values(), *self.terminating.values()]:
                self.supervisor.stop(running.child, grace_s=3)
            self.pods.clear()
        self._thread.join(timeout=10)
        for thread in list(self._terminators):
            thread.join(timeout=10)
        self.supervisor.stop_all()

    def leftovers(self) -> list[int]:
        return self.supervisor.leftovers()

    def snapshot(self) -> list[RunningPod]:
        with self._lock:
            return list(self.pods.values())

    def by_role(self, role: str, namespace: str | None = None) -> list[RunningPod]:
        return [
            pod
            for pod in self.snapshot()
            if pod.role == role and (namespace is None or pod.namespace == namespace)
        ]

    def logs(self, name: str, lines: int = 60) -> str:
        for running in self.history:
            if running.name == name:
                return log_tail(running.child.log, lines)
        return "(no such pod process)"

    def report(self) -> str:
        """Every process and error, with log tails: for assertion messages."""
        parts = [
            f"{p.namespace}/{p.name} {p.role} {p.ip} pid={p.child.pid}" for p in self.snapshot()
        ]
        parts += [
            f"TERMINATING {p.namespace}/{p.name} pid={p.child.pid}"
            for p in self.terminating.values()
        ]
        parts += [f"TERMINATED {t}" for t in self.terminations]
        parts += [f"EXITED {p.name}:\n{log_tail(p.child.log)}" for p in self.exited]
        parts += [f"ERROR {error}" for error in self.errors]
        return "\n".join(parts) or "(no pods)"

    # -- loop ----------------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync()
            except Exception as error:  # the apiserver may be briefly unavailable
                self._record_error(f"sync: {error!r}")
            self._stop.wait(self.interval_s)

    def _record_error(self, message: str) -> None:
        if not self.errors or self.errors[-1] != message:
            self.errors.append(message)

    def sync(self) -> None:
        """One reconciliation: start processes for new Running pods, stop those of gone pods."""
        listing = self._core.list_pod_for_all_namespaces(
            label_selector=self.label_selector, field_selector=f"spec.nodeName={NODE_NAME}"
        )
        api = self._core.api_client
        wanted: dict[str, dict[str, Any]] = {}
        deleted: dict[str, dict[str, Any]] = {}
        for item in listing.items:
            pod = api.sanitize_for_serialization(item)
            status = pod.get("status", {})
            if pod["metadata"].get("deletionTimestamp") is not None:
                deleted[pod["metadata"]["uid"]] = pod
            elif status.get("phase") == "Running" and status.get("podIP"):
                wanted[pod["metadata"]["uid"]] = pod
        with self._lock:
            for uid in list(self.pods):
                if uid in deleted:
                    self._begin_termination(self.pods.pop(uid), deleted[uid])
                elif uid not in wanted:  # gone without a graceful deletion (force-deleted)
                    self.supervisor.stop(self.pods.pop(uid).child, grace_s=3)
            # A process that died stays listed under its pod (so it is not restarted in a loop)
            # and is reported once in `exited`.
            for running in self.pods.values():
                if not running.child.alive() and running not in self.exited:
                    self.exited.append(running)
            for uid, pod in wanted.items():
                if uid not in self.pods and not self._stop.is_set():
                    self._launch(pod)
            unready = [
                pod
                for uid, pod in wanted.items()
                if uid in self.pods and self.pods[uid].child.alive() and awaits_readiness(pod)
            ]
        for pod in unready:
            if probe_passes(pod):
                now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
                meta = pod["metadata"]
                self._core.patch_namespaced_pod_status(
                    meta["name"], meta["namespace"], ready_patch(now)
                )

    def _launch(self, pod: Mapping[str, Any]) -> None:
        meta = pod["metadata"]
        scratch = self.workdir / meta["namespace"] / meta["name"]
        try:
            plan = plan_pod(
                pod,
                self._read_object_data,
                tandem=self.tandem,
                scratch=PurePosixPath(scratch),
                engine_extra_args=self.engine_extra_args,
            )
        except UnsupportedPod as error:
            self._record_error(f"{meta['namespace']}/{meta['name']}: {error}")
            return
        for path, content in plan.files.items():
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(content)
        env = _base_env() | plan.env
        env["KUBECONFIG"] = str(self._pod_credentials(pod))
        child = self.supervisor.start(f"{meta['namespace']}_{meta['name']}", plan.argv, env=env)
        self.pods[meta["uid"]] = running = RunningPod(
            namespace=meta["namespace"],
            name=meta["name"],
            uid=meta["uid"],
            ip=pod["status"]["podIP"],
            role=plan.role,
            plan=plan,
            child=child,
        )
        self.history.append(running)
        # From here on the pod's deletion is this runner's to finish, as it is a kubelet's.
        try:
            self._core.patch_namespaced_pod(
                meta["name"],
                meta["namespace"],
                {"metadata": {"annotations": {RUNNER_ANNOTATION: str(child.pid)}}},
            )
        except k8s.ApiException as error:  # deleted meantime: KWOK removed it, sync stops it
            self._record_error(f"annotating {meta['name']}: {error.reason}")

    def _begin_termination(self, running: RunningPod, pod: Mapping[str, Any]) -> None:
        """Terminates the pod's process in a thread of its own, then removes the Pod object."""
        record = TerminationRecord(
            running.namespace,
            running.name,
            running.role,
            grace_seconds(pod),
            next(
                iter((pod["spec"]["containers"][0].get("lifecycle") or {}).get("preStop", {})), ""
            ),
        )
        self.terminating[running.uid] = running
        self.terminations.append(record)
        seen_at = time.monotonic()

        def run() -> None:
            try:
                terminate(
                    running.child,
                    pod,
                    record,
                    env=_base_env() | running.plan.env,
                    tandem=self.tandem,
                    seen_at=seen_at,
                    stop=self._stop,
                )
                self._core.delete_namespaced_pod(
                    running.name,
                    running.namespace,
                    body=k8s.V1DeleteOptions(
                        grace_period_seconds=0,
                        preconditions=k8s.V1Preconditions(uid=running.uid),
                    ),
                )
            except k8s.ApiException as error:
                if error.status not in (404, 409):  # already gone, or another pod by that name
                    self._record_error(f"removing {running.name}: {error.reason}")
            except Exception as error:
                self._record_error(f"terminating {running.name}: {error!r}")
            finally:
                with self._lock:
                    self.terminating.pop(running.uid, None)
                    if running.child in self.supervisor.children:
                        self.supervisor.children.remove(running.child)

        thread = threading.Thread(target=run, name=f"terminate-{running.name}", daemon=True)
        self._terminators.append(thread)
        thread.start()

    def _pod_credentials(self, pod: Mapping[str, Any]) -> Path:
        """The pod's ServiceAccount identity, as the kubelet's projected token would give it."""
        key = (pod["metadata"]["namespace"], pod["spec"].get("serviceAccountName") or "default")
        if key not in self._credentials:
            self._credentials[key] = self.plane.service_account_kubeconfig(*key)
        return self._credentials[key]

    def _read_object_data(self, kind: str, namespace: str, name: str) -> dict[str, str] | None:
        try:
            if kind == "Secret":
                secret = self._core.read_namespaced_secret(name, namespace)
                return {k: base64.b64decode(v).decode() for k, v in (secret.data or {}).items()}
            return dict(self._core.read_namespaced_config_map(name, namespace).data or {})
        except k8s.ApiException as error:
            if error.status == 404:
                return None
            raise

    def wait(
        self, predicate: Callable[[list[RunningPod]], bool], *, timeout_s: float, what: str
    ) -> list[RunningPod]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            pods = self.snapshot()
            if predicate(pods):
                return pods
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}; pod processes:\n{self.report()}")


def _base_env() -> dict[str, str]:
    keep = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
    env = {key: os.environ[key] for key in keep if key in os.environ}
    # This checkout first, so the pods run the code under test whichever package the venv holds.
    path = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    return env | {"PYTHONPATH": os.pathsep.join(path)}
