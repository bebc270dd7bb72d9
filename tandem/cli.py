"""The `tandem` command: one entry point that hands each subcommand to the component owning it."""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module, function, one-line help). Modules are imported lazily so that
# `tandem router` never loads the operator's dependencies and vice versa.
SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "up": ("tandem.local.up", "main", "run a ServingCluster on this machine with local processes"),
    "bench": ("tandem.bench.main", "main", "measure an OpenAI-compatible endpoint"),
    "operator": ("tandem.operator.main", "main", "run the Kubernetes operator"),
    "router": ("tandem.router.main", "main", "run the KV-aware prefill/decode router"),
    "gateway": (
        "tandem.router.gateway_main",
        "main",
        "serve several models' pools on one endpoint",
    ),
    "relay": (
        "tandem.router.epp.pd_relay",
        "main",
        "run the P/D relay beside a decode engine (EPP)",
    ),
    "emulate": ("tandem.emulator.main", "main", "run one vLLM-compatible engine emulator"),
    "render": ("tandem.operator.cli", "render_main", "print the Kubernetes objects of a manifest"),
    "crd": ("tandem.operator.cli", "crd_main", "print the ServingCluster CustomResourceDefinition"),
}


def usage() -> str:
    width = max(len(name) for name in SUBCOMMANDS)
    lines = ["usage: tandem COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, _, help_) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in {"-h", "--help", "help"}:
        print(usage())
        return 0
    if args[0] in {"-V", "--version"}:
        from tandem import __version__

        print(__version__)
        return 0
    command, rest = args[0], args[1:]
    if command not in SUBCOMMANDS:
        print(f"tandem: unknown command {command!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module_name, function_name, _ = SUBCOMMANDS[command]
    entry = getattr(importlib.import_module(module_name), function_name)
    result = entry(rest)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
