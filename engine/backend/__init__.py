"""aotx.engine.backend."""
