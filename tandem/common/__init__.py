"""Notions every component shares, and nothing else; this package imports no component.

`roles`: prefill and decode, and the pod labels that carry them. `block_hash`: vLLM's prefix-cache
block hashes. `metrics`: lock-free histograms and counters. `routing`: the router's policy
settings, which a ServingCluster's `spec.router` carries as they are. `settings`: the base of
every model users write settings in. `ports`: a free local port.
"""
