"""The command-line clients (helm, kubectl) run against one control plane with private state."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from e2e.harness.binaries import Binaries


class CommandFailed(AssertionError):
    """A client command exited non-zero; the message carries its output."""


@dataclass(frozen=True)
class Clients:
    """`helm` and `kubectl` bound to one kubeconfig, with their state kept under `home`."""

    binaries: Binaries
    home: Path
    kubeconfig: Path | None = None

    def _env(self, kubeconfig: Path | None) -> dict[str, str]:
        home = self.home
        return {
            "PATH": "/usr/bin:/bin",
            "HOME": str(home),
            "KUBECONFIG": str(kubeconfig or self.kubeconfig or home / "no-cluster.kubeconfig"),
            "HELM_CACHE_HOME": str(home / "helm-cache"),
            "HELM_CONFIG_HOME": str(home / "helm-config"),
            "HELM_DATA_HOME": str(home / "helm-data"),
        }

    def run(
        self,
        binary: Path,
        args: Sequence[str],
        *,
        stdin: str | None = None,
        check: bool = True,
        kubeconfig: Path | None = None,
        timeout_s: float = 120,
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [str(binary), *args],
            input=stdin,
            capture_output=True,
            text=True,
            env=self._env(kubeconfig),
            timeout=timeout_s,
        )
        if check and result.returncode != 0:
            raise CommandFailed(
                f"{binary.name} {' '.join(args)} exited {result.returncode}\n"
                f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
            )
        return result

    def helm(self, *args: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
        return self.run(self.binaries.helm, args, **kwargs)  # type: ignore[arg-type]

    def kubectl(self, *args: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
        return self.run(self.binaries.kubectl, args, **kwargs)  # type: ignore[arg-type]
