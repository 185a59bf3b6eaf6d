"""Benchmarks for bulkinfer (not part of the test suite)."""
