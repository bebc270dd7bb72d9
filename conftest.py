"""Plugins for every suite of the repository (tests/ and e2e/)."""

pytest_plugins = ["tests.repository_reads"]
