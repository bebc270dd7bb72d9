"""Pure translation of a Running pod into the local process that stands in for its container.

The kubelet's job, minus containers: resolve the container's environment (values and the
downward API), materialise ConfigMap volumes as files, expand `$(VAR)` references, and map the
image's command to this package's: `vllm serve ARGS` becomes `tandem emulate ARGS` bound to the
pod's IP, `tandem ...` stays itself.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

import yaml

from tandem.operator.tokenizer import FETCH_CONTAINER, TOKENIZER_DIR
from tandem.router.fallback_tokenizer import FALLBACK_TOKENIZER

Pod = Mapping[str, Any]
# (kind, namespace, name) -> the `data` of a ConfigMap or (decoded) Secret, None when absent.
ObjectDataReader = Callable[[str, str, str], Mapping[str, str] | None]


class UnsupportedPod(ValueError):
    """The pod asks for something this stand-in kubelet cannot provide."""


@dataclass(frozen=True)
class LaunchPlan:
    """What to run for one pod: argv, environment, and files to write before starting."""

    role: str
    argv: list[str]
    env: dict[str, str]
    files: dict[str, str] = field(default_factory=dict)  # path on this machine -> content


_FIELD_PATHS: dict[str, Callable[[Pod], str]] = {
    "status.podIP": lambda pod: pod["status"]["podIP"],
    "status.hostIP": lambda pod: pod["status"].get("hostIP", ""),
    "metadata.name": lambda pod: pod["metadata"]["name"],
    "metadata.namespace": lambda pod: pod["metadata"]["namespace"],
    "metadata.uid": lambda pod: pod["metadata"].get("uid", ""),
    "spec.nodeName": lambda pod: pod["spec"].get("nodeName", ""),
    "spec.serviceAccountName": lambda pod: pod["spec"].get("serviceAccountName", "default"),
}

_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.\-]*)\)")


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion: known names are replaced, `$$` escapes, others stay."""

    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env.get(name, match.group(0))

    return _VAR_REF.sub(replace, text)


def container_env(
    pod: Pod, container: Mapping[str, Any], objects: ObjectDataReader
) -> dict[str, str]:
    """The container's environment as the kubelet would build it (later entries see earlier ones)."""
    namespace = pod["metadata"]["namespace"]
    env: dict[str, str] = {}
    for source in container.get("envFrom") or []:
        ref = source.get("configMapRef")
        if ref is None:
            raise UnsupportedPod(f"envFrom source {source} is not a ConfigMap")
        data = objects("ConfigMap", namespace, ref["name"])
        if data is None and not ref.get("optional"):
            raise UnsupportedPod(f"ConfigMap {ref['name']} for envFrom does not exist")
        prefix = source.get("prefix", "")
        env.update({prefix + key: value for key, value in (data or {}).items()})
    for entry in container.get("env") or []:
        name = entry["name"]
        if "value" in entry:
            env[name] = expand(entry["value"] or "", env)
            continue
        value_from = entry.get("valueFrom") or {}
        if "fieldRef" in value_from:
            path = value_from["fieldRef"]["fieldPath"]
            if path not in _FIELD_PATHS:
                raise UnsupportedPod(f"env {name}: fieldRef {path} is not supported")
            env[name] = _FIELD_PATHS[path](pod)
        elif "configMapKeyRef" in value_from or "secretKeyRef" in value_from:
            kind = "ConfigMap" if "configMapKeyRef" in value_from else "Secret"
            ref = value_from["configMapKeyRef" if kind == "ConfigMap" else "secretKeyRef"]
            data = objects(kind, namespace, ref["name"]) or {}
            if ref["key"] in data:
                env[name] = data[ref["key"]]
            elif not ref.get("optional"):
                raise UnsupportedPod(f"env {name}: {kind} key {ref['name']}/{ref['key']} missing")
        elif "resourceFieldRef" in value_from:
            continue  # limits are not enforced on this machine; the variable stays unset
        else:
            raise UnsupportedPod(f"env {name}: unsupported valueFrom {value_from}")
    return env


def volume_files(
    pod: Pod, container: Mapping[str, Any], objects: ObjectDataReader, root: PurePosixPath
) -> tuple[dict[str, str], dict[str, str]]:
    """Files of the container's ConfigMap and Secret mounts under `root`, and mountPath -> local
    path."""
    namespace = pod["metadata"]["namespace"]
    volumes = {volume["name"]: volume for volume in pod["spec"].get("volumes") or []}
    files: dict[str, str] = {}
    mounts: dict[str, str] = {}
    for mount in container.get("volumeMounts") or []:
        volume = volumes.get(mount["name"], {})
        if "configMap" in volume:
            kind, source, name = "ConfigMap", volume["configMap"], volume["configMap"]["name"]
        elif "secret" in volume:
            kind, source, name = "Secret", volume["secret"], volume["secret"]["secretName"]
        else:
            continue  # emptyDir, /dev/shm and the like need nothing here
        data = objects(kind, namespace, name)
        if data is None:
            if source.get("optional"):
                continue
            raise UnsupportedPod(f"{kind} {name} mounted at {mount['mountPath']} is missing")
        local = root / mount["name"]
        items = source.get("items")
        chosen = (
            {item["key"]: item["path"] for item in items} if items else {key: key for key in data}
        )
        for key, relative in chosen.items():
            files[str(local / relative)] = data[key]
        sub_path = mount.get("subPath")
        mounts[mount["mountPath"]] = str(local / sub_path) if sub_path else str(local)
    return files, mounts


