"""Tandem as the endpoint picker (EPP) of a Gateway API inference gateway, and its P/D relay."""
