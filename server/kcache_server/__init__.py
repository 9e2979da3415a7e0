"""kcache server (placeholder until the server issue lands)."""
