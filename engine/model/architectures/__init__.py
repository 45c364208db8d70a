"""aotx.engine.model.architectures."""
