"""Endpoint scorers: each a pure function of (request features, engine state) -> [0, 1], higher is better.

Composed by `scoring.score_engines` as a weighted sum with weights from `RouterConfig.scoring`,
after the load-bound filter (`load_bound.py`) removes overloaded engines.
"""
