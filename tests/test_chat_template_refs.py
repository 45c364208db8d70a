"""Chat templates of the issue-14 model families against llama-cpp-python's renderings.

``tests/data/refs/templates/rendered.json`` holds Qwen2.5's (with and without tools, a
tool-call round), Phi-3.5-mini's, Gemma 3 instruct's (system folded into the first user turn)
and Llama 3.2 Instruct's templates, each rendered by llama-cpp-python 0.3.36 on a set of
message lists (see the README beside it for the sources). The real files' templates go
through the loader's path (``ChatTemplate.from_metadata``); Gemma 3 270M, which has none,
gets the documented Gemma fallback.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from aotx.engine.errors import TemplateError
from aotx.engine.model.chat_template import CHATML_TEMPLATE, GEMMA_TEMPLATE, ChatTemplate, encode_chat
from aotx.engine.model.gguf_file import GGUFFile

REFS = Path(__file__).resolve().parent / "data" / "refs"
RENDERED = json.loads((REFS / "templates" / "rendered.json").read_text(encoding="utf-8"))["templates"]
CASES = [(t, c) for t, e in RENDERED.items() for c in e["cases"]]


def _render(tmpl: ChatTemplate, template: str, case: str) -> str:
    e = RENDERED[template]
    c = e["cases"][case]
    return tmpl.render(c["messages"], add_generation_prompt=c["add_generation_prompt"], bos_token=e["bos_token"],
                       eos_token=e["eos_token"], **c["extra"])


@pytest.mark.parametrize("template,case", CASES)
def test_rendering_equals_llama_cpp_python(template, case):
    ref = RENDERED[template]["cases"][case]
    tmpl = ChatTemplate(RENDERED[template]["source"])
    if "error" in ref:
        with pytest.raises(TemplateError, match="alternate"):
            _render(tmpl, template, case)
    else:
        assert _render(tmpl, template, case) == ref["rendered"]


def test_qwen_tools_are_rendered_in_the_system_turn():
    text = RENDERED["qwen2.5"]["cases"]["tools"]["rendered"]
    assert text.startswith("<|im_start|>system\nYou are Qwen")
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert RENDERED["qwen2.5"]["cases"]["tool_round"]["rendered"].count("<tool_response>") == 1


def test_the_real_qwen_file_renders_through_its_own_template(gguf_vocab):
    meta, _ = gguf_vocab("qwen2")
    tmpl = ChatTemplate.from_metadata(meta)
    assert not tmpl.is_fallback and tmpl.source == RENDERED["qwen2.5"]["source"]
    for case, ref in RENDERED["qwen2.5"]["cases"].items():
        assert _render(tmpl, "qwen2.5", case) == ref["rendered"], case


def test_qwen_chat_reference_prompts_encode_like_llama_cpp(gguf_vocab):
    """Every chat reference prompt of the real Qwen file (tools included) encodes to
    llama.cpp's ids through ``encode_chat``."""
    meta, tok = gguf_vocab("qwen2")
    tmpl = ChatTemplate.from_metadata(meta)
    refs = json.loads((REFS / "qwen2" / "chat_refs.json").read_text(encoding="utf-8"))["results"]
    assert any(r.get("tools") for r in refs)
    for r in refs:
        extra = {"tools": r["tools"]} if r.get("tools") else {}
        assert encode_chat(tok, tmpl, r["messages"], **extra) == r["prompt_token_ids"], r["name"]


def test_a_phi3_file_carries_phi3_template(tiny_models, tiny_tokenizer, tmp_path):
    src = (REFS / "templates" / "phi-3.5-mini-instruct.jinja").read_text(encoding="utf-8")
    path = tiny_models.phi3.write(tmp_path / "phi3-chat.gguf", tiny_tokenizer, chat_template=src)
    tmpl = ChatTemplate.from_metadata(GGUFFile.open(path).metadata)
    assert tmpl.source == src
    for case, ref in RENDERED["phi-3.5-mini-instruct"]["cases"].items():
        assert _render(tmpl, "phi-3.5-mini-instruct", case) == ref["rendered"], case


