"""aotx.engine.model."""
