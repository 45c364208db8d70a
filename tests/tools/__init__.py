"""Developer tooling that ships with the repository but not in the installed package:
peers' benchmarks (llama.cpp), one-off measurements and device-machine scripts.
Run each from the repository root as ``python -m tests.tools.NAME`` (the llama.cpp
peers with the peer's Python, by path). Benchmarks for users stay behind ``aotx bench``."""
