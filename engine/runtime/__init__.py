"""aotx.engine.runtime."""
