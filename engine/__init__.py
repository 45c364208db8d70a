"""aotx.engine."""
