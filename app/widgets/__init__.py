"""aotx.app.widgets."""
