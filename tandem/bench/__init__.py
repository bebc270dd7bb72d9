"""The load generator and report: fixed-QPS, burst, mixed and shared-prefix workloads."""
