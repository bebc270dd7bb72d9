"""`tandem render FILE` and `tandem crd`: print a manifest's Kubernetes objects, or the CRD."""

from __future__ import annotations

import argparse
import json
import secrets
import sys
from typing import Any

import yaml

from tandem.operator.apidoc import api_reference_markdown
from tandem.operator.crd import crd_yaml, custom_resource_definition
from tandem.operator.manifest import ManifestError, load_manifest
from tandem.operator.render import render
from tandem.operator.security_render import engine_key_secret


def _dump(objects: list[dict[str, Any]], output: str) -> str:
    if output == "json":
        listing = {"apiVersion": "v1", "kind": "List", "items": objects}
        return json.dumps(listing, indent=2) + "\n"
    return yaml.safe_dump_all(objects, sort_keys=False, width=120)


def render_main(argv: list[str]) -> int:
    """tandem render FILE [-o yaml|json]: the objects the operator would apply for FILE."""
    parser = argparse.ArgumentParser(
        prog="tandem render",
        description="Print the Kubernetes objects the operator creates for a ServingCluster manifest.",
    )
    parser.add_argument("file", help="ServingCluster manifest (YAML)")
    parser.add_argument("-o", "--output", choices=["yaml", "json"], default="yaml")
    parser.add_argument(
        "-n", "--namespace", help="namespace to render into when the manifest names none"
    )
    args = parser.parse_args(argv)
    try:
        sc = load_manifest(args.file)
    except ManifestError as exc:
        print(f"tandem render: {args.file} is not a valid ServingCluster:", file=sys.stderr)
        for problem in exc.problems:
            print(f"  {problem}", file=sys.stderr)
        return 1
    if args.namespace and "namespace" not in sc.metadata.model_fields_set:
        sc.metadata.namespace = args.namespace
    objects = render(sc)
    if sc.spec.router.auth.engine_key:
        # The operator generates this once per object; a printed manifest gets a fresh key.
        objects.insert(0, engine_key_secret(sc, secrets.token_urlsafe(32)))
    sys.stdout.write(_dump(objects, args.output))
    return 0


def crd_main(argv: list[str]) -> int:
    """tandem crd [-o yaml|json]: the ServingCluster CustomResourceDefinition."""
    parser = argparse.ArgumentParser(
        prog="tandem crd", description="Print the ServingCluster CustomResourceDefinition."
    )
    parser.add_argument("-o", "--output", choices=["yaml", "json"], default="yaml")
    parser.add_argument(
        "--docs", action="store_true", help="print the API reference (Markdown) instead"
    )
    args = parser.parse_args(argv)
    if args.docs:
        sys.stdout.write(api_reference_markdown())
    elif args.output == "json":
        sys.stdout.write(json.dumps(custom_resource_definition(), indent=2) + "\n")
    else:
        sys.stdout.write(crd_yaml())
    return 0
