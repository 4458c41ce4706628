"""kvcellar: an MLX inference server whose KV caches stay warm across RAM and SSD."""

__version__ = "0.1.0"
