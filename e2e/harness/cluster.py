"""One real control plane: etcd, kube-apiserver, controller-manager, scheduler, KWOK and a GPU node.

Run by hand with `python -m e2e.harness.cluster` (or `make cluster`): it prints the kubeconfig
path and keeps the cluster up until Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import shutil
import signal
import ssl
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import IO, Any

import yaml
from kubernetes import client as k8s
from kubernetes import config as k8s_config

from e2e.harness.binaries import CLUSTER_DIR, Binaries
from e2e.harness.pki import CertificateAuthority, KeyPair, service_account_keys
from e2e.harness.processes import Child, Supervisor, wait_until
from tandem.common.ports import free_port

NODE_NAME = "kwok-gpu-0"
# Pod IPs come from 127.0.<n>.0/24: n = 1 unless another control plane on this machine holds
# it (each claims its range with a lock file), so concurrent runs never share pod IPs and ports.
POD_SUBNETS = range(1, 64)
SERVICE_CIDR = "10.0.0.0/24"
GPUS_PER_NODE = 8
SA_ISSUER = "https://kubernetes.default.svc.cluster.local"


def _https_ok(url: str, context: ssl.SSLContext) -> bool:
    with urllib.request.urlopen(url, context=context, timeout=2) as response:
        return bool(response.status == 200)


def write_kubeconfig(
    path: Path,
    server: str,
    ca: Path,
    *,
    user: str,
    client: KeyPair | None = None,
    token: str | None = None,
    namespace: str = "default",
) -> Path:
    """A one-context kubeconfig authenticating with a client cert or a bearer token."""
    credentials: dict[str, str] = {}
    if client is not None:
        credentials = {"client-certificate": str(client.cert), "client-key": str(client.key)}
    if token is not None:
        credentials = {"token": token}
    document = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "e2e", "cluster": {"server": server, "certificate-authority": str(ca)}}
        ],
        "users": [{"name": user, "user": credentials}],
        "contexts": [
            {"name": user, "context": {"cluster": "e2e", "user": user, "namespace": namespace}}
        ],
        "current-context": user,
    }
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    path.chmod(0o600)
    return path


def kwok_node(
    name: str,
    pod_cidr: str,
    resources: dict[str, str],
    labels: dict[str, str] | None = None,
    taints: list[dict[str, str]] | None = None,
) -> dict[str, Any]:
    """A Node that KWOK manages (it marks the node and its pods Ready): `resources` both allocatable
    and capacity, pod IPs from `pod_cidr`, `labels` besides the hostname, os and kwok ones."""
    spec: dict[str, Any] = {"podCIDR": pod_cidr, "podCIDRs": [pod_cidr]}
    if taints:
        spec["taints"] = taints
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "type": "kwok",
                **(labels or {}),
            },
            "annotations": {"kwok.x-k8s.io/node": "fake"},
        },
        "spec": spec,
        "status": {"allocatable": resources, "capacity": resources},
    }


class ControlPlane:
    """Starts the components in dependency order with fresh PKI under `workdir`; `stop` undoes it."""

    def __init__(
        self,
        workdir: Path,
        binaries: Binaries,
        apiserver_args: Sequence[str] = (),
        *,
        controllers: bool = True,
    ) -> None:
        self.workdir = workdir
        self.binaries = binaries
        # False: etcd and kube-apiserver alone. Objects then stay as a test writes them: no
        # scheduler binds a Pod, no KWOK sets its status, no garbage collector or ReplicaSet
        # controller deletes a Pod whose owners the test made.
        self.controllers = controllers
        # Extra kube-apiserver flags (e.g. an audit log for counting a client's requests).
        self.apiserver_args = list(apiserver_args)
        self.pki_dir = workdir / "pki"
        self.supervisor = Supervisor(workdir / "logs")
        self.apiserver_port = free_port()
        self.server = f"https://127.0.0.1:{self.apiserver_port}"
        self.children: dict[str, Child] = {}
        self.kubeconfig = workdir / "admin.kubeconfig"
        self.pod_cidr = ""
        self._cidr_lock: IO[str] | None = None

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        started = time.monotonic()
        try:
            if self.controllers:
                self.pod_cidr = self._claim_pod_cidr()
            self._make_pki()
            self._start_etcd()
            self._start_apiserver()
            if self.controllers:
                self._start_controller_manager()
                self._start_scheduler()
                self._start_kwok()
                self._create_gpu_node()
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - started

    def stop(self) -> None:
        self.supervisor.stop_all()
        if self._cidr_lock is not None:
            self._cidr_lock.close()
            self._cidr_lock = None

    def _claim_pod_cidr(self) -> str:
        for subnet in POD_SUBNETS:
            lock = (Path(tempfile.gettempdir()) / f"tandem-e2e-pods-127.0.{subnet}.lock").open("w")
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                lock.close()
                continue
            self._cidr_lock = lock
            return f"127.0.{subnet}.0/24"
        raise RuntimeError("every 127.0.<n>.0/24 pod range is held by another control plane")

    def leftovers(self) -> list[int]:
        return self.supervisor.leftovers()

    def __enter__(self) -> ControlPlane:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- clients -------------------------------------------------------------------------------

    def api_client(self, kubeconfig: Path | None = None) -> k8s.ApiClient:
        path = str(kubeconfig or self.kubeconfig)
        client: k8s.ApiClient = k8s_config.new_client_from_config(config_file=path)  # type: ignore[no-untyped-call]
        return client

    def token_kubeconfig(self, name: str, token: str, namespace: str = "default") -> Path:
        """A kubeconfig that acts as whoever `token` belongs to (e.g. a ServiceAccount)."""
        path = self.workdir / f"{name}.kubeconfig"
        return write_kubeconfig(
            path, self.server, self.ca.cert_path, user=name, token=token, namespace=namespace
        )

    def service_account_kubeconfig(
        self, namespace: str, service_account: str, *, hours: int = 2
    ) -> Path:
        """Requests a bound token for the ServiceAccount (TokenRequest API) and wraps it."""
        core = k8s.CoreV1Api(self.api_client())
        request = k8s.AuthenticationV1TokenRequest(
            spec=k8s.V1TokenRequestSpec(audiences=[SA_ISSUER], expiration_seconds=hours * 3600)
        )
        response = core.create_namespaced_service_account_token(service_account, namespace, request)
        assert response.status is not None
        return self.token_kubeconfig(
            f"sa-{namespace}-{service_account}", str(response.status.token), namespace
        )

    # -- components ----------------------------------------------------------------------------

    def _make_pki(self) -> None:
        self.pki_dir.mkdir(parents=True, exist_ok=True)
        self.ca = CertificateAuthority(self.pki_dir)
        self.serving = self.ca.issue(
            "apiserver",
            "kube-apiserver",
            hosts=("127.0.0.1", "localhost", "10.0.0.1", "kubernetes.default.svc"),
        )
        self.sa_keys = service_account_keys(self.pki_dir)
        self.admin = self.ca.issue("admin", "tandem-e2e-admin", organizations=("system:masters",))
        write_kubeconfig(
            self.kubeconfig, self.server, self.ca.cert_path, user="admin", client=self.admin
        )
        # Each component talks as its own RBAC identity, the way kubeadm sets them up.
        self.component_kubeconfigs = {}
        for component, common_name, orgs in (
            ("controller-manager", "system:kube-controller-manager", ()),
            ("scheduler", "system:kube-scheduler", ()),
            ("kwok", "kwok", ("system:masters",)),
        ):
            pair = self.ca.issue(component, common_name, organizations=orgs)
            self.component_kubeconfigs[component] = write_kubeconfig(
                self.workdir / f"{component}.kubeconfig",
                self.server,
                self.ca.cert_path,
                user=component,
                client=pair,
            )

    def _start(self, name: str, argv: list[str]) -> Child:
        child = self.supervisor.start(name, argv, env=_component_env())
        self.children[name] = child
        return child

    def _start_etcd(self) -> None:
        client_port, peer_port = free_port(), free_port()
        self.etcd_url = f"http://127.0.0.1:{client_port}"
        peer = f"http://127.0.0.1:{peer_port}"
        child = self._start(
            "etcd",
            [
                str(self.binaries.etcd),
                "--name=e2e",
                f"--data-dir={self.workdir / 'etcd'}",
                f"--listen-client-urls={self.etcd_url}",
                f"--advertise-client-urls={self.etcd_url}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=e2e={peer}",
                "--unsafe-no-fsync",
                "--log-level=warn",
            ],
        )
        wait_until(
            lambda: urllib.request.urlopen(f"{self.etcd_url}/health", timeout=2).status == 200,
            timeout_s=30,
            what="etcd /health",
            child=child,
        )

    def _start_apiserver(self) -> None:
        self.start_apiserver("kube-apiserver", self.apiserver_port)

    def start_apiserver(self, name: str, port: int) -> Child:
        """A kube-apiserver on `port` over this plane's etcd, certificates and keys, ready. Called
        again with another name and port it starts a second one beside the first, as a highly
        available control plane runs several; `supervisor.stop` ends one, this starts it again."""
        child = self._start(
            name,
            [
                str(self.binaries.kube_apiserver),
                f"--etcd-servers={self.etcd_url}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={port}",
                f"--cert-dir={self.pki_dir}",
                f"--tls-cert-file={self.serving.cert}",
                f"--tls-private-key-file={self.serving.key}",
                f"--client-ca-file={self.ca.cert_path}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--allow-privileged=true",
                "--authorization-mode=Node,RBAC",
                f"--service-account-issuer={SA_ISSUER}",
                f"--api-audiences={SA_ISSUER}",
                f"--service-account-key-file={self.sa_keys.cert}",
                f"--service-account-signing-key-file={self.sa_keys.key}",
                "--endpoint-reconciler-type=none",
                "--profiling=false",
                "--v=1",
                *self.apiserver_args,
            ],
        )
        context = ssl.create_default_context(cafile=str(self.ca.cert_path))
        context.load_cert_chain(str(self.admin.cert), str(self.admin.key))
        wait_until(
            lambda: _https_ok(f"https://127.0.0.1:{port}/readyz", context),
            timeout_s=90,
            what=f"{name} /readyz",
            child=child,
        )
        return child

    def _start_controller_manager(self) -> None:
        self._start_component(
            "kube-controller-manager",
            self.binaries.kube_controller_manager,
            self.component_kubeconfigs["controller-manager"],
            [
                f"--root-ca-file={self.ca.cert_path}",
                f"--service-account-private-key-file={self.sa_keys.key}",
                f"--cluster-signing-cert-file={self.ca.cert_path}",
                f"--cluster-signing-key-file={self.ca.key_path}",
                "--controllers=*",
                # Each controller acts as its own ServiceAccount with its bootstrap RBAC role
                # (as kubeadm runs it); the manager's own identity may not, e.g., patch Nodes.
                "--use-service-account-credentials=true",
            ],
        )

    def _start_scheduler(self) -> None:
        self._start_component(
            "kube-scheduler",
            self.binaries.kube_scheduler,
            self.component_kubeconfigs["scheduler"],
            [],
        )

    def _start_component(self, name: str, binary: Path, kubeconfig: Path, extra: list[str]) -> None:
        """A controller-manager-like component: its own identity, no leader election, /healthz
        on a free loopback port with a self-signed certificate made in memory."""
        port = free_port()
        argv = [
            str(binary),
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
            f"--secure-port={port}",
            "--v=1",
            *extra,
        ]
        child = self._start(name, argv)
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        wait_until(
            lambda: _https_ok(f"https://127.0.0.1:{port}/healthz", context),
            timeout_s=60,
            what=f"{name} /healthz",
            child=child,
        )

    def _start_kwok(self) -> None:
        self._start(
            "kwok",
            [
                str(self.binaries.kwok),
                f"--kubeconfig={self.component_kubeconfigs['kwok']}",
                f"--config={CLUSTER_DIR / 'kwok.yaml'}",
                "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
                f"--server-address=127.0.0.1:{free_port()}",
                "--node-ip=127.0.0.1",
                f"--cidr={self.pod_cidr}",
                # The Node's Lease is its heartbeat; without it the node lifecycle controller
                # marks the node unreachable after its grace period and evicts every pod.
                "--node-lease-duration-seconds=40",
            ],
        )

    def _create_gpu_node(self) -> None:
        """A KWOK-managed Node with `nvidia.com/gpu` allocatable and the loopback pod CIDR."""
        core = k8s.CoreV1Api(self.api_client())
        resources = {
            "cpu": "64",
            "memory": "512Gi",
            "pods": "110",
            "nvidia.com/gpu": str(GPUS_PER_NODE),
        }
        labels = {"kubernetes.io/arch": "amd64", "nvidia.com/gpu.present": "true"}
        node = kwok_node(NODE_NAME, self.pod_cidr, resources, labels)
        core.create_node(node)  # type: ignore[arg-type]
        core.patch_node_status(
            NODE_NAME, {"status": {"allocatable": resources, "capacity": resources}}
        )

        def schedulable() -> bool:
            current = core.read_node(NODE_NAME)
            assert current.status is not None
            assert current.spec is not None
            ready = any(
                c.type == "Ready" and c.status == "True" for c in current.status.conditions or []
            )
            return ready and not current.spec.taints

        wait_until(
            schedulable,
            timeout_s=60,
            what=f"node {NODE_NAME} Ready and untainted",
            child=self.children["kwok"],
        )


@contextlib.contextmanager
def running_control_plane(
    binaries: Binaries, *, controllers: bool = True
) -> Iterator[ControlPlane]:
    """A ControlPlane in a fresh temp dir for a test fixture: stopped afterwards, its folder
    removed, and a failure if any of its processes outlived it."""
    workdir = Path(tempfile.mkdtemp(prefix="tandem-e2e-"))
    plane = ControlPlane(workdir, binaries, controllers=controllers)
    plane.start()
    try:
        yield plane
    finally:
        plane.stop()
        leftovers = plane.leftovers()
        # TANDEM_E2E_KEEP=1 keeps certificates, etcd data and every process log for a look.
        if not leftovers and not os.environ.get("TANDEM_E2E_KEEP"):
            shutil.rmtree(workdir, ignore_errors=True)
        assert not leftovers, f"control-plane processes left behind: {leftovers}"


def _component_env() -> dict[str, str]:
    # The components must never pick up a developer's kubeconfig or proxy settings.
    drop = {"KUBECONFIG", "HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"}
    return {key: value for key, value in os.environ.items() if key not in drop}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m e2e.harness.cluster",
        description="Start the e2e control plane and keep it up until interrupted.",
    )
    parser.add_argument("--workdir", type=Path, help="state directory (default: a fresh temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the state directory on exit")
    parser.add_argument(
        "--no-pods",
        action="store_true",
        help="do not run the pod runner (pods turn Running but nothing serves behind them)",
    )
    args = parser.parse_args(argv)
    # Imported here: the pod runner builds on this module.
    from e2e.harness.podrunner import PodRunner

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="tandem-cluster-"))
    workdir.mkdir(parents=True, exist_ok=True)
    plane = ControlPlane(workdir, Binaries.locate())
    stopping = False

    def interrupt(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, interrupt)
    with plane:
        runner = None if args.no_pods else PodRunner(plane).start()
        version = plane.binaries.kubernetes_version
        print(
            f"control plane up in {plane.startup_s:.1f} s (Kubernetes {version})", file=sys.stderr
        )
        print(f"logs: {plane.supervisor.log_dir}; pod IPs from {plane.pod_cidr}", file=sys.stderr)
        if runner is not None:
            print(f"pod processes: {runner.supervisor.log_dir}", file=sys.stderr)
        print(f"export KUBECONFIG={plane.kubeconfig}", file=sys.stderr)
        print(plane.kubeconfig, flush=True)
        try:
            while not stopping:
                time.sleep(0.5)
        finally:
            print("stopping...", file=sys.stderr)
            if runner is not None:
                runner.stop()
    if not args.keep and args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
