"""`tandem gateway`: one endpoint for several models' pools, from a gateway config file."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from pydantic import ValidationError

from tandem.router.config import GatewayConfig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem gateway", description=__doc__)
    p.add_argument("--config", required=True, help="GatewayConfig YAML (what the operator renders)")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--log-level")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = GatewayConfig.from_yaml_file(args.config)
        overrides = {"host": args.host, "port": args.port, "log_level": args.log_level}
        config = GatewayConfig.model_validate(
            {**config.model_dump(), **{k: v for k, v in overrides.items() if v is not None}}
        )
    except (OSError, ValidationError) as exc:
        print(f"tandem gateway: invalid configuration:\n{exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from tandem.router.gateway import serve

    try:
        import uvloop
    except ImportError:
        return asyncio.run(serve(config))
    return uvloop.run(serve(config))
