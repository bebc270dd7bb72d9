"""Which tokenizer class vLLM 0.32 (transformers 5.19) loads for a model, and the pipeline it builds.

Choosing the class (`resolve_class`), as `vllm.tokenizers.registry.get_tokenizer` and
`AutoTokenizer.from_pretrained` do for a local directory (`tokenizer_mode=hf`, `mistral_format`
off, no remote code):

1. `model_type` (config.json) in vLLM's own list (`VLLM_GENERIC_MODEL_TYPES`): generic.
2. The hub class H is `tokenizer_config.json`'s `tokenizer_class`, else config.json's; R is the
   class transformers registers for `model_type` (`REGISTERED`, "Fast" suffixes dropped).
   When both exist and differ: if R is generic the tokenizer is generic; else it is R when
   `model_type` is in `INCORRECT_HUB_CLASS`, H otherwise (a generic H gives generic).
3. Otherwise H itself; without H, R (generic when none is registered).

A `model_type` missing from `REGISTERED` with a non-generic H or without H (transformers may
register a class for it), a class not known here, or remote code (`auto_map`) cannot be decided
here: `resolve_class` returns None and the router declines the tokenizer.

Building the pipeline (`class_backend`): a class in `GENERIC` keeps `tokenizer.json` as written.
A class in `PIPELINES` has its own `__init__` in transformers, which takes only the vocabulary and
merges (and the post-processor) from `tokenizer.json` and builds the rest itself (`PIPELINES`):

| class | model | normalizer | pre-tokenizer |
|---|---|---|---|
| LlamaTokenizer | BPE, byte fallback, fuse_unk, no unk token | none | Metaspace("▁", prepend scheme*, split=False) |
| GemmaTokenizer | BPE, byte fallback, fuse_unk, unk = `unk_token` (default `<unk>`) | Replace(" ", "▁") | Split(" ", merged_with_previous) |
| Qwen2Tokenizer / Qwen3_5Tokenizer | BPE, no unk | NFC | Split(Qwen regex, isolated) + ByteLevel(add_prefix_space, no regex) |
| GPT2Tokenizer | BPE | none | ByteLevel(add_prefix_space) |
| GPTNeoXTokenizer | BPE | NFC | ByteLevel(add_prefix_space, trim_offsets); no post-processing |
| CohereTokenizer | BPE | NFC | Digits(individual) + ByteLevel(add_prefix_space) |

*`add_prefix_space` (default true) and `legacy` (default false): "first" when both say so,
"always" with legacy, "never" without a prefix space. The added tokens are then added again in
transformers' order (see `add_tokens_as_transformers`), which can renumber them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

GENERIC = frozenset(
    {
        "TokenizersBackend",
        "PreTrainedTokenizerFast",
        "PreTrainedTokenizer",
        "PythonBackend",
        "BloomTokenizer",
        "MistralCommonBackend",  # vLLM passes mistral_format=False: generic
    }
)
VLLM_GENERIC_MODEL_TYPES = frozenset(
    {"internlm2", "step3_vl", "step3p7", "unlimited-ocr", "unlimited_ocr"}
)


def _each(names: str, value: str | None) -> dict[str, str | None]:
    return dict.fromkeys(names.split(), value)


# transformers' MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS (all of it: a generic hub class gives
# the registered class exactly for these)
INCORRECT_HUB_CLASS = frozenset(
    _each(
        "arctic camembertv2-base chameleon chatlm cohere_asr deepseek_ocr deepseek_ocr2 "
        "deepseek_v2 deepseek_v3 deepseek_v32 deepseek_v4 deepseek_vl deepseek_vl_hybrid "
        "deepseek_vl_v2 ernie4_5 ernie4_5_moe fuyu h2ovl_chat hyperclovax hyperclovax_vision_v2 "
        "hyperclovax_vlm internlm2 jamba janus llava llava_next minicpm3 minicpmv minimax_m2 "
        "modernbert modernbert-decoder molmo molmo2 nemotron nvfp4 opencua openvla paddleocr_vl "
        "phi3 phi3_v phimoe qwen2 qwen3_5 qwen3_5_moe qwen3_5_moe_text qwen4_exp smolvlm "
        "step3_vl step3p5 vipllava",
        None,
    )
)
# model_type -> the class transformers 5.19 registers for it (None: none is registered), for the
# incorrect-hub-class types and the popular decoder families; the grid recorded by
# scripts/capture_tokenizer_classes.py checks it against transformers.
REGISTERED: dict[str, str | None] = {
    **dict.fromkeys(INCORRECT_HUB_CLASS, "TokenizersBackend"),
    **_each(
        "mistral mixtral ministral ministral3 mistral3 pixtral glm glm4 glm4_moe glm4_moe_lite "
        "glm4v glm4v_moe granite granitemoe granitemoehybrid granitemoeshared olmo2 olmo3 "
        "stablelm kimi_linear kimi_k25",
        "TokenizersBackend",
    ),
    **_each(
        "qwen2 qwen2_moe qwen2_vl qwen2_5_vl qwen2_5_omni qwen2_audio qwen3 qwen3_moe qwen3_next "
        "qwen3_vl qwen3_vl_moe qwen3_omni_moe",
        "Qwen2Tokenizer",
    ),
    **_each("qwen3_5 qwen3_5_moe qwen3_5_text qwen3_5_moe_text qwen4_exp", "Qwen3_5Tokenizer"),
    **_each("gemma gemma2 gemma3 gemma3_text gemma3n gemma3n_text", "GemmaTokenizer"),
    **_each("gpt2 phi starcoder2 codegen dbrx hyperclovax_vision_v2", "GPT2Tokenizer"),
    **_each("cohere cohere2 aya_vision", "CohereTokenizer"),
    **_each("gpt_neox olmo olmoe mamba mamba2", "GPTNeoXTokenizer"),
    "code_llama": "CodeLlamaTokenizer",
    "t5": "T5Tokenizer",
    **_each(
        "llama llama4 mllama gpt_oss falcon falcon_h1 exaone exaone4 smollm3 seed_oss apertus "
        "hunyuan_v1_dense arcee bamba gemma4 phi4",
        None,
    ),
}
QWEN2_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
QWEN3_5_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"""
    r"""| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class UnsupportedTokenizer(Exception):
    """The router cannot reproduce this model's tokenizer exactly."""


