"""Prediction for the `predictive` placement policy: per-engine cost models learned online, output
lengths, SLO targets and the placement rule that uses them (docs/router.md, "Predictive
placement"). Every module but `predictor.py` is pure arithmetic over its inputs."""
