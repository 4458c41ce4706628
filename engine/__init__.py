"""MLX work: demo models, loading, generation (all on one engine thread)."""
