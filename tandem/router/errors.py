"""OpenAI-format error bodies (`{"error": {"message", "type", "param", "code"}}`), as vLLM sends them."""

from __future__ import annotations

import msgspec

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    413: "RequestEntityTooLarge",
    429: "RateLimitError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}

_encode = msgspec.json.Encoder().encode


def error_body(
    status: int, message: str, param: str | None = None, type_: str | None = None
) -> bytes:
    return _encode(
        {
            "error": {
                "message": message,
                "type": type_ or _TYPES.get(status, "Error"),
                "param": param,
                "code": status,
            }
        }
    )


def sse_error_event(status: int, message: str) -> bytes:
    """An error inside an already-started stream: one error event, then `[DONE]` (vLLM's form)."""
    return b"data: " + error_body(status, message) + b"\n\ndata: [DONE]\n\n"
