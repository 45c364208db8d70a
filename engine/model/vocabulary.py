"""Whether two GGUF models share one vocabulary (a draft model must share its target's).

Reads only metadata, so clients can refuse a mismatched ``--draft-model`` before they
start an engine; the engine's ``DraftModel`` checks the loaded tokenizers the same way.
"""

from __future__ import annotations

from pathlib import Path

from aotx.engine.errors import ModelError


def vocabulary_mismatch(target_tokens, draft_tokens) -> str:
    """Why two vocabularies differ ("" when identical): sizes, or the first id whose
    token text differs. Arguments: sequences of token texts indexed by id."""
    if len(target_tokens) != len(draft_tokens):
        return f"its vocabulary has {len(draft_tokens)} tokens, the model's has {len(target_tokens)}"
    for i, (a, b) in enumerate(zip(target_tokens, draft_tokens)):
        if a != b:
            return f"token {i} is {b!r} in the draft model but {a!r} in the model"
    return ""


def check_vocabulary_files(target: str | Path | None, draft: str | Path) -> None:
    """Refuse a draft model whose vocabulary differs from the target's, reading only the
    two files' GGUF metadata (clients call this before they start an engine).

    Raises ModelError, one line naming the draft file and the first difference."""
    from aotx.engine.model.gguf_file import GGUFFile
    from aotx.engine.model.loader import resolve_model_path

    tp, dp = resolve_model_path(target), resolve_model_path(draft)
    t_meta, d_meta = GGUFFile.open(tp).metadata, GGUFFile.open(dp).metadata
    why = vocabulary_mismatch(t_meta.get("tokenizer.ggml.tokens", []), d_meta.get("tokenizer.ggml.tokens", []))
    if why:
        raise ModelError(f"--draft-model {dp}: {why}; a draft model must share the model's vocabulary")
