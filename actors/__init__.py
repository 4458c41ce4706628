"""Trio actors (design §3)."""