def _map_mount_paths(argument: str, mounts: Mapping[str, str]) -> str:
    for mount_path, local in sorted(mounts.items(), key=lambda item: -len(item[0])):
        if argument == mount_path or argument.startswith(mount_path.rstrip("/") + "/"):
            return local + argument[len(mount_path) :]
    return argument


def _drop_flag(args: Sequence[str], flag: str) -> list[str]:
    """`args` without `flag VALUE` / `flag=VALUE`."""
    kept: list[str] = []
    skip = False
    for argument in args:
        if skip:
            skip = False
        elif argument == flag:
            skip = True
        elif not argument.startswith(flag + "="):
            kept.append(argument)
    return kept


def engine_args(args: Sequence[str], pod_ip: str) -> list[str]:
    """vLLM serve arguments with every listener on the pod's IP.

    The rendered `--kv-events-config` keeps vLLM's wildcard binds (`tcp://*:5557`): every
    emulated pod uses the same port numbers on its own loopback IP, so the emulator is told to
    bind those sockets on the pod's IP instead of on every interface.
    """
    return [*_drop_flag(args, "--host"), "--host", pod_ip, "--kv-events-bind-host", pod_ip]


def _bind_pod_ip(args: Sequence[str], pod_ip: str) -> list[str]:
    # Inside a pod, 0.0.0.0 means the pod's own address; here it must say so explicitly.
    return [argument.replace("0.0.0.0", pod_ip) for argument in args]


def bind_router_config(
    files: Mapping[str, str],
    args: Sequence[str],
    pod_ip: str,
    mounts: Mapping[str, str],
    fetches_tokenizer: bool = False,
) -> dict[str, str]:
    """The router's mounted config with `host` set to the pod's IP (the image listens on 0.0.0.0)
    and the key files it names moved to where their Secret volumes are on this machine.

    This machine has no Hub to run the tokenizer-fetching init container against, and the engines
    here are emulators without a tokenizer.json: their own tokenization (tandem-fallback) is what
    that init container stands for."""
    out = dict(files)
    for flag, value in itertools.pairwise(args):
        if flag == "--config" and value in out:
            config = yaml.safe_load(out[value]) or {}
            config["host"] = pod_ip
            auth = config.get("auth") or {}
            for key, path in auth.items():
                auth[key] = _map_mount_paths(path, mounts)
            if fetches_tokenizer:
                config["tokenizer"] = FALLBACK_TOKENIZER
            out[value] = yaml.safe_dump(config, sort_keys=False)
    return out


def bind_gateway_config(
    files: Mapping[str, str],
    args: Sequence[str],
    pod_ip: str,
    mounts: Mapping[str, str],
    fetches_tokenizer: bool = False,
) -> dict[str, str]:
    """The gateway's mounted config with `host` set to the pod's IP, each model's key files moved
    to where their Secret volumes are on this machine, and a fetched tokenizer replaced by the
    emulators' own tokenization (as `bind_router_config` does)."""
    out = dict(files)
    for flag, value in itertools.pairwise(args):
        if flag == "--config" and value in out:
            config = yaml.safe_load(out[value]) or {}
            config["host"] = pod_ip
            for model in config.get("models") or []:
                auth = model.get("auth") or {}
                for key, path in auth.items():
                    auth[key] = _map_mount_paths(path, mounts)
                if fetches_tokenizer and str(model.get("tokenizer", "")).startswith(TOKENIZER_DIR):
                    model["tokenizer"] = FALLBACK_TOKENIZER
            out[value] = yaml.safe_dump(config, sort_keys=False)
    return out


def plan_pod(
    pod: Pod,
    objects: ObjectDataReader,
    *,
    tandem: Sequence[str],
    scratch: PurePosixPath,
    engine_extra_args: Sequence[str] = (),
) -> LaunchPlan:
    """The process for a Running pod's first container, ready to start on this machine."""
    pod_ip = pod["status"].get("podIP")
    if not pod_ip:
        raise UnsupportedPod(f"pod {pod['metadata']['name']} has no IP yet")
    container = pod["spec"]["containers"][0]
    env = container_env(pod, container, objects)
    files, mounts = volume_files(pod, container, objects, scratch)
    command = [expand(part, env) for part in container.get("command") or []]
    args = [_map_mount_paths(expand(part, env), mounts) for part in container.get("args") or []]
    if command[:2] == ["vllm", "serve"]:
        argv = [*tandem, "emulate", *engine_args(command[2:] + args, pod_ip), *engine_extra_args]
        role = pod["metadata"].get("labels", {}).get("tandem.dev/role", "engine")
    elif command[:2] == ["tandem", "router"]:
        argv = [*tandem, *command[1:], *_bind_pod_ip(args, pod_ip)]
        role = "router"
        fetches = any(c["name"] == FETCH_CONTAINER for c in pod["spec"].get("initContainers", []))
        files = bind_router_config(files, args, pod_ip, mounts, fetches)
    elif command[:2] == ["tandem", "gateway"]:
        argv = [*tandem, *command[1:], *args]
        role = "gateway"
        fetches = any(
            c["name"].endswith(FETCH_CONTAINER) for c in pod["spec"].get("initContainers", [])
        )
        files = bind_gateway_config(files, args, pod_ip, mounts, fetches)
    elif command[:1] == ["tandem"]:
        argv = [*tandem, *command[1:], *_bind_pod_ip(args, pod_ip)]
        role = command[1] if len(command) > 1 else "tandem"
    else:
        raise UnsupportedPod(f"no local stand-in for command {command}")
    return LaunchPlan(role=role, argv=argv, env=env, files=files)
