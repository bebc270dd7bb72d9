"""A PEFT LoRA adapter for the tiny test model, written deterministically at test time (no binary
is committed): adapter_config.json plus adapter_model.safetensors with small seeded weights for
every layer's q_proj and v_proj."""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path

from tandem_process import MODEL_DIR

TARGET_MODULES = ("q_proj", "v_proj")


def _safetensors(tensors: dict[str, tuple[list[int], list[float]]]) -> bytes:
    """The safetensors file format: u64 LE header length, JSON header, then F32 data."""
    header: dict[str, object] = {}
    data = bytearray()
    for name, (shape, values) in tensors.items():
        raw = struct.pack(f"<{len(values)}f", *values)
        header[name] = {
            "dtype": "F32",
            "shape": shape,
            "data_offsets": [len(data), len(data) + len(raw)],
        }
        data += raw
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + bytes(data)


def make_adapter(dest: Path, seed: int, rank: int = 8, base_model: str = "tiny") -> Path:
    """Writes the adapter into `dest` (created) and returns it. The same seed gives the same
    bytes; a different seed gives different weights, so two adapters generate differently."""
    config = json.loads((MODEL_DIR / "config.json").read_text())
    hidden = config["hidden_size"]
    outputs = {
        "q_proj": config["num_attention_heads"] * config["head_dim"],
        "v_proj": config["num_key_value_heads"] * config["head_dim"],
    }
    rng = random.Random(seed)
    tensors: dict[str, tuple[list[int], list[float]]] = {}
    for layer in range(config["num_hidden_layers"]):
        for module in TARGET_MODULES:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            a = [rng.uniform(-0.05, 0.05) for _ in range(rank * hidden)]
            b = [rng.uniform(-0.05, 0.05) for _ in range(outputs[module] * rank)]
            tensors[f"{prefix}.lora_A.weight"] = ([rank, hidden], a)
            tensors[f"{prefix}.lora_B.weight"] = ([outputs[module], rank], b)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "adapter_model.safetensors").write_bytes(_safetensors(tensors))
    peft = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": list(TARGET_MODULES),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }
    (dest / "adapter_config.json").write_text(json.dumps(peft, indent=1))
    return dest