def _base_name(name: str) -> str:
    return name.removesuffix("Fast") if name != "PreTrainedTokenizerFast" else name


def resolve_class(tokenizer_config: dict[str, Any], model_config: dict[str, Any]) -> str | None:
    """The tokenizer class vLLM 0.32 loads (generic ones as "TokenizersBackend"); None if unknown."""
    model_type = model_config.get("model_type")
    if model_type in VLLM_GENERIC_MODEL_TYPES:
        return "TokenizersBackend"
    auto_map = tokenizer_config.get("auto_map")
    # remote code, or (vLLM without --trust-remote-code) another branch of transformers' rules
    if isinstance(auto_map, list) or (isinstance(auto_map, dict) and "AutoTokenizer" in auto_map):
        return None
    hub = tokenizer_config.get("tokenizer_class") or model_config.get("tokenizer_class")
    hub = _base_name(hub) if isinstance(hub, str) else None
    if isinstance(model_type, str) and model_type:
        if model_type not in REGISTERED:  # neither incorrect-hub-class nor known here
            return "TokenizersBackend" if hub in GENERIC else None
        registered = REGISTERED[model_type]
        if hub is not None and registered is not None and registered != hub:
            if registered in GENERIC:
                return "TokenizersBackend"
            chosen = registered if model_type in INCORRECT_HUB_CLASS else hub
            return _known(chosen)
        if hub is None:
            return _known(registered or "TokenizersBackend")
    return _known(hub or "TokenizersBackend")


def _known(name: str) -> str | None:
    if name in GENERIC:
        return "TokenizersBackend"
    return name if name in PIPELINES or name in KNOWN_UNREPRODUCED else None


