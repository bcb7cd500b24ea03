"""Benchmarks: each prints its numbers (docs/benchmarks.md)."""
