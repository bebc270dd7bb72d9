"""`tandem up` of ServingClusters that join a gateway (`spec.gateway.name`): the gateway process
beside their routers, one per gateway name, over the same local engines."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from tandem.local.plan import LOCALHOST, LocalPlan, ProcessSpec
from tandem.operator.api import ServingCluster
from tandem.router.config import GatewayConfig


def gateway_groups(clusters: Sequence[ServingCluster]) -> dict[str, list[int]]:
    """Gateway name -> the indexes of the clusters joining it, in the order given."""
    groups: dict[str, list[int]] = {}
    for index, sc in enumerate(clusters):
        if sc.spec.gateway is not None:
            groups.setdefault(sc.spec.gateway.name, []).append(index)
    return groups


def gateway_process(
    name: str,
    plans: Sequence[LocalPlan],
    port: int,
    run_dir: Path,
    python: str,
    environ: Mapping[str, str],
) -> tuple[ProcessSpec, GatewayConfig]:
    """The gateway over the routers' own configs (their static engines, keys and tenancy), its
    config written to `run_dir/gateway-NAME.yaml`."""
    config = GatewayConfig(
        host=LOCALHOST,
        port=port,
        log_level=plans[0].router_config.log_level,
        models=[plan.router_config for plan in plans],
    )
    path = run_dir / f"gateway-{name}.yaml"
    path.write_text(config.to_yaml())
    spec = ProcessSpec(
        name=f"gateway-{name}",
        role="router",
        argv=[python, "-m", "tandem.cli", "gateway", "--config", str(path)],
        env=dict(environ),
        port=port,
    )
    return spec, config
