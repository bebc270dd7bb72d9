"""Client request bodies checked before routing: every malformed but parseable body is a 400.

Only the fields the router reads, or that would break an engine in a way the client could not
tell from a router fault, are checked; everything else passes to the engine, which has the final
word (its 4xx reaches the client as sent).
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from tandem.router.errors import error_body

_decode_json = msgspec.json.Decoder().decode
_NonNegative = Annotated[int, msgspec.Meta(ge=0)]
_Positive = Annotated[int, msgspec.Meta(ge=1)]


class InvalidRequest(Exception):
    """A client mistake: answer `status` with an OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.body = error_body(status, message, param)


class _Common(msgspec.Struct):
    model: str | None = None
    n: _Positive | None = None
    max_tokens: _NonNegative | None = None
    max_completion_tokens: _NonNegative | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    cache_salt: str | None = None


class _Message(msgspec.Struct):
    role: str
    content: str | list[dict[str, Any]] | None = None


class _Chat(_Common):
    messages: Annotated[list[_Message], msgspec.Meta(min_length=1)] = msgspec.field(
        default_factory=list
    )


class _Completion(_Common):
    prompt: str | list[Any] | None = None


def _prompt_ok(prompt: str | list[Any] | None) -> bool:
    """A string, a list of strings, a list of token ids, or a list of token-id lists; not empty."""
    if isinstance(prompt, str):
        return bool(prompt)
    if not prompt:
        return False
    first = prompt[0]
    if isinstance(first, str):
        return all(isinstance(p, str) for p in prompt)
    if isinstance(first, list):
        return all(isinstance(p, list) and p and all(_token(t) for t in p) for p in prompt)
    return all(_token(t) for t in prompt)


def _token(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def parse_body(raw: bytes, chat: bool, model_names: set[str]) -> dict[str, Any]:
    """The body as a dict, checked; raises InvalidRequest (400, or 404 for an unknown model)."""
    try:
        body = _decode_json(raw)
    except msgspec.DecodeError as exc:
        raise InvalidRequest(400, f"JSON decode error: {exc}", "body") from None
    except RecursionError:
        raise InvalidRequest(400, "JSON nested too deeply", "body") from None
    if not isinstance(body, dict):
        raise InvalidRequest(400, "the request body must be a JSON object", "body")
    try:
        shape = msgspec.convert(body, _Chat if chat else _Completion)
    except msgspec.ValidationError as exc:
        field = str(exc).rpartition("`$.")[2].split("`")[0].split("[")[0].split(".")[0]
        raise InvalidRequest(400, f"invalid request: {exc}", field or None) from None
    except RecursionError:
        raise InvalidRequest(400, "JSON nested too deeply", "body") from None
    if shape.model is not None and shape.model not in model_names:
        names = ", ".join(sorted(model_names))
        raise InvalidRequest(
            404, f"The model `{shape.model}` does not exist. Valid aliases: {names}.", "model"
        )
    if chat:
        if not body.get("messages"):
            raise InvalidRequest(400, "`messages` must be a non-empty list", "messages")
    elif not isinstance(shape, _Completion) or not _prompt_ok(shape.prompt):
        raise InvalidRequest(
            400,
            "`prompt` must be a non-empty string, list of strings, or list of token ids",
            "prompt",
        )
    return body
