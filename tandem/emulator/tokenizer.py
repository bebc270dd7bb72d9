"""Prompt tokenization (the model's tokenizer.json, or a documented fallback) and output token text.

Fallback tokenizer (no tokenizer.json): the text is split into pieces by the regex
`FALLBACK_PATTERN` (a word with its leading space, a run of digits, a run of other symbols with
their leading space, or whitespace); pieces longer than 8 characters are cut into 4-character
chunks; each piece becomes the token id `256 + crc32(piece UTF-8) mod (vocab_size - 256)`.
It is deterministic across processes and machines, cheap, and gives token counts close to a BPE
tokenizer for English (about 4 characters per token). Its ids cannot be decoded back to text.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

FALLBACK_PATTERN = re.compile(r" ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+")
FALLBACK_VOCAB_SIZE = 128256
# Words used for output text when there is no tokenizer, indexed by (token id mod len).
FALLBACK_WORDS = (
    " the",
    " of",
    " and",
    " to",
    " in",
    " a",
    " is",
    " that",
    " for",
    " it",
    " as",
    " was",
    " with",
    " be",
    " by",
    " on",
    " not",
    " he",
    " this",
    " are",
    " or",
    " his",
    " from",
    " at",
    " which",
    " but",
    " have",
    " an",
    " had",
    " they",
    " you",
    " were",
    " their",
    " one",
    " all",
    " we",
    " can",
    " her",
    " has",
    " there",
    " been",
    " if",
    " more",
    " when",
    " will",
    " would",
    " who",
    " so",
    " no",
    " model",
    " token",
    " cache",
    " block",
    " prefix",
    " decode",
    " prefill",
    " engine",
    " router",
    " stream",
    " batch",
    ".",
    ",",
)


def fallback_encode(text: str, vocab_size: int = FALLBACK_VOCAB_SIZE) -> list[int]:
    """The fallback tokenizer (see the module docstring)."""
    span = vocab_size - 256
    ids: list[int] = []
    for piece in FALLBACK_PATTERN.findall(text):
        chunks = [piece[i : i + 4] for i in range(0, len(piece), 4)] if len(piece) > 8 else [piece]
        for chunk in chunks:
            ids.append(256 + zlib.crc32(chunk.encode()) % span)
    return ids


def render_chat(messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> str:
    """Chat prompt `{role}: {content}\\n` per message, then `assistant:`.

    This is the golden test model's template; templates needing Jinja are approximated by it.
    """
    parts = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):  # OpenAI content parts: keep the text parts
            content = "".join(
                str(p.get("text", ""))
                for p in content
                if isinstance(p, dict) and p.get("type") == "text"
            )
        parts.append(f"{message.get('role', 'user')}: {content if content is not None else ''}\n")
    if add_generation_prompt:
        parts.append("assistant:")
    return "".join(parts)


class PromptTokenizer:
    """Encodes prompts and names the output tokens the engine may generate, with their text."""

    def __init__(self, model_dir: str | None, vocab_size: int | None = None) -> None:
        self.tokenizer: Any = None
        self.eos_token_id: int | None = None
        self.vocab_size = vocab_size or FALLBACK_VOCAB_SIZE
        path = Path(model_dir) / "tokenizer.json" if model_dir else None
        if path is not None and path.is_file():
            from tokenizers import Tokenizer

            self.tokenizer = Tokenizer.from_file(str(path))
            self.vocab_size = self.tokenizer.get_vocab_size()
            self.eos_token_id = self._eos_id(Path(model_dir or "."))
        self.output_ids, self.output_text = self._output_vocabulary()

    @property
    def real(self) -> bool:
        return self.tokenizer is not None

    def _eos_id(self, model_dir: Path) -> int | None:
        config = model_dir / "tokenizer_config.json"
        eos: Any = None
        if config.is_file():
            eos = json.loads(config.read_text()).get("eos_token")
            if isinstance(eos, dict):
                eos = eos.get("content")
        if isinstance(eos, str):
            token_id = self.tokenizer.token_to_id(eos)
            return int(token_id) if token_id is not None else None
        return None

    def _output_vocabulary(self) -> tuple[list[int], dict[int, str]]:
        """Token ids that decode on their own to plain ASCII words or punctuation."""
        if self.tokenizer is None:
            ids = [256 + i for i in range(len(FALLBACK_WORDS))]
            return ids, {256 + i: w for i, w in enumerate(FALLBACK_WORDS)}
        words: dict[int, str] = {}
        others: dict[int, str] = {}
        for token_id in range(min(self.vocab_size, 50000)):
            piece = self.tokenizer.decode([token_id], skip_special_tokens=True)
            if piece and piece.isascii() and piece.isprintable() and piece.strip(" ").isalpha():
                # words with a leading space read as text; bare letters only fill up
                (words if piece.startswith(" ") and len(piece) > 2 else others)[token_id] = piece
            if len(words) >= 4096:
                break
        text = words if len(words) >= 16 else {**words, **others}
        if not text:  # unusual vocabularies: accept any non-empty piece
            for token_id in range(min(self.vocab_size, 4096)):
                piece = self.tokenizer.decode([token_id], skip_special_tokens=True)
                if piece:
                    text[token_id] = piece
        return list(text), text

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            return fallback_encode(text, self.vocab_size)
        return list(self.tokenizer.encode(text, add_special_tokens=True).ids)

    def token_text(self, token_id: int) -> str:
        text = self.output_text.get(token_id)
        if text is not None:
            return text
        if self.tokenizer is not None:
            return str(self.tokenizer.decode([token_id], skip_special_tokens=True))
        return FALLBACK_WORDS[token_id % len(FALLBACK_WORDS)]

    def decode(self, token_ids: Sequence[int]) -> str:
        if self.tokenizer is not None:
            return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))
        return "".join(self.token_text(t) for t in token_ids)
