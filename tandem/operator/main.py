"""`tandem operator`: run the kopf operator against a kubeconfig ($KUBECONFIG) or in-cluster."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import sys
from collections.abc import Sequence

import kopf

from tandem.operator import metrics
from tandem.operator.api import GROUP
from tandem.operator.handlers import register

AUTOSCALING_HANDLERS = "tandem.operator.autoscaling.handlers"
FINALIZER = f"{GROUP}/finalizer"
ANNOTATION_PREFIX = GROUP


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="tandem operator", description="Run the ServingCluster operator."
    )
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "-n", "--namespace", action="append", default=[], metavar="NS",
        help="watch this namespace (repeatable; glob patterns allowed)",
    )  # fmt: skip
    scope.add_argument(
        "-A", "--all-namespaces", action="store_true", help="watch every namespace (the default)"
    )
    parser.add_argument(
        "--peering", metavar="NAME",
        help="coordinate with other operator replicas through this KopfPeering object (default: standalone)",
    )  # fmt: skip
    parser.add_argument("--priority", type=int, default=0, help="peering priority of this replica")
    parser.add_argument(
        "--liveness", metavar="URL", help="serve a liveness probe, e.g. http://0.0.0.0:8080/healthz"
    )
    parser.add_argument(
        "--metrics-port", type=int, metavar="PORT", help="serve Prometheus /metrics on this port"
    )
    parser.add_argument(
        "--metrics-host", default="0.0.0.0", help="address /metrics listens on (default 0.0.0.0)"
    )
    parser.add_argument(
        "--resync-seconds", type=float, default=300.0, help="period of the drift-repair resync"
    )
    parser.add_argument(
        "--watch-timeout", type=int, default=300, help="server-side timeout of each watch request"
    )
    parser.add_argument("--workers", type=int, default=8, help="threads running handlers")
    parser.add_argument("-v", "--verbose", action="store_true", help="log every handler step")
    parser.add_argument("--debug", action="store_true", help="log API traffic too")
    return parser.parse_args(list(argv))


def operator_settings(args: argparse.Namespace) -> kopf.OperatorSettings:
    """Production settings: our own finalizer and annotation prefix, bounded watches, no peering
    unless asked for."""
    settings = kopf.OperatorSettings()
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
        prefix=ANNOTATION_PREFIX
    )
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    settings.watching.server_timeout = args.watch_timeout
    settings.watching.client_timeout = args.watch_timeout + 30
    settings.watching.connect_timeout = 30
    settings.watching.reconnect_backoff = 1.0
    settings.networking.request_timeout = 60
    settings.execution.max_workers = args.workers
    settings.posting.level = logging.INFO
    if args.namespace and not any(set(ns) & set("*?!,") for ns in args.namespace):
        # Exact namespaces only (the chart's namespaced mode): nothing to discover, so kopf must
        # not list every namespace of the cluster, which that install is not allowed to do.
        # CRDs are then read once at start-up instead of watched.
        settings.scanning.disabled = True
    settings.peering.standalone = args.peering is None
    if args.peering:
        settings.peering.name = args.peering
        settings.peering.priority = args.priority
        settings.peering.mandatory = True
    return settings


def load_autoscaling(registry: kopf.OperatorRegistry) -> bool:
    """Import the autoscaler's handlers when that package is present (it registers a kopf timer)."""
    if importlib.util.find_spec(AUTOSCALING_HANDLERS) is None:
        return False
    module = importlib.import_module(AUTOSCALING_HANDLERS)
    register_autoscaling = getattr(module, "register", None)
    if callable(register_autoscaling):
        register_autoscaling(registry)
    return True


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    kopf.configure(verbose=args.verbose, debug=args.debug)
    registry = kopf.get_default_registry()
    register(registry, resync_seconds=args.resync_seconds, namespaces=args.namespace)
    if load_autoscaling(registry):
        logging.getLogger("tandem.operator").info("autoscaling handlers loaded")
    if args.metrics_port is not None:
        metrics.serve(args.metrics_port, args.metrics_host)
    try:
        run(args, registry)
    except kopf.LoginError as exc:
        print(
            f"tandem operator: cannot log in to Kubernetes ({exc}); set KUBECONFIG or run in a pod",
            file=sys.stderr,
        )
        return 1
    return 0


def run(args: argparse.Namespace, registry: kopf.OperatorRegistry) -> None:
    kopf.run(
        registry=registry,
        settings=operator_settings(args),
        standalone=args.peering is None,
        peering_name=args.peering,
        priority=args.priority,
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=args.liveness,
    )
