"""Engine discovery: a static list (local use) or a Kubernetes Pod watch, both feeding the EnginePool."""
