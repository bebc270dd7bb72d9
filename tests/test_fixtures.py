"""The real-vLLM fixtures are all there and unchanged: each capture in tests/fixtures/vllm-0.32 is
listed in its SHA256SUMS with the digest it was captured with, and every listed file exists."""

from __future__ import annotations

import hashlib

from tandem_process import GOLDEN

SUMS = GOLDEN / "SHA256SUMS"
UNLISTED = {"SHA256SUMS", "README.md"}


def listed() -> dict[str, str]:
    entries = (line.split(maxsplit=1) for line in SUMS.read_text().splitlines() if line.strip())
    return {name.strip(): digest for digest, name in entries}


def test_every_listed_fixture_is_present_and_unchanged() -> None:
    sums = listed()
    missing = [str(GOLDEN / name) for name in sums if not (GOLDEN / name).is_file()]
    changed = [
        str(GOLDEN / name)
        for name, digest in sums.items()
        if (GOLDEN / name).is_file()
        and hashlib.sha256((GOLDEN / name).read_bytes()).hexdigest() != digest
    ]
    assert missing == [], f"fixtures missing: {missing}"
    assert changed == [], f"fixtures changed since their capture: {changed}"


def test_every_fixture_file_is_listed() -> None:
    present = {str(p.relative_to(GOLDEN)) for p in GOLDEN.rglob("*") if p.is_file()}
    assert present - set(listed()) - UNLISTED == set()
