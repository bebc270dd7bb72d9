"""The fallback tokenization of `tandem emulate`, from its specification, so that the router's
block keys meet the emulator's KV events when the engines have no tokenizer.json.

Specification (docs/emulator.md): the text is split by the regular expression below (a word with
its leading space, a run of digits, a run of other symbols with their leading space, or
whitespace); a piece longer than 8 characters is cut into 4-character chunks; each chunk becomes
the token id `256 + crc32(chunk UTF-8) mod (128256 - 256)`. No special tokens are added.
Select it with `tokenizer: tandem-fallback` (`--tokenizer tandem-fallback`).
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterator

FALLBACK_TOKENIZER = "tandem-fallback"
PIECES = re.compile(r" ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+")
FIRST_ID, VOCAB_SIZE = 256, 128256
LONGEST_PIECE, CHUNK = 8, 4


def _chunks(text: str) -> Iterator[bytes]:
    for piece in PIECES.findall(text):
        if len(piece) <= LONGEST_PIECE:
            yield piece.encode()
        else:
            yield from (piece[i : i + CHUNK].encode() for i in range(0, len(piece), CHUNK))


def fallback_token_ids(text: str) -> list[int]:
    """Token ids of `text` under the emulator's fallback tokenization."""
    span = VOCAB_SIZE - FIRST_ID
    return [FIRST_ID + zlib.crc32(chunk) % span for chunk in _chunks(text)]
