"""The Kubernetes operator: API models → pure renderer → reconciler → status and autoscaling."""
