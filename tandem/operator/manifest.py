"""Reading ServingCluster manifests: validation with one "field.path: message" line per problem."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from tandem.operator.api import KIND, ServingCluster


class ManifestError(ValueError):
    """A manifest that is not a valid ServingCluster; the message names every bad field."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("; ".join(problems))


def _field_path(loc: tuple[int | str, ...], extra: str | None) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in {"function-after", "function-before"} or "[" in str(part):
            continue  # pydantic's validator frames and union tags are not fields
        else:
            path += f".{part}" if path else str(part)
    if extra:
        path = f"{path}.{extra}" if path else extra
    return path or "(root)"


def _message(error: Any) -> str:
    kind = error["type"]
    ctx = error.get("ctx") or {}
    given = error.get("input")
    if kind == "missing":
        return "required field is missing"
    if kind == "extra_forbidden":
        return "unknown field"
    if kind in {"greater_than_equal", "greater_than", "less_than_equal", "less_than"}:
        op = {
            "greater_than_equal": ">=",
            "greater_than": ">",
            "less_than_equal": "<=",
            "less_than": "<",
        }
        bound = next(iter(v for k, v in ctx.items() if k in {"ge", "gt", "le", "lt"}))
        return f"must be {op[kind]} {bound} (got {given!r})"
    if kind in {"literal_error", "enum"}:
        return f"unsupported value {given!r}; must be one of {ctx.get('expected')}"
    if kind == "cross_field":
        return str(ctx.get("message", error["msg"]))
    return (
        f"{error['msg']} (got {given!r})" if not isinstance(given, (dict, list)) else error["msg"]
    )


def errors_of(exc: ValidationError, prefix: tuple[str, ...] = ()) -> list[str]:
    """One "field.path: message" line per pydantic error, with fields in their camelCase names."""
    lines = []
    for error in exc.errors():
        ctx = error.get("ctx") or {}
        extra = ctx.get("field") if error["type"] == "cross_field" else None
        lines.append(f"{_field_path(prefix + tuple(error['loc']), extra)}: {_message(error)}")
    return lines


def parse_manifest(document: Any) -> ServingCluster:
    """Validate one decoded manifest; raises ManifestError naming each bad field."""
    if not isinstance(document, dict):
        raise ManifestError(
            [f"(root): expected a ServingCluster object, got {type(document).__name__}"]
        )
    try:
        return ServingCluster.model_validate(document)
    except ValidationError as exc:
        raise ManifestError(errors_of(exc)) from None


def load_manifest(path: str | Path) -> ServingCluster:
    """Read a YAML file holding one ServingCluster (the first ServingCluster of a multi-document file)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ManifestError([f"{path}: cannot read: {exc.strerror}"]) from None
    try:
        documents = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise ManifestError([f"{path}: not valid YAML: {exc}"]) from None
    if not documents:
        raise ManifestError([f"{path}: no object in the file"])
    for document in documents:
        if isinstance(document, dict) and document.get("kind") == KIND:
            return parse_manifest(document)
    return parse_manifest(documents[0])
