"""Build and maintenance helpers (not installed; run from a source checkout)."""
