"""aotx.engine.journal."""
