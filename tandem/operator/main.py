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
from tandem.operator.common_render import LABEL_MANAGED_BY, MANAGED_BY
from tandem.operator.handlers import kube as operator_kube
from tandem.operator.handlers import register
from tandem.operator.kube import KubeError
from tandem.operator.peering import (
    DEFAULT_LIFETIME_S,
    Leadership,
    ensure_peering_objects,
    peering_paths,
    replica_identity,
    replica_priority,
)
from tandem.operator.resync import DEFAULT_RESYNC_CONCURRENCY

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
    parser.add_argument(
        "--priority", type=int, default=None,
        help="peering priority of this replica (default: random, so replicas never tie)",
    )  # fmt: skip
    parser.add_argument(
        "--peering-lifetime", type=int, default=DEFAULT_LIFETIME_S, metavar="SECONDS",
        help="how long a silent replica counts as alive: a standby takes over within this",
    )  # fmt: skip
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
        "--resync-concurrency", type=int, default=DEFAULT_RESYNC_CONCURRENCY, metavar="N",
        help="ServingClusters one resync pass reconciles at once",
    )  # fmt: skip
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
    # kopf's own handler log lines (~5 INFO lines per reconcile) are not posted as Events: each
    # is an apiserver request, and our handlers post the Events that matter. kopf's warnings and
    # errors (a handler that failed) still are.
    settings.posting.level = logging.WARNING
    # Only the operator's own children reach it: the apiserver filters the Deployment watch by
    # label, so on a shared cluster other tenants' Deployments are never sent (kopf's `labels=`
    # on a handler only filters client-side, after the whole stream has arrived).
    settings.watching.label_selectors["apps", "deployments"] = f"{LABEL_MANAGED_BY}={MANAGED_BY}"
    if args.namespace and not any(set(ns) & set("*?!,") for ns in args.namespace):
        # Exact namespaces only (the chart's namespaced mode): nothing to discover, so kopf must
        # not list every namespace of the cluster, which that install is not allowed to do.
        # CRDs are then read once at start-up instead of watched.
        settings.scanning.disabled = True
    settings.peering.standalone = args.peering is None
    if args.peering:
        settings.peering.name = args.peering
        settings.peering.priority = args.priority
        settings.peering.lifetime = args.peering_lifetime
        settings.peering.mandatory = True
    return settings


def load_autoscaling(registry: kopf.OperatorRegistry, leadership: Leadership | None = None) -> bool:
    """Import the autoscaler's handlers when that package is present; its loops scale only while
    `leadership` says this replica is the active peer."""
    if importlib.util.find_spec(AUTOSCALING_HANDLERS) is None:
        return False
    module = importlib.import_module(AUTOSCALING_HANDLERS)
    register_autoscaling = getattr(module, "register", None)
    if callable(register_autoscaling):
        leader = leadership or Leadership("standalone", 0)
        register_autoscaling(registry, leading=lambda: leader.active)
    return True


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    args.priority = replica_priority(args.priority) if args.peering else 0
    args.identity = replica_identity()
    kopf.configure(verbose=args.verbose, debug=args.debug)
    registry = kopf.get_default_registry()
    leadership = Leadership(
        args.identity,
        args.priority,
        peering_paths(args.peering, args.namespace) if args.peering else (),
    )
    register(
        registry,
        resync_seconds=args.resync_seconds,
        resync_concurrency=args.resync_concurrency,
        namespaces=args.namespace,
        leadership=leadership,
    )
    if load_autoscaling(registry, leadership):
        logging.getLogger("tandem.operator").info("autoscaling handlers loaded")
    if args.metrics_port is not None:
        metrics.serve(args.metrics_port, args.metrics_host)
    if args.peering:
        try:
            ensure_peering_objects(operator_kube(), args.peering, args.namespace)
        except KubeError as exc:
            print(f"tandem operator: cannot create the peering objects: {exc}", file=sys.stderr)
            return 1
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
        identity=args.identity,
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=args.liveness,
    )
