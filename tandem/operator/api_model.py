"""The base of the ServingCluster API models: cross-field rules, quantities and name limits."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import model_validator
from pydantic_core import PydanticCustomError

from tandem.common.settings import SettingsModel

# Children are named "<name>-prefill" etc.; Service names are DNS-1035 labels of at most 63
# characters, so the object's own name leaves room for the longest suffix.
MAX_NAME_LENGTH = 52
NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"

Quantity = int | str
"""A Kubernetes resource quantity: an integer or a string such as "500m" or "16Gi"."""


@dataclass(frozen=True)
class CrossFieldRule:
    """A rule over several fields, enforced by pydantic here and by CEL in the CRD at admission.

    `cel` is evaluated with `self` bound to the object the rule sits on; `check` is the same
    predicate in Python; `field` names the field the message is about, relative to that object.
    """

    cel: str
    message: str
    field: str
    check: Callable[[Any], bool]


class SpecModel(SettingsModel):
    cel_rules: ClassVar[tuple[CrossFieldRule, ...]] = ()

    @model_validator(mode="after")
    def _cross_field_rules(self) -> Any:
        for rule in self.cel_rules:
            if not rule.check(self):
                raise PydanticCustomError(
                    "cross_field", "{message}", {"message": rule.message, "field": rule.field}
                )
        return self
