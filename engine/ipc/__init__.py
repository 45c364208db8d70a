"""aotx.engine.ipc."""
