"""aotx.themes."""
