"""Deterministic crash/replay simulations (design §5)."""
