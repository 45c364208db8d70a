"""Test doubles shared by the test files: the scripted engine for UI tests
(``fake_engine``) and the event sink that records what an Engine sends (``sink``)."""
