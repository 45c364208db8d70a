"""aotx.app.screens."""
