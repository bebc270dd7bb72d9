"""The roles an engine plays in disaggregated serving, and the pod labels that carry them.

The operator labels every engine pod with its cluster and role; the router's Kubernetes discovery
selects pods by the same labels.
"""

from __future__ import annotations

from typing import Literal

Role = Literal["prefill", "decode"]
ROLES: tuple[Role, ...] = ("prefill", "decode")

LABEL_CLUSTER = "tandem.dev/cluster"
LABEL_ROLE = "tandem.dev/role"
