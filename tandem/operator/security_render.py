"""The engine API key Secret, and the security contexts of every rendered pod and container."""

from __future__ import annotations

from typing import Any

from tandem.operator.api import ServingCluster
from tandem.operator.common_render import (
    ANNOTATION_ENGINE_KEY,
    ENGINE_KEY_SECRET_KEY,
    child_meta,
    child_name,
)


def engine_key_secret_name(sc: ServingCluster) -> str:
    return child_name(sc, "engine-key")


def engine_key_secret(sc: ServingCluster, key: str) -> dict[str, Any]:
    """The engine API key Secret. The operator creates it once with a random key (never reads or
    rewrites it); `tandem render` prints it with a fresh key."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": child_meta(sc, engine_key_secret_name(sc), None),
        "type": "Opaque",
        "stringData": {ENGINE_KEY_SECRET_KEY: key},
    }


def engine_key_annotation(sc: ServingCluster) -> dict[str, str]:
    generated = sc.status.engine_key_secret
    if not sc.spec.router.auth.engine_key or generated is None:
        return {}
    return {ANNOTATION_ENGINE_KEY: generated.uid}


def pod_security_context(uid: int, override: dict[str, Any] | None) -> dict[str, Any]:
    """Non-root with the given uid/gid (fsGroup too, so Secret and volume files are readable) and
    the RuntimeDefault seccomp profile; `override` keys replace these."""
    return {
        "runAsNonRoot": True,
        "runAsUser": uid,
        "runAsGroup": uid,
        "fsGroup": uid,
        "seccompProfile": {"type": "RuntimeDefault"},
        **(override or {}),
    }


def container_security_context(uid: int, override: dict[str, Any] | None) -> dict[str, Any]:
    """What the "restricted" Pod Security Standard asks of a container, plus a read-only root
    filesystem; `override` keys replace these."""
    return {
        "runAsNonRoot": True,
        "runAsUser": uid,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
        **(override or {}),
    }
