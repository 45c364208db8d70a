"""aotx.app."""
