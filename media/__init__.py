"""aotx.media."""
