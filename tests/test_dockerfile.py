"""The Dockerfile's shape and its entrypoints, checked without a container engine."""

from __future__ import annotations

import fnmatch
import importlib
import json
import re
import tomllib
from pathlib import Path

import pytest
import yaml

from tandem import __version__
from tandem.cli import SUBCOMMANDS
from tandem.operator.api_router import DEFAULT_ROUTER_IMAGE

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, heredoc bodies skipped."""
    out: list[tuple[str, str]] = []
    lines = DOCKERFILE.read_text().splitlines()
    index = 0
    while index < len(lines):
        line = lines[index].strip()
        index += 1
        if not line or line.startswith("#"):
            continue
        while line.endswith("\\") and index < len(lines):
            line = line[:-1] + " " + lines[index].strip()
            index += 1
        heredoc = re.search(r"<<-?'?(\w+)'?", line)
        if heredoc:
            while index < len(lines) and lines[index].strip() != heredoc.group(1):
                index += 1
            index += 1
        keyword, _, arguments = line.partition(" ")
        out.append((keyword.upper(), arguments.strip()))
    return out


def final_stage() -> list[tuple[str, str]]:
    steps = instructions()
    last_from = max(i for i, (keyword, _) in enumerate(steps) if keyword == "FROM")
    return steps[last_from:]


def exec_form(keyword: str) -> list[str]:
    [arguments] = [args for kw, args in final_stage() if kw == keyword]
    value = json.loads(arguments)
    assert isinstance(value, list), f"{keyword} must use the exec (JSON) form"
    return value


def test_multi_stage_build_copies_only_the_environment() -> None:
    steps = instructions()
    assert sum(1 for keyword, _ in steps if keyword == "FROM") >= 2
    copies = [args for keyword, args in final_stage() if keyword == "COPY"]
    assert copies, "the runtime stage copies the built environment"
    assert all(args.startswith("--from=build") for args in copies), copies
    base = dict(steps)["ARG"]
    assert "slim" in base, "the runtime image is a slim base"


def test_runs_as_a_numeric_non_root_user() -> None:
    [user] = [args for keyword, args in final_stage() if keyword == "USER"]
    uid = user.split(":")[0]
    assert uid.isdigit(), user
    assert int(uid) != 0, user
    chart_values = (ROOT / "charts/tandem/values.yaml").read_text()
    assert f"runAsUser: {uid}" in chart_values, "the chart's securityContext matches the image user"


def test_entrypoint_is_the_package_console_script() -> None:
    assert exec_form("ENTRYPOINT") == ["tandem"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module_name, function_name = scripts["tandem"].split(":")
    assert callable(getattr(importlib.import_module(module_name), function_name))


@pytest.mark.parametrize("command", ["operator", "router"])
def test_image_commands_resolve_to_package_entry_functions(command: str) -> None:
    """The chart runs `tandem operator`, the operator renders `tandem router`: both must exist."""
    module_name, function_name, _ = SUBCOMMANDS[command]
    module = importlib.import_module(module_name)
    assert callable(getattr(module, function_name)), f"{module_name}:{function_name}"


def test_default_command_is_a_known_subcommand() -> None:
    command = exec_form("CMD")
    assert command[0] in SUBCOMMANDS, command


def _ignored(path: str, patterns: list[str]) -> bool:
    return any(
        fnmatch.fnmatch(path, pattern) or fnmatch.fnmatch(path.split("/")[0], pattern)
        for pattern in patterns
    )


def test_build_context_holds_everything_the_package_needs() -> None:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert ".venv" in patterns
    assert ".git" in patterns
    sources = []
    for keyword, args in instructions():
        if keyword == "COPY" and not args.startswith("--from"):
            sources += args.split()[:-1]
    for source in sources:
        assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
        assert not _ignored(source, patterns), f"COPY {source}: excluded by .dockerignore"
    # Every linked component folder of the import package is copied beside it.
    for link in (ROOT / "tandem").iterdir():
        if link.is_symlink():
            target = link.resolve().relative_to(ROOT)
            assert str(target) in sources, f"tandem/{link.name} -> {target} is not copied"


def test_operator_and_routers_run_this_one_image() -> None:
    """The chart's operator image and the router image the operator renders are the same."""
    chart = yaml.safe_load((ROOT / "charts/tandem/Chart.yaml").read_text())
    values = yaml.safe_load((ROOT / "charts/tandem/values.yaml").read_text())
    assert chart["appVersion"] == __version__
    image = f"{values['image']['repository']}:{values['image']['tag'] or chart['appVersion']}"
    assert image == DEFAULT_ROUTER_IMAGE
