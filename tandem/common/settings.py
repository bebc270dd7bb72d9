"""The pydantic base of every model a user writes settings in (the ServingCluster, the router's
policy): unknown keys refused, fields by alias or name, field docstrings as descriptions."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class SettingsModel(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        populate_by_name=True,
        use_attribute_docstrings=True,
        validate_default=True,
    )
