"""Prompts of a trace replay: each block id becomes one exact sequence of tokens.

A block's tokens are drawn from a vocabulary of words that are each one token with their
leading space (" the", " fox"): in the served model's tokenizer, when one is given, only words
that it encodes as one token on their own, so the same block is the same token ids whether the
prompt goes as ids (completions `prompt: [ids]`) or as the words' text. Token k of block b is
word number splitmix64(splitmix64(b XOR splitmix64(seed)) + k) mod V of the V words: equal ids
give equal blocks, different ids blocks that differ almost surely from their first token.
Text prompts made with a tokenizer are encoded back (the first CHECKED_TOKENS tokens of them)
and must give exactly the planned ids.
Without a tokenizer the words are `tandem.bench.workloads.WORDS`, about one token each on real
BPE tokenizers: blocks are equal text, their lengths approximate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tandem.bench.spec import Trace
from tandem.bench.trace_plan import TimedRequest
from tandem.bench.workloads import WORDS, PlannedRequest, Schedule

MAX_VOCABULARY = 4096
CHECKED_TOKENS = 100_000
# A warm-up request's blocks use ids below every trace's (trace ids are >= 0, fresh ones count
# down from -1), so warming up never caches a block of the trace.
WARMUP_IDS_FROM = -(1 << 40)


@dataclass(frozen=True)
class Vocabulary:
    """Words (each with its leading space) and, with a tokenizer, each word's token id."""

    words: tuple[str, ...]
    token_ids: tuple[int, ...] = ()
    tokenizer: Any = None  # a tokenizers.Tokenizer

    @property
    def exact(self) -> bool:
        return self.tokenizer is not None


def load_tokenizer(path: str) -> Any:
    """The `tokenizers.Tokenizer` of a tokenizer.json file or of a directory holding one."""
    from tokenizers import Tokenizer

    file = Path(path)
    if file.is_dir():
        file = file / "tokenizer.json"
    if not file.is_file():
        raise FileNotFoundError(f"no tokenizer.json at {path}")
    return Tokenizer.from_file(str(file))


def vocabulary(tokenizer: Any = None) -> Vocabulary:
    """The first MAX_VOCABULARY token ids that decode to a plain word and that the tokenizer
    encodes, with a leading space, as exactly that one id; `WORDS` without a tokenizer."""
    if tokenizer is None:
        return Vocabulary(tuple(f" {word}" for word in WORDS))
    words: list[str] = []
    ids: list[int] = []
    for token_id in range(tokenizer.get_vocab_size()):
        word = str(tokenizer.decode([token_id])).strip()
        if not (word.isascii() and word.isalpha()):
            continue
        if tokenizer.encode(f" {word}", add_special_tokens=False).ids == [token_id]:
            words.append(f" {word}")
            ids.append(token_id)
            if len(ids) >= MAX_VOCABULARY:
                break
    if len(ids) < 2:
        raise ValueError("the tokenizer has too few single-token words to build prompts from")
    return Vocabulary(tuple(words), tuple(ids), tokenizer)


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over uint64 (wrapping arithmetic is the algorithm)."""
    z = z + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    mixed: np.ndarray = z ^ (z >> np.uint64(31))
    return mixed


class BlockPrompts:
    """Builds the prompt of a timed request from its block ids (see the module docstring)."""

    def __init__(self, words: Vocabulary, block_tokens: int, seed: int = 0) -> None:
        self.words = words
        self.block_tokens = block_tokens
        self._seed = _splitmix64(np.array([seed], dtype=np.uint64))[0]
        # one shared int object per word: a prompt's list then costs a pointer per token
        self._ids = list(words.token_ids)

    def word_indices(self, block_ids: Sequence[int], tokens: int) -> np.ndarray:
        """Word number of each of the prompt's first `tokens` tokens."""
        ids = np.array(block_ids, dtype=np.int64).view(np.uint64)
        keys = _splitmix64(ids ^ self._seed)
        positions = np.arange(tokens, dtype=np.uint64)
        block_tokens = np.uint64(self.block_tokens)
        per_token = keys[(positions // block_tokens).astype(np.intp)] + positions % block_tokens
        indices: np.ndarray = (_splitmix64(per_token) % np.uint64(len(self.words.words))).astype(
            np.intp
        )
        return indices

    def token_ids(self, request: TimedRequest) -> list[int]:
        if not self.words.exact:
            raise ValueError("token-id prompts need the served model's tokenizer")
        return [self._ids[i] for i in self.word_indices(request.block_ids, request.input_tokens)]

    def text(self, request: TimedRequest) -> str:
        words = self.words.words
        return "".join(words[i] for i in self.word_indices(request.block_ids, request.input_tokens))

    def check_text(self, requests: Sequence[TimedRequest], texts: Sequence[str]) -> None:
        """Raises ValueError unless the first texts (CHECKED_TOKENS tokens' worth) encode to
        exactly their requests' planned ids.

        Every word is one token on its own; whether the tokenizer also keeps them apart in a
        sequence is a property of its pre-tokenizer, which a long enough sample settles. (All
        of them would cost seconds per million tokens.)
        """
        if not self.words.exact or not texts:
            return
        count, budget = 0, CHECKED_TOKENS
        while count < len(requests) and budget > 0:
            budget -= requests[count].input_tokens
            count += 1
        encoded = self.words.tokenizer.encode_batch(list(texts[:count]), add_special_tokens=False)
        for request, encoding in zip(requests[:count], encoded, strict=True):
            if encoding.ids != self.token_ids(request):
                raise ValueError(
                    f"the tokenizer does not encode request {request.index}'s text to its planned "
                    "blocks; send token ids (completions) instead"
                )


def warmup_requests(requests: Sequence[TimedRequest], count: int) -> list[TimedRequest]:
    """`count` requests shaped like the first ones, all at once, on blocks of no trace."""
    warm = []
    for i, request in enumerate(requests[:count]):
        base = WARMUP_IDS_FROM - i * 1_000_000
        ids = tuple(base - j for j in range(len(request.block_ids)))
        warm.append(TimedRequest(i, 0.0, request.input_tokens, request.output_tokens, ids))
    return warm


def trace_schedule(
    requests: Sequence[TimedRequest], spec: Trace, prompts: BlockPrompts
) -> Schedule:
    """Warm-up and measured requests with their prompts; phase "trace", or "loop-N" in loops."""

    def planned(timed: Sequence[TimedRequest], phase_of: Any) -> list[PlannedRequest]:
        if spec.prompt == "ids":
            bodies: list[str | list[int]] = [prompts.token_ids(r) for r in timed]
        else:
            texts = [prompts.text(r) for r in timed]
            prompts.check_text(timed, texts)
            bodies = list(texts)
        return [
            PlannedRequest(
                r.index, r.at_s, body, "", r.input_tokens, r.output_tokens, "trace", phase_of(r)
            )
            for r, body in zip(timed, bodies, strict=True)
        ]

    def measured_phase(r: TimedRequest) -> str:
        return f"loop-{r.loop}" if spec.loops > 1 else "trace"

    warm = warmup_requests(requests, spec.warmup_requests)
    return Schedule(planned(warm, lambda _: "warmup"), planned(requests, measured_phase))


def build_trace_schedule(spec: Trace, requests: Sequence[TimedRequest]) -> Schedule:
    """`trace_schedule` with the vocabulary of `spec.tokenizer` (WORDS when there is none)."""
    tokenizer = load_tokenizer(spec.tokenizer) if spec.tokenizer else None
    prompts = BlockPrompts(vocabulary(tokenizer), spec.block_tokens, spec.seed)
    return trace_schedule(requests, spec, prompts)
