"""kcache client (placeholder until the client issue lands)."""
