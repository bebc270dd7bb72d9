"""vLLM's OpenAI-style errors: what a handler raises, and the body `{"error": {...}}` it becomes."""

from __future__ import annotations

from typing import Any

INTERNAL_ERROR = "Internal server error"


class APIError(Exception):
    """An OpenAI-style error: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type_: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.status,
            }
        }


def bad_request(message: str, param: str | None = None, value: Any = None) -> APIError:
    if param is not None:
        message = f"{message} (parameter={param}, value={value})"
    return APIError(400, message, "BadRequestError", param)


def internal_error(message: str = INTERNAL_ERROR) -> APIError:
    return APIError(500, message, "InternalServerError")
