"""Benchmarks: scripts that measure side by side in one process and write docs/benchmarks.md."""