def test_gemma_base_file_gets_the_gemma_fallback_once_in_the_log(gguf_vocab, caplog):
    meta, tok = gguf_vocab("gemma3")
    assert "tokenizer.chat_template" not in meta
    with caplog.at_level(logging.WARNING, logger="aotx.model"):
        tmpl = ChatTemplate.from_metadata(meta)
    assert tmpl.is_fallback and tmpl.fallback == "gemma" and tmpl.source == GEMMA_TEMPLATE
    assert [r.getMessage() for r in caplog.records] == [
        "Gemma 3 270m has no tokenizer.chat_template; using the gemma fallback template"]
    for case, ref in RENDERED["gemma-3-it"]["cases"].items():
        if "rendered" in ref:
            assert _render(tmpl, "gemma-3-it", case) == ref["rendered"], case
    msgs = RENDERED["gemma-3-it"]["cases"]["system_user"]["messages"]
    ids = encode_chat(tok, tmpl, msgs)
    start, end = (tok.encode(t, parse_special=True)[0] for t in ("<start_of_turn>", "<end_of_turn>"))
    assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1  # the template's <bos>, not a second one
    assert ids.count(start) == 2 and ids.count(end) == 1
    assert tok.decode(ids, skip_special=True) == "user\nYou are a terse assistant.\n\nWhat is the capital of France?\nmodel\n"


def test_files_without_a_template_and_without_gemma_tokens_get_chatml():
    tmpl = ChatTemplate.from_metadata({"tokenizer.ggml.tokens": ["a", "<|im_start|>"]})
    assert tmpl.fallback == "chatml" and tmpl.source == CHATML_TEMPLATE


def test_llama3_instruct_prompt_has_one_bos(gguf_vocab):
    meta, tok = gguf_vocab("llama3_vocab")
    tmpl = ChatTemplate.from_metadata(meta)
    ref = RENDERED["llama-3.2-instruct"]["cases"]["system_user"]
    ids = encode_chat(tok, tmpl, ref["messages"], **ref["extra"])
    assert ids == tok.encode(ref["rendered"], parse_special=True)
    assert ids[0] == 128000 and ids.count(128000) == 1
    assert ids.count(128009) == 2  # <|eot_id|> after the system and the user turn


@pytest.mark.parametrize("template", sorted(RENDERED) + ["chatml", "gemma-fallback"])
def test_a_final_assistant_prefill_is_left_open_for_the_reply_to_continue(template, default_model_path):
    """Anthropic's prefill (``encode_chat(continue_final=True)``): the prompt is the
    conversation up to the generation prompt plus the prefill's text, with none of the
    end-of-turn markup the template writes after a finished assistant turn, for every
    family's template. A template that drops the text is refused, not continued wrongly."""
    from aotx.engine.model.tokenizer import Tokenizer

    tok = Tokenizer.from_metadata(GGUFFile.open(default_model_path).metadata)
    src = {"chatml": CHATML_TEMPLATE, "gemma-fallback": GEMMA_TEMPLATE}.get(template) \
        or RENDERED.get(template, {}).get("source")
    t = ChatTemplate(src)
    msgs = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "  The color is"}]
    kw = dict(bos_token=tok.token_to_piece(tok.bos_id) if tok.bos_id is not None else "",
              eos_token=tok.token_to_piece(tok.eos_id))
    ids = encode_chat(tok, t, msgs, continue_final=True)
    want = t.render(msgs[:1], add_generation_prompt=True, **kw)
    assert tok.decode(ids).endswith("The color is")
    assert tok.decode(ids).removesuffix("The color is").rstrip() == want.rstrip(), template
    with pytest.raises(TemplateError, match="does not show"):
        encode_chat(tok, ChatTemplate("{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}{% endif %}"
                                      "{% endfor %}"), msgs, continue_final=True)
