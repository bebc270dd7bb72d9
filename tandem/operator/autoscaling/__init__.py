"""Per-pool autoscaling from Prometheus: signals, pure decisions, PromQL, the kopf timer, KEDA/HPA renderers."""
