"""Request features for routing: prompt length in tokens and the prompt's block keys.

With the model's tokenizer (`--tokenizer DIR`) the keys are exact: the same token blocks the
engines hash, so they meet the KV-event index; `--tokenizer tandem-fallback` is exact for
`tandem emulate` engines that have no tokenizer.json (see fallback_tokenizer.py). Without either,
the documented approximation applies: the prompt text is cut into chunks of 4 x block_size
characters (about one block at ~4 characters per token) and the token count is estimated as
characters / 4; those keys can only meet the approximate index built from the router's own
routing history.
Chat prompts are rendered with the tokenizer's chat template when jinja2 is importable, otherwise
as `"{role}: {content}\\n"` per message followed by `"assistant:"`.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.router.blocks import block_keys, salted_parent, text_block_keys
from tandem.router.fallback_tokenizer import FALLBACK_TOKENIZER, fallback_token_ids

CHARS_PER_TOKEN = 4


@dataclass(frozen=True, slots=True)
class Features:
    prompt_tokens: int
    keys: list[int]
    exact: bool  # keys come from real token ids (they can meet the KV-event index)


class Featurizer:
    """Turns an OpenAI request body into `Features`; caches recent prompts (exact repeats).

    A cache collision needs two prompts of equal length with equal 64-bit hashes; it could only
    misplace one request, never change what an engine computes.
    """

    def __init__(self, block_size: int, tokenizer_dir: str | None = None, cache_size: int = 1024):
        self.block_size = block_size
        self._encode: Callable[[str], list[int]] | None = None
        self._template: Any = None
        self._add_bos: str | None = None
        # keyed by (hash, length, salt) so cached prompts cost no memory beyond their features
        self._cache: OrderedDict[tuple[int, int, str | None], Features] = OrderedDict()
        self._cache_size = cache_size
        if tokenizer_dir == FALLBACK_TOKENIZER:
            self._encode = fallback_token_ids
        elif tokenizer_dir:
            self._load_tokenizer(Path(tokenizer_dir))

    @property
    def exact(self) -> bool:
        return self._encode is not None

    def _load_tokenizer(self, path: Path) -> None:
        from tokenizers import Tokenizer

        file = path / "tokenizer.json" if path.is_dir() else path
        tokenizer = Tokenizer.from_file(str(file))
        self._encode = lambda text: list(tokenizer.encode(text, add_special_tokens=True).ids)
        config_file = file.parent / "tokenizer_config.json"
        if config_file.exists():
            config = json.loads(config_file.read_text())
            template = config.get("chat_template")
            if isinstance(template, str):
                try:
                    import jinja2.sandbox  # type: ignore[import-not-found]

                    env = jinja2.sandbox.ImmutableSandboxedEnvironment()
                    self._template = env.from_string(template)
                except ImportError:
                    self._template = None

    def render_chat(self, messages: list[Any]) -> str:
        if self._template is not None:
            return str(self._template.render(messages=messages, add_generation_prompt=True))
        parts = []
        for message in messages:
            if not isinstance(message, dict):
                continue
            content = message.get("content")
            if isinstance(content, list):  # content parts: keep the text ones
                content = "".join(
                    str(p.get("text", ""))
                    for p in content
                    if isinstance(p, dict) and p.get("type") == "text"
                )
            parts.append(f"{message.get('role', 'user')}: {'' if content is None else content}\n")
        parts.append("assistant:")
        return "".join(parts)

    def of_body(self, body: dict[str, Any], chat: bool) -> Features:
        salt = body.get("cache_salt")
        salt = salt if isinstance(salt, str) else None
        if chat:
            messages = body.get("messages")
            return self.of_text(
                self.render_chat(messages if isinstance(messages, list) else []), salt
            )
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt:
            first = prompt[0]
            if isinstance(first, int):
                return self.of_tokens(prompt, salt)
            if isinstance(first, list):
                return self.of_tokens(first, salt)
            if isinstance(first, str):
                return self.of_text(first, salt)
        if isinstance(prompt, str):
            return self.of_text(prompt, salt)
        return Features(0, [], self.exact)

    def of_tokens(self, token_ids: list[int], salt: str | None = None) -> Features:
        try:
            keys = block_keys(token_ids, self.block_size, salted_parent(salt))
        except (OverflowError, TypeError):
            return Features(len(token_ids), [], True)
        return Features(len(token_ids), keys, True)

    def of_text(self, text: str, salt: str | None = None) -> Features:
        cache_key = (hash(text), len(text), salt)
        cached = self._cache.get(cache_key)
        if cached is not None:
            self._cache.move_to_end(cache_key)
            return cached
        if self._encode is not None:
            features = self.of_tokens(self._encode(text), salt)
        else:
            prefix = "" if salt is None else f"\x00{salt}\x00"
            keys = text_block_keys(prefix + text, CHARS_PER_TOKEN * self.block_size)
            features = Features(len(text) // CHARS_PER_TOKEN, keys, False)
        self._cache[cache_key] = features
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return features