def _vocab_and_merges(file: dict[str, Any]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    model = file.get("model") or {}
    if model.get("type") != "BPE":
        raise UnsupportedTokenizer(f"tokenizer.json model {model.get('type')} under a BPE class")
    vocab = model.get("vocab")
    if isinstance(vocab, list):
        vocab = {t[0] if isinstance(t, list) else t: i for i, t in enumerate(vocab)}
    merges: list[tuple[str, str]] = []
    for merge in model.get("merges", []):
        left, right = merge.split(" ") if isinstance(merge, str) else merge
        merges.append((left, right))
    return dict(vocab or {}), merges


def _llama(file: dict[str, Any], config: dict[str, Any]) -> Tokenizer:
    vocab, merges = _vocab_and_merges(file)
    prefix = config.get("add_prefix_space")
    prefix = True if prefix is None else bool(prefix)
    scheme = ("always" if config.get("legacy", False) else "first") if prefix else "never"
    backend = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True))
    backend.normalizer = None
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme=scheme, split=False
    )
    return backend


def _gemma(file: dict[str, Any], config: dict[str, Any]) -> Tokenizer:
    vocab, merges = _vocab_and_merges(file)
    unk = _token_text(config.get("unk_token")) or "<unk>"
    backend = Tokenizer(
        BPE(vocab=vocab, merges=merges, fuse_unk=True, unk_token=unk, byte_fallback=True)
    )
    backend.pre_tokenizer = pre_tokenizers.Split(
        pattern=" ", behavior="merged_with_previous", invert=False
    )
    backend.normalizer = normalizers.Replace(" ", "▁")
    return backend


def _byte_level_bpe(
    file: dict[str, Any],
    normalizer: normalizers.Normalizer | None,
    pre_tokenizer: pre_tokenizers.PreTokenizer,
) -> Tokenizer:
    """The GPT-2 family's model: BPE without unk, prefixes or suffixes."""
    vocab, merges = _vocab_and_merges(file)
    bpe = BPE(
        vocab=vocab,
        merges=merges,
        continuing_subword_prefix="",
        end_of_word_suffix="",
        fuse_unk=False,
    )
    backend = Tokenizer(bpe)
    backend.normalizer = normalizer
    backend.pre_tokenizer = pre_tokenizer
    return backend


def _prefix_space(config: dict[str, Any]) -> bool:
    return bool(config.get("add_prefix_space") or False)


def _qwen(regex: str) -> Callable[[dict[str, Any], dict[str, Any]], Tokenizer]:
    def build(file: dict[str, Any], config: dict[str, Any]) -> Tokenizer:
        split = pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False)
        byte_level = pre_tokenizers.ByteLevel(
            add_prefix_space=_prefix_space(config), use_regex=False
        )
        return _byte_level_bpe(
            file, normalizers.NFC(), pre_tokenizers.Sequence([split, byte_level])
        )

    return build


def _gpt2(file: dict[str, Any], config: dict[str, Any]) -> Tokenizer:
    return _byte_level_bpe(
        file, None, pre_tokenizers.ByteLevel(add_prefix_space=_prefix_space(config))
    )


def _gpt_neox(file: dict[str, Any], config: dict[str, Any]) -> Tokenizer:
    byte_level = pre_tokenizers.ByteLevel(
        add_prefix_space=_prefix_space(config), trim_offsets=bool(config.get("trim_offsets", True))
    )
    return _byte_level_bpe(file, normalizers.NFC(), byte_level)


def _cohere(file: dict[str, Any], config: dict[str, Any]) -> Tokenizer:
    digits = pre_tokenizers.Digits(individual_digits=True)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=_prefix_space(config), trim_offsets=True)
    return _byte_level_bpe(file, normalizers.NFC(), pre_tokenizers.Sequence([digits, byte_level]))


@dataclass(frozen=True)
class ClassPipeline:
    """A transformers tokenizer class with its own `__init__`."""

    build: Callable[[dict[str, Any], dict[str, Any]], Tokenizer]
    defaults: dict[str, str]  # the named tokens its __init__ defaults to
    # what its __init__ does after TokenizersBackend's: "" (nothing), "readd_special" (adds the
    # special tokens once more), "post_init" (adds them as special tokens), "no_post_processor"
    # (replaces the post-processor with one that adds nothing: add_bos/eos_token are dropped
    # when tokenizer.json exists)
    finish: str = ""


