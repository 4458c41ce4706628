"""Benchmarks that measure kvcellar against a baseline in the same run."""
