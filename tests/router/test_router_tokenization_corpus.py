"""The router's token ids equal real vLLM 0.32's for every case of the parity corpus.

fixtures/tokenization/corpus.json was recorded from vLLM's own renderer by
scripts/capture_tokenization_corpus.py (see there); this replay needs no vLLM. A case vLLM
refused (a template raising, a 400) must be one the router declines to tokenize exactly.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from tandem.router.chat_template import TemplateUnrenderable
from tandem.router.hf_tokenizer import HfTokenizer
from tandem.router.tokenization import RequestTokenizer

FIXTURES = Path(__file__).parent / "fixtures" / "tokenization"
CORPUS = json.loads((FIXTURES / "corpus.json").read_text(encoding="utf-8"))


@cache
def _tokenizer(model: str) -> RequestTokenizer:
    return RequestTokenizer(
        HfTokenizer.from_directory(FIXTURES / "models" / model),
        default_kwargs=CORPUS["default_chat_template_kwargs"],
    )


def _ids(record: dict[str, Any]) -> list[int]:
    tokenizer = _tokenizer(record["model"])
    if record["kind"] == "chat":
        return tokenizer.chat_ids(record["request"])
    return tokenizer.completion_ids(record["request"])


@pytest.mark.parametrize(
    "record", CORPUS["records"], ids=[f"{r['model']}-{r['case']}" for r in CORPUS["records"]]
)
def test_router_ids_equal_vllm_ids(record: dict[str, Any]) -> None:
    if record["status"] == 200:
        assert _ids(record) == record["ids"]
    else:
        with pytest.raises(TemplateUnrenderable):
            _ids(record)


def test_corpus_covers_six_templates_and_every_case_kind() -> None:
    records = CORPUS["records"]
    assert len({r["model"] for r in records}) >= 6
    ok = [r for r in records if r["status"] == 200]
    assert len(ok) >= 0.8 * len(records)
    # special-token handling really shows up in the ids: some chat prompts start with a BOS id
    assert any(r["kind"] == "completion" and r["ids"][0] != _plain_first(r) for r in ok)


def _plain_first(record: dict[str, Any]) -> int:
    tokenizer = _tokenizer(record["model"]).tokenizer
    return tokenizer.encode(record["request"]["prompt"], add_special_tokens=False)[0]
