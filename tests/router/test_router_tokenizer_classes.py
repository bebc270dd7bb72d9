"""Model-specific tokenizer classes: the router's ids equal vLLM 0.32's, or it declines.

fixtures/tokenization/classes.json was recorded by scripts/capture_tokenizer_classes.py with
vLLM's own tokenizer loading (transformers 5.19) over the directories in fixtures/tokenization/
classes/ (byte-level and SentencePiece-style tokenizer.json files with the class and model type
set); its `renderer` part is real vLLM's `/tokenize` answering for two of them. This replay
needs no vLLM.
"""

from __future__ import annotations

import json
import shutil
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from tandem.router.features import Featurizer
from tandem.router.hf_tokenizer import HfTokenizer, UnsupportedTokenizer
from tandem.router.tokenization import RequestTokenizer
from tandem.router.tokenizer_classes import PIPELINES, resolve_class

FIXTURES = Path(__file__).parent / "fixtures" / "tokenization"
CLASSES = json.loads((FIXTURES / "classes.json").read_text(encoding="utf-8"))
VARIANTS: dict[str, Any] = CLASSES["variants"]


@cache
def _tokenizer(name: str) -> RequestTokenizer:
    return RequestTokenizer(HfTokenizer.from_directory(FIXTURES / "classes" / name))


TEXT_CASES = [
    pytest.param(name, case, id=f"{name}-{i}")
    for name, variant in VARIANTS.items()
    for i, case in enumerate(variant["texts"])
]
CHAT_CASES = [
    pytest.param(name, chat, id=f"{name}-chat{i}")
    for name, variant in VARIANTS.items()
    for i, chat in enumerate(variant["chats"])
]


@pytest.mark.parametrize("name", list(VARIANTS))
def test_router_loads_the_class_vllm_loads(name: str) -> None:
    assert _tokenizer(name).tokenizer.tokenizer_class == VARIANTS[name]["class"]


@pytest.mark.parametrize(("name", "case"), TEXT_CASES)
def test_completion_ids_equal_vllm_ids(name: str, case: dict[str, Any]) -> None:
    body = {"prompt": case["text"], "add_special_tokens": case["add_special_tokens"]}
    assert _tokenizer(name).completion_ids(body) == case["ids"]


@pytest.mark.parametrize(("name", "chat"), CHAT_CASES)
def test_chat_ids_equal_vllm_ids(name: str, chat: dict[str, Any]) -> None:
    tokenizer = _tokenizer(name)
    assert tokenizer.chat_text({"messages": chat["messages"]}) == chat["text"]
    assert tokenizer.chat_ids({"messages": chat["messages"]}) == chat["ids"]


@pytest.mark.parametrize(
    "row",
    CLASSES["grid"],
    ids=[f"{r['model_type']}-{r['tokenizer_class']}" for r in CLASSES["grid"]],
)
def test_class_choice_matches_transformers_or_declines(row: dict[str, Any]) -> None:
    config = {} if row["tokenizer_class"] is None else {"tokenizer_class": row["tokenizer_class"]}
    chosen = resolve_class(config, {"model_type": row["model_type"]})
    assert chosen in (row["class"], None)
    # every class the router reproduces or keeps generic is chosen exactly as transformers does
    if row["class"] in ("TokenizersBackend", *PIPELINES):
        assert chosen == row["class"]


def test_renderer_agreed_with_the_recorded_ids() -> None:
    """Real vLLM's /tokenize gave the recorded ids (checked when captured with --e2e)."""
    checks = CLASSES["renderer"]
    assert {c["model"] for c in checks} >= {"spm-llama2", "spm-gemma"}
    for check in checks:
        tokenizer = _tokenizer(check["model"])
        request = check["request"]
        if "messages" in request:
            assert tokenizer.chat_ids(request) == check["ids"]
        else:
            assert tokenizer.completion_ids(request) == check["ids"]


def test_the_class_changes_the_ids() -> None:
    """The classes really rebuild the pipeline: the same file gives other ids than as written."""
    differing = {
        name
        for name, variant in VARIANTS.items()
        if variant["class"] != "TokenizersBackend"
        and any(
            case["ids"]
            != VARIANTS[
                "spm-generic-class"
                if name.startswith("spm")
                else "bytelevel-deepseek-v3-llama-class"
            ]["texts"][i]["ids"]
            for i, case in enumerate(variant["texts"])
        )
    }
    assert {
        "bytelevel-llama-class",
        "bytelevel-qwen2-class",
        "spm-llama2",
        "spm-gemma",
    } <= differing


def _copy_with(tmp_path: Path, config: dict[str, Any], model_type: str) -> Path:
    directory = tmp_path / "model"
    shutil.copytree(FIXTURES / "classes" / "spm-llama2", directory)
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "config.json").write_text(json.dumps({"model_type": model_type}))
    return directory


def test_unreproduced_class_is_declined(tmp_path: Path) -> None:
    directory = _copy_with(tmp_path, {"tokenizer_class": "CodeLlamaTokenizerFast"}, "llama")
    with pytest.raises(UnsupportedTokenizer):
        HfTokenizer.from_directory(directory)
    unknown = _copy_with(tmp_path / "x", {"tokenizer_class": "LlamaTokenizerFast"}, "brand_new")
    with pytest.raises(UnsupportedTokenizer):
        HfTokenizer.from_directory(unknown)


def test_featurizer_routes_an_unreproduced_class_on_the_approximation(tmp_path: Path) -> None:
    directory = _copy_with(tmp_path, {"tokenizer_class": "CodeLlamaTokenizerFast"}, "llama")
    reasons: list[str] = []
    featurizer = Featurizer(16, str(directory), on_fallback=reasons.append)
    assert not featurizer.exact
    assert featurizer.tokenizer_issue is not None
    features = featurizer.of_body({"prompt": "Hello world, hello world"}, chat=False)
    assert not features.exact
    assert reasons == ["tokenizer_class"]


def test_token_id_prompts_stay_exact_without_the_tokenizer(tmp_path: Path) -> None:
    directory = _copy_with(tmp_path, {"tokenizer_class": "T5TokenizerFast"}, "t5")
    reasons: list[str] = []
    featurizer = Featurizer(4, str(directory), on_fallback=reasons.append)
    features = featurizer.of_body({"prompt": [1, 2, 3, 4, 5, 6, 7, 8]}, chat=False)
    assert features.exact
    assert features.prompt_tokens == 8
    assert reasons == []
