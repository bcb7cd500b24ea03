"""Metrics and traces of the gateway."""
