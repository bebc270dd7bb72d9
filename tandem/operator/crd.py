"""The ServingCluster CustomResourceDefinition, generated from the pydantic API models.

Pydantic's JSON schema becomes a structural OpenAPI v3 schema: references inlined, nullable unions
collapsed, int-or-string and free-form objects marked, defaults taken from the models (a nested
object defaults to its whole default value, because the API server checks a default against its
level's CEL rules before filling in nested defaults), and each model's cross-field rules attached
as CEL `x-kubernetes-validations`.
"""

from __future__ import annotations

import types
import typing
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from tandem.operator.api import (
    GROUP,
    KIND,
    PLURAL,
    SHORT_NAMES,
    SINGULAR,
    VERSION,
    ServingCluster,
    ServingClusterSpec,
)
from tandem.operator.api_model import MAX_NAME_LENGTH, NAME_PATTERN
from tandem.operator.api_status import ServingClusterStatus

CRD_NAME = f"{PLURAL}.{GROUP}"
CRD_FILE = f"{GROUP}_{PLURAL}.yaml"

PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Prefill", "type": "string", "jsonPath": ".status.prefill.summary",
     "description": "Ready/desired prefill pods"},
    {"name": "Decode", "type": "string", "jsonPath": ".status.decode.summary",
     "description": "Ready/desired decode pods"},
    {"name": "Router", "type": "string", "jsonPath": ".status.router.summary", "priority": 1,
     "description": "Ready/desired router pods"},
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase",
     "description": "Pending, Progressing, Ready or Degraded"},
    {"name": "Model", "type": "string", "jsonPath": ".spec.model.name", "priority": 1,
     "description": "Model the engines load"},
    {"name": "Endpoint", "type": "string", "jsonPath": ".status.endpoint", "priority": 1,
     "description": "Router URL inside the cluster"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]  # fmt: skip

