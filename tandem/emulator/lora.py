"""LoRA adapters as vLLM 0.32 serves them: the adapters an engine knows (loaded at start from
--lora-modules or at run time), their CPU cache and GPU slots with the time it takes to fill
them, and the `vllm:lora_requests_info` series vLLM publishes."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.emulator.config import LoraConfig
from tandem.emulator.errors import APIError


@dataclass(frozen=True, slots=True)
class Adapter:
    name: str
    path: str  # as the engine was given it: part of every block hash of its requests
    lora_id: int  # vLLM's int id, 1, 2, ... in load order (the KV events' lora_id)


def _missing(path: str) -> bool:
    """An absolute path without adapter_config.json (vLLM: "No adapter found"); a Hugging Face
    id is taken as found: the emulator has no weights to download."""
    return path.startswith("/") and not (Path(path) / "adapter_config.json").is_file()


class LoraAdapters:
    """The adapters of one engine, their memory and their metric.

    Swap-in cost of a step: every adapter of the batch not in a GPU slot takes one
    (`swap_s`), plus `load_s` when it is not in the CPU cache either; slots and cache are LRU of
    --max-loras and --max-cpu-loras entries.
    """

    def __init__(self, config: LoraConfig, base_model: str) -> None:
        self.config = config
        self.base_model = base_model
        self.adapters: dict[str, Adapter] = {}
        self._next_id = 1
        self.gpu: OrderedDict[str, None] = OrderedDict()
        self.cpu: OrderedDict[str, None] = OrderedDict()
        # vllm:lora_requests_info: every (running, waiting) label set seen, with the time it was
        # last current (vLLM never drops an old label set)
        self.info: dict[tuple[str, str], float] = {}
        self.swap_ins = 0  # adapters brought into a GPU slot
        self.loads = 0  # of those, adapters not in CPU memory either
        for name, path in config.modules.items():
            self._add(name, path)

    @property
    def max_cpu_loras(self) -> int:
        return max(self.config.max_cpu_loras or self.config.max_loras, self.config.max_loras)

    def get(self, name: str) -> Adapter | None:
        return self.adapters.get(name)

    def _add(self, name: str, path: str) -> Adapter:
        adapter = Adapter(name, path, self._next_id)
        self._next_id += 1
        self.adapters[name] = adapter
        self._remember(self.cpu, name, self.max_cpu_loras)  # vLLM loads it into CPU memory
        return adapter

    @staticmethod
    def _remember(lru: OrderedDict[str, None], name: str, size: int) -> bool:
        """Marks `name` used; True if it had to be brought in (the oldest leaves a full LRU)."""
        if name in lru:
            lru.move_to_end(name)
            return False
        lru[name] = None
        while len(lru) > size:
            lru.popitem(last=False)
        return True

    # -- runtime updates (POST /v1/load_lora_adapter, /v1/unload_lora_adapter) ----------------

    def load(self, body: Any) -> str:
        """vLLM's checks, messages and statuses, as real vLLM 0.32 answered them."""
        name = body.get("lora_name") if isinstance(body, dict) else None
        path = body.get("lora_path") if isinstance(body, dict) else None
        if not name or not path:
            raise APIError(
                400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput"
            )
        if name in self.adapters and not body.get("load_inplace"):
            raise APIError(
                400,
                f"The lora adapter '{name}' has already been loaded. If you want to load the "
                "adapter in place, set 'load_inplace' to True.",
                "InvalidUserInput",
            )
        if _missing(path):
            raise APIError(
                404, f"Loading lora {name} failed: No adapter found for {path}", "NotFoundError"
            )
        self.adapters.pop(name, None)
        self._add(name, path)
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, body: Any) -> str:
        name = body.get("lora_name") if isinstance(body, dict) else None
        if not name:
            raise APIError(
                400,
                "'lora_name' needs to be provided to unload a LoRA adapter.",
                "InvalidUserInput",
            )
        if name not in self.adapters:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        del self.adapters[name]
        self.gpu.pop(name, None)
        self.cpu.pop(name, None)
        return f"Success: LoRA adapter '{name}' removed successfully."

    # -- serving -----------------------------------------------------------------------------

    def swap_in_seconds(self, names: Iterable[str]) -> float:
        """Seconds a step spends bringing the batch's adapters into GPU slots."""
        seconds = 0.0
        for name in names:
            if self._remember(self.gpu, name, self.config.max_loras):
                seconds += self.config.swap_s
                self.swap_ins += 1
                if self._remember(self.cpu, name, self.max_cpu_loras):
                    seconds += self.config.load_s
                    self.loads += 1
        return seconds

    def record(
        self, running: Iterable[str], waiting: Iterable[str], now: float | None = None
    ) -> None:
        """The current label set of vllm:lora_requests_info, set to the current time."""
        key = (",".join(dict.fromkeys(running)), ",".join(dict.fromkeys(waiting)))
        self.info[key] = time.time() if now is None else now

    def models(self, created: int) -> list[dict[str, Any]]:
        """The adapters' cards of /v1/models (after the base model's)."""
        return [
            {
                "id": a.name,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": a.path,
                "parent": self.base_model,
                "max_model_len": None,
            }
            for a in self.adapters.values()
        ]
