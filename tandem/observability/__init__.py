"""Tandem's dashboards and Prometheus rules as code.

This package knows metric names only (`names`): it imports no other component, so the router,
the engines and the operator can change freely as long as their public metric names stay.
`python -m tandem.observability` writes the generated Grafana dashboards and the rule file into
the Helm chart; the tests check the committed copies for drift and run every query against a
real Prometheus.
"""
