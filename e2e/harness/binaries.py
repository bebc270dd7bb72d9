"""Where the control-plane binaries built by e2e/cluster/build.sh live, by pinned version."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

CLUSTER_DIR = Path(__file__).resolve().parent.parent / "cluster"
BUILD_SCRIPT = CLUSTER_DIR / "build.sh"


class BinariesMissing(RuntimeError):
    """The cached binaries are absent: the e2e tests fail loudly rather than skip."""


def pinned_versions(path: Path = CLUSTER_DIR / "versions.env") -> dict[str, str]:
    """KEY=VALUE lines of versions.env, the one place the versions are written."""
    versions = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            versions[key.strip()] = value.strip()
    return versions


def cache_dir() -> Path:
    return Path(os.environ.get("TANDEM_CACHE", Path.home() / ".cache" / "tandem"))


@dataclass(frozen=True)
class Binaries:
    """Absolute paths of every binary the harness runs."""

    etcd: Path
    kube_apiserver: Path
    kube_controller_manager: Path
    kube_scheduler: Path
    kubectl: Path
    kwok: Path
    helm: Path
    kubernetes_version: str

    @classmethod
    def locate(cls, directory: Path | None = None) -> Binaries:
        versions = pinned_versions()
        bin_dir = directory or cache_dir() / "bin"
        k8s = versions["K8S_VERSION"]
        paths = {
            "etcd": bin_dir / f"etcd-{versions['ETCD_VERSION']}",
            "kube_apiserver": bin_dir / f"kube-apiserver-{k8s}",
            "kube_controller_manager": bin_dir / f"kube-controller-manager-{k8s}",
            "kube_scheduler": bin_dir / f"kube-scheduler-{k8s}",
            "kubectl": bin_dir / f"kubectl-{k8s}",
            "kwok": bin_dir / f"kwok-{versions['KWOK_VERSION']}",
            "helm": bin_dir / f"helm-{versions['HELM_VERSION']}",
        }
        missing = [str(path) for path in paths.values() if not os.access(path, os.X_OK)]
        if missing:
            raise BinariesMissing(
                "control-plane binaries not built: "
                + ", ".join(missing)
                + f"\nbuild them with `make cluster-binaries` ({BUILD_SCRIPT})"
            )
        return cls(**paths, kubernetes_version=k8s)
