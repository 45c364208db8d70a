"""aotx.assets."""