_ENDOFTEXT = "<|endoftext|>"
PIPELINES: dict[str, ClassPipeline] = {
    "LlamaTokenizer": ClassPipeline(
        _llama, {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}
    ),
    "GemmaTokenizer": ClassPipeline(
        _gemma,
        {
            "unk_token": "<unk>",
            "bos_token": "<bos>",
            "eos_token": "<eos>",
            "pad_token": "<pad>",
            "mask_token": "<mask>",
        },
    ),
    "Qwen2Tokenizer": ClassPipeline(
        _qwen(QWEN2_REGEX),
        {"unk_token": _ENDOFTEXT, "eos_token": _ENDOFTEXT, "pad_token": _ENDOFTEXT},
        "readd_special",
    ),
    "Qwen3_5Tokenizer": ClassPipeline(
        _qwen(QWEN3_5_REGEX),
        {"unk_token": _ENDOFTEXT, "eos_token": _ENDOFTEXT, "pad_token": _ENDOFTEXT},
    ),
    "GPT2Tokenizer": ClassPipeline(
        _gpt2, {"unk_token": _ENDOFTEXT, "bos_token": _ENDOFTEXT, "eos_token": _ENDOFTEXT}
    ),
    "GPTNeoXTokenizer": ClassPipeline(
        _gpt_neox,
        {
            "unk_token": _ENDOFTEXT,
            "bos_token": _ENDOFTEXT,
            "eos_token": _ENDOFTEXT,
            "pad_token": "<|padding|>",
        },
        "no_post_processor",
    ),
    "CohereTokenizer": ClassPipeline(
        _cohere,
        {
            "unk_token": "<UNK>",
            "bos_token": "<BOS_TOKEN>",
            "eos_token": "<|END_OF_TURN_TOKEN|>",
            "pad_token": "<PAD>",
            "cls_token": "<CLS>",
            "sep_token": "<SEP>",
            "mask_token": "<MASK_TOKEN>",
        },
        "post_init",
    ),
}
# classes transformers knows but whose pipelines are not reproduced here
KNOWN_UNREPRODUCED = frozenset({"CodeLlamaTokenizer", "T5Tokenizer"})


def _token_text(value: Any) -> str | None:
    if isinstance(value, (str, AddedToken)):
        return str(value)
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _added_token(data: dict[str, Any], special: bool | None = None) -> AddedToken:
    fields = {k: v for k, v in data.items() if k not in ("__type", "id")}
    if special is not None:
        fields["special"] = special
    return AddedToken(**fields)


@dataclass
class TokenSetup:
    """The tokens transformers' `_from_pretrained` hands a tokenizer class, in its order."""

    added: list[AddedToken]  # added_tokens_decoder (tokenizer_config.json or tokenizer.json), by id
    named: dict[str, str | AddedToken]  # bos_token, ..., then model-specific *_token names
    extra: list[str | AddedToken]  # extra_special_tokens / additional_special_tokens


def token_setup(
    file: dict[str, Any],
    config: dict[str, Any],
    special_map: dict[str, Any],
    legacy_added: dict[str, int],
    defaults: dict[str, str] | None = None,
) -> TokenSetup:
    """Added and special tokens as `PreTrainedTokenizerBase._from_pretrained` reads them.

    `added_tokens_decoder` in tokenizer_config.json wins; without it `special_tokens_map.json`
    overrides the config's named tokens and the added tokens are `added_tokens.json`'s
    (`legacy_added`; normalized unless special), then tokenizer.json's `added_tokens` by id.
    Named tokens equal to an added token take that token's flags; `defaults` are the class
    `__init__`'s own defaults for names the files leave out.
    """
    config = dict(config)
    if "additional_special_tokens" in config and not config.get("extra_special_tokens"):
        config["extra_special_tokens"] = config.pop("additional_special_tokens")
    decoder: dict[int, AddedToken] = {}
    if "added_tokens_decoder" in config:
        for index, data in config["added_tokens_decoder"].items():
            decoder[int(index)] = _added_token(data)
    else:
        for key, value in special_map.items():
            if isinstance(value, dict) and key != "extra_special_tokens":
                value = _added_token({k: v for k, v in value.items() if k != "special"}, True)
            if key == "additional_special_tokens" and not config.get("extra_special_tokens"):
                key = "extra_special_tokens"
            config[key] = value
        # AddedToken dicts of the config are not converted yet at this point: they never match
        extras = config.get("extra_special_tokens")
        special = {
            str(value)
            for value in (
                *(config.get(k) for k in SPECIAL_TOKEN_NAMES),
                *(extras if isinstance(extras, list) else []),
            )
            if value and not isinstance(value, dict)
        }
        for text, index in legacy_added.items():
            is_special = text in special
            decoder[int(index)] = AddedToken(
                text, lstrip=False, rstrip=False, normalized=not is_special, special=is_special
            )
        for data in file.get("added_tokens", []):
            decoder[int(data["id"])] = _added_token(data)
    by_text = {str(t): t for t in decoder.values()}
    named: dict[str, str | AddedToken] = {}
    for key in (*SPECIAL_TOKEN_NAMES, *(k for k in config if k.endswith("_token"))):
        value = config.get(key, (defaults or {}).get(key))
        if isinstance(value, dict) and value.get("__type") == "AddedToken":
            value = _added_token(value)
        if isinstance(value, (str, AddedToken)) and key not in named:
            named[key] = by_text.get(str(value), value)
    extra = config.get("extra_special_tokens") or []
    if isinstance(extra, dict):
        named.update((k, v) for k, v in extra.items() if isinstance(v, (str, AddedToken)))
        extra = []
    extra_tokens = [
        _added_token(t) if isinstance(t, dict) else t
        for t in extra
        if isinstance(t, (str, dict, AddedToken))
    ]
    return TokenSetup([decoder[i] for i in sorted(decoder)], named, extra_tokens)


