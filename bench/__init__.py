"""Benchmarks: measured here, never in timed tests (see README)."""
