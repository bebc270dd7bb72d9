"""A model's tokenizer loaded from its Hugging Face files exactly as vLLM 0.32 loads it.

vLLM 0.32 loads tokenizers with transformers 5 (`AutoTokenizer`, the `tokenizers` backend). For a
directory with `tokenizer.json` that comes down to these rules, which this module reproduces
with the `tokenizers` library alone (no transformers, no torch in the router):

- the pipeline is `tokenizer.json`'s for the generic class, else the class's (below); its
  post-processor decides what `add_special_tokens=True` adds: with none, nothing
  (`add_bos_token` / `add_eos_token` in `tokenizer_config.json` are ignored whenever
  `tokenizer.json` exists);
- named special tokens (`bos_token`, `eos_token`, `unk_token`, `sep_token`, `pad_token`,
  `cls_token`, `mask_token`) come from `tokenizer_config.json` (`special_tokens_map.json`
  overrides it when the config has no `added_tokens_decoder`), as a string or an AddedToken dict;
  with `extra_special_tokens` / `additional_special_tokens` they are added to the vocabulary
  when missing, in that order, so they take the next free ids (`tokenizer_classes.token_setup`);
- special tokens in the text are matched as single tokens (`split_special_tokens` is off);
- chat templates: `chat_template.jinja` and `additional_chat_templates/*.jinja` beside the
  tokenizer take priority over `tokenizer_config.json`'s `chat_template`, which is a string or
  a list of `{"name", "template"}`; several templates become a dict by name.

The tokenizer class comes first (`tokenizer_classes.py`): transformers' generic class keeps
`tokenizer.json` as written; the classes in `tokenizer_classes.PIPELINES` (Llama, Gemma, Qwen2,
Qwen3.5, GPT-2, GPT-NeoX, Cohere) build their own pipeline around its vocabulary and merges, which is reproduced
there; any other class raises `UnsupportedTokenizer` (the router then asks vLLM's renderer or
routes on the approximation, never on ids it cannot vouch for).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from tandem.router.tokenizer_classes import (
    PIPELINES,
    UnsupportedTokenizer,
    class_backend,
    resolve_class,
)

__all__ = ["HfTokenizer", "UnsupportedTokenizer", "load_chat_templates"]

CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"

ChatTemplates = str | dict[str, str] | None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def load_chat_templates(directory: Path, config: dict[str, Any]) -> ChatTemplates:
    """The tokenizer's chat template(s): one string, a dict by name, or None."""
    files: dict[str, str] = {}
    default = directory / CHAT_TEMPLATE_FILE
    if default.is_file():
        files["default"] = default.read_text(encoding="utf-8")
    extra = directory / CHAT_TEMPLATE_DIR
    if extra.is_dir():
        for path in sorted(extra.glob("*.jinja")):
            files[path.stem] = path.read_text(encoding="utf-8")
    if files:
        return files["default"] if list(files) == ["default"] else files
    template = config.get("chat_template")
    if isinstance(template, list):
        return {str(t["name"]): str(t["template"]) for t in template}
    return template if isinstance(template, str) else None


@dataclass
class HfTokenizer:
    """Encodes text as the engine does; carries what chat templates see of the tokenizer."""

    backend: Tokenizer
    special_tokens: dict[str, str] = field(default_factory=dict)  # bos_token -> "<s>", ...
    chat_templates: ChatTemplates = None

    tokenizer_class: str = "TokenizersBackend"

    @classmethod
    def from_directory(cls, path: str | Path) -> HfTokenizer:
        """Raises `UnsupportedTokenizer` for a tokenizer class the router does not reproduce."""
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        directory = file.parent
        config = _read_json(directory / "tokenizer_config.json")
        model_config = _read_json(directory / "config.json")
        if any(directory.glob("consolidated*.safetensors")) and (
            (directory / "tekken.json").is_file() or any(directory.glob("tokenizer.model.v*"))
        ):
            raise UnsupportedTokenizer("vLLM loads this directory with mistral_common")
        name = resolve_class(config, model_config)
        if name is None or (name != "TokenizersBackend" and name not in PIPELINES):
            raise UnsupportedTokenizer(
                f"tokenizer_class {config.get('tokenizer_class')!r} with model_type "
                f"{model_config.get('model_type')!r} (loaded as {name or 'an undetermined class'})"
                " is not reproduced"
            )
        special_map = _read_json(directory / "special_tokens_map.json")
        file_json = json.loads(file.read_text(encoding="utf-8"))
        legacy_added = _read_json(directory / "added_tokens.json")
        backend, special = class_backend(
            name, str(file), file_json, config, special_map, legacy_added
        )
        return cls(backend, special, load_chat_templates(directory, config), name)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)