def add_tokens_as_transformers(backend: Tokenizer, setup: TokenSetup) -> None:
    """`TokenizersBackend.__init__`'s one `add_tokens` call: every added token again (its check for
    tokens already present compares ids with tokens, so it never skips one), then each named and
    extra special token whose text is not yet an added token, as a special token when given as
    text; a named token given as a non-special AddedToken is made special."""
    to_add: list[str | AddedToken] = list(setup.added)
    texts = {str(t) for t in backend.get_added_tokens_decoder().values()} | set(map(str, to_add))
    for token in (*setup.named.values(), *setup.extra):
        if str(token) not in texts:
            to_add.append(token)
    named_texts = {str(t) for t in setup.named.values()}
    tokens = []
    for token in to_add:
        if isinstance(token, str):
            token = AddedToken(token, special=True)
        elif not token.special and str(token) in named_texts:
            token.special = True
        tokens.append(token)
    if tokens:
        backend.add_tokens(tokens)


def class_backend(
    name: str,
    file_path: str,
    file: dict[str, Any],
    config: dict[str, Any],
    special_map: dict[str, Any],
    legacy_added: dict[str, int],
) -> tuple[Tokenizer, dict[str, str]]:
    """The backend tokenizer transformers builds for class `name` (from `resolve_class`) and the
    named special tokens it ends with (what chat templates see)."""
    pipeline = PIPELINES.get(name)
    if pipeline is None:  # generic
        backend = Tokenizer.from_file(file_path)
        setup = token_setup(file, config, special_map, legacy_added)
    else:
        backend = pipeline.build(file, config)
        # the file's post-processor, read as transformers does: without vocabulary or merges
        minimal = {
            **file,
            "added_tokens": [],
            "model": {**file["model"], "vocab": {}, "merges": []},
        }
        post_processor = Tokenizer.from_str(json.dumps(minimal)).post_processor
        if post_processor is not None:
            backend.post_processor = post_processor
        setup = token_setup(file, config, special_map, legacy_added, pipeline.defaults)
    add_tokens_as_transformers(backend, setup)
    finish = pipeline.finish if pipeline else ""
    specials = (*setup.named.values(), *setup.extra)
    if finish == "readd_special":
        texts = dict.fromkeys(str(t) for t in specials)
        backend.add_tokens([AddedToken(t, special=True) for t in texts])
    elif finish == "post_init":
        backend.add_special_tokens(
            [
                t if isinstance(t, AddedToken) else AddedToken(t, special=True, normalized=False)
                for t in specials
            ]
        )
    elif finish == "no_post_processor":
        backend.post_processor = processors.TemplateProcessing(
            single="$A:0", pair="$A:0 $B:1", special_tokens=[]
        )
    backend.encode_special_tokens = False
    backend.no_truncation()
    backend.no_padding()
    return backend, {k: str(v) for k, v in setup.named.items() if k in SPECIAL_TOKEN_NAMES}