_DROPPED_KEYS = {
    "title",
    "default",
    "additionalProperties",
    "$ref",
    "anyOf",
    "allOf",
    "const",
    "format",
}


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """Pydantic model classes mentioned in a field annotation (through Optional, list, dict)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found: list[type[BaseModel]] = []
    origin = typing.get_origin(annotation)
    if origin is not None or isinstance(annotation, types.UnionType):
        for arg in typing.get_args(annotation):
            found += _models_in(arg)
    return found


def model_classes(root: type[BaseModel]) -> dict[str, type[BaseModel]]:
    """Every model reachable from `root`, by class name (pydantic's $defs keys)."""
    seen: dict[str, type[BaseModel]] = {}
    pending = [root]
    while pending:
        cls = pending.pop()
        if cls.__name__ in seen:
            continue
        seen[cls.__name__] = cls
        for field in cls.model_fields.values():
            pending += _models_in(field.annotation)
    return seen


def _jsonable(value: Any) -> Any:
    # Whole objects, not `{}`: the API server checks a default against the CEL rules of its own
    # level without applying the nested defaults first.
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json", by_alias=True, exclude_none=True)
    if isinstance(value, list):
        return [_jsonable(item) for item in value]
    return value


def field_default(field: FieldInfo) -> tuple[bool, Any]:
    """(has a default worth writing into the schema, the default as JSON)."""
    if field.default_factory is not None:
        value = _jsonable(field.default_factory())  # type: ignore[call-arg]
        if isinstance(value, dict) and not value and not _models_in(field.annotation):
            return False, None  # an empty free-form map needs no default
        if isinstance(value, list) and not value:
            return False, None
        return True, value
    if field.default is PydanticUndefined or field.default is None:
        return False, None
    return True, _jsonable(field.default)


class _Converter:
    def __init__(
        self, defs: dict[str, Any], classes: dict[str, type[BaseModel]], with_defaults: bool
    ):
        self.defs = defs
        self.classes = classes
        self.with_defaults = with_defaults

    def convert(self, node: dict[str, Any]) -> dict[str, Any]:
        description = node.get("description")
        if "$ref" in node:
            out = self.convert_ref(node["$ref"])
        elif "allOf" in node and len(node["allOf"]) == 1:
            out = self.convert(node["allOf"][0])
        elif "anyOf" in node:
            out = self.convert_union(node["anyOf"])
        else:
            out = self.convert_plain(node)
        if description:
            out["description"] = description
        return out

    def convert_ref(self, ref: str) -> dict[str, Any]:
        name = ref.rsplit("/", 1)[-1]
        out = self.convert_plain(self.defs[name])
        cls = self.classes[name]
        self.attach(cls, out)
        return out

    def convert_union(self, options: list[dict[str, Any]]) -> dict[str, Any]:
        options = [o for o in options if o.get("type") != "null"]
        kinds = sorted(o.get("type", "") for o in options)
        if kinds == ["integer", "string"]:
            return {"x-kubernetes-int-or-string": True}
        if len(options) != 1:
            raise ValueError(f"cannot express union {options} in a structural schema")
        return self.convert(options[0])

    def convert_plain(self, node: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {k: v for k, v in node.items() if k not in _DROPPED_KEYS}
        if "const" in node:
            out["enum"] = [node["const"]]
        for bound in ("exclusiveMinimum", "exclusiveMaximum"):
            if bound in node and not isinstance(node[bound], bool):
                out["minimum" if bound == "exclusiveMinimum" else "maximum"] = node[bound]
                out[bound] = True
        kind = node.get("type")
        if kind == "object" or (not kind and "properties" in node):
            out["type"] = "object"
            if "properties" in node:
                out["properties"] = {k: self.convert(v) for k, v in node["properties"].items()}
            extra = node.get("additionalProperties")
            if isinstance(extra, dict) and extra:
                out["additionalProperties"] = self.convert(extra)
            elif "properties" not in node or extra is True:
                out["x-kubernetes-preserve-unknown-fields"] = True
        elif kind == "array":
            out["items"] = self.convert(node.get("items", {}))
        elif not kind and "enum" not in node and "const" not in node:
            out["x-kubernetes-preserve-unknown-fields"] = True  # Any
        return out

    def attach(self, cls: type[BaseModel], schema: dict[str, Any]) -> None:
        """Add the model's defaults and CEL rules to its converted schema."""
        properties = schema.get("properties", {})
        if self.with_defaults:
            for name, field in cls.model_fields.items():
                key = field.alias or name
                has_default, value = field_default(field)
                if has_default and key in properties:
                    properties[key]["default"] = value
        rules = getattr(cls, "cel_rules", ())
        if rules:
            schema["x-kubernetes-validations"] = [
                {
                    "rule": r.cel,
                    "message": r.message,
                    "fieldPath": f".{r.field}",
                    "reason": "FieldValueInvalid",
                }
                for r in rules
            ]


def _root_schema(model: type[BaseModel], with_defaults: bool) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = dict(raw.get("$defs", {}))
    defs[model.__name__] = {k: v for k, v in raw.items() if k != "$defs"}
    converter = _Converter(defs, model_classes(model), with_defaults)
    return converter.convert_ref(f"#/$defs/{model.__name__}")


def openapi_schema() -> dict[str, Any]:
    """The structural openAPIV3Schema of the ServingCluster resource."""
    spec = _root_schema(ServingClusterSpec, with_defaults=True)
    status = _root_schema(ServingClusterStatus, with_defaults=False)
    return {
        "type": "object",
        "description": ServingCluster.__doc__,
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status,
        },
        "x-kubernetes-validations": [
            {
                "rule": f"self.metadata.name.size() <= {MAX_NAME_LENGTH}",
                "message": f"name must be at most {MAX_NAME_LENGTH} characters (children append -prefill)",
                "reason": "FieldValueInvalid",
            },
            {
                "rule": f"self.metadata.name.matches('{NAME_PATTERN}')",
                "message": "name must be a DNS-1035 label: lowercase letters, digits and '-', starting with a letter",
                "reason": "FieldValueInvalid",
            },
        ],
    }


def custom_resource_definition() -> dict[str, Any]:
    """The apiextensions.k8s.io/v1 CustomResourceDefinition object."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": CRD_NAME,
            "labels": {"app.kubernetes.io/name": "tandem", "app.kubernetes.io/part-of": "tandem"},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": SHORT_NAMES,
                "categories": ["tandem"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {"openAPIV3Schema": openapi_schema()},
                }
            ],
        },
    }


HEADER = (
    "# Generated by `tandem crd` from tandem/operator/api.py and tandem/common/routing.py"
    " — do not edit by hand.\n"
)


def crd_yaml() -> str:
    """The CRD as the YAML text kept in crds/ (byte-stable, so a drift test can compare it)."""
    return HEADER + yaml.safe_dump(custom_resource_definition(), sort_keys=False, width=100)
