"""A model's tokenizer loaded from its Hugging Face files exactly as vLLM 0.32 loads it.

vLLM 0.32 loads tokenizers with transformers 5 (`AutoTokenizer`, the `tokenizers` backend). For a
directory with `tokenizer.json` that comes down to these rules, which this module reproduces
with the `tokenizers` library alone (no transformers, no torch in the router):

- the pipeline (normalizer, pre-tokenizer, model, post-processor) is `tokenizer.json`'s; when it
  has no post-processor, `add_special_tokens=True` adds nothing (`add_bos_token` /
  `add_eos_token` in `tokenizer_config.json` are ignored whenever `tokenizer.json` exists);
- named special tokens (`bos_token`, `eos_token`, `unk_token`, `sep_token`, `pad_token`,
  `cls_token`, `mask_token`) come from `tokenizer_config.json`, else `special_tokens_map.json`,
  as a string or an AddedToken dict (`{"content": ...}`); with `extra_special_tokens` /
  `additional_special_tokens` they are added to the vocabulary (special, not normalized) when
  missing, in that order, so they take the next free ids;
- special tokens in the text are matched as single tokens (`split_special_tokens` is off);
- chat templates: `chat_template.jinja` and `additional_chat_templates/*.jinja` beside the
  tokenizer take priority over `tokenizer_config.json`'s `chat_template`, which is a string or
  a list of `{"name", "template"}`; several templates become a dict by name.

Model-specific tokenizer classes of transformers (`tokenizer_class` other than
`PreTrainedTokenizerFast` / `TokenizersBackend`) may rebuild parts of the pipeline in Python;
those are not reproduced: the router still uses `tokenizer.json` as written, and says so in its log.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer

log = logging.getLogger(__name__)

SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
GENERIC_CLASSES = {None, "PreTrainedTokenizerFast", "TokenizersBackend"}
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"

ChatTemplates = str | dict[str, str] | None


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


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

    @classmethod
    def from_directory(cls, path: str | Path) -> HfTokenizer:
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        directory = file.parent
        backend = Tokenizer.from_file(str(file))
        config = _read_json(directory / "tokenizer_config.json")
        special_map = _read_json(directory / "special_tokens_map.json")
        if config.get("tokenizer_class") not in GENERIC_CLASSES:
            log.warning(
                "tokenizer_class %s: tokenizing with tokenizer.json as written; transformers' "
                "class-specific changes to the pipeline are not reproduced",
                config.get("tokenizer_class"),
            )
        special: dict[str, str] = {}
        for name in SPECIAL_TOKEN_NAMES:
            text = _token_text(config.get(name, special_map.get(name)))
            if text is not None:
                special[name] = text
        extra = config.get("extra_special_tokens", config.get("additional_special_tokens"))
        if extra is None:
            extra = special_map.get("additional_special_tokens", [])
        if isinstance(extra, dict):  # named extra tokens ({"image_token": "<image>"})
            extra = list(extra.values())
        extra_texts = [t for t in map(_token_text, extra if isinstance(extra, list) else []) if t]
        vocab = backend.get_vocab(with_added_tokens=True)
        missing = [t for t in (*special.values(), *extra_texts) if t not in vocab]
        if missing:
            backend.add_special_tokens(
                [AddedToken(t, special=True, normalized=False) for t in dict.fromkeys(missing)]
            )
        backend.encode_special_tokens = False
        return cls(backend, special, load_chat_templates(directory, config))

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)
