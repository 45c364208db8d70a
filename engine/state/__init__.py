"""aotx.engine.state."""
