"""OpenAI's response shapes for the gateway: pure functions of a finished or streaming reply.

Owns: ``Choice`` and ``Reply`` (what one generation produced, every choice) and the
objects built from them exactly as the OpenAI API shapes them: ``chat.completion``,
``chat.completion.chunk``, ``text_completion`` (whole and streamed, with log
probabilities), the usage chunk, error bodies and the receipt as JSON. Leaves request
parsing to ``schema.py``, HTTP and the engine to ``server.py``.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from aotx.engine import protocol as P

FINISH = {"stop": "stop", "length": "length", "context": "length", "cancelled": "stop", "tool_calls": "tool_calls"}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def logprob_entry(token: bytes, logprob: float, top: list[tuple[int, float, bytes]] | None = None,
                  chat: bool = True) -> dict[str, Any]:
    """One token's ``logprobs.content`` entry (chat): token text, logprob, bytes, top."""
    e = {"token": token.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(token)}
    if top is not None:
        e["top_logprobs"] = [{"token": b.decode("utf-8", "replace"), "logprob": v, "bytes": list(b)}
                             for _, v, b in top]
    return e


@dataclass
class Choice:
    """One choice of a reply: its text, finish, tool calls (OpenAI dicts) and, when
    asked, its tokens' log probabilities (chat ``logprobs.content`` entries)."""

    index: int = 0
    text: str = ""
    finish_reason: str = "stop"
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    logprobs: list[dict[str, Any]] | None = None
    n_completion: int = 0
    aotx: dict[str, Any] = field(default_factory=dict)
    stop_sequence: str = ""  # the stop string that ended it (the engine's Committed.stop)

    @property
    def finish(self) -> str:
        if self.tool_calls and self.finish_reason == "stop":
            return "tool_calls"
        return FINISH.get(self.finish_reason, "stop")


@dataclass
class Reply:
    """What one generation produced (every choice), for the response builders."""

    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))
    choices: list[Choice] = field(default_factory=lambda: [Choice()])
    n_prompt: int = 0
    n_cached: int = 0
    aotx: dict[str, Any] = field(default_factory=dict)

    # one-choice shortcuts (the first choice)
    @property
    def text(self) -> str:
        return self.choices[0].text

    @text.setter
    def text(self, v: str) -> None:
        self.choices[0].text = v

    @property
    def finish_reason(self) -> str:
        return self.choices[0].finish_reason

    @finish_reason.setter
    def finish_reason(self, v: str) -> None:
        self.choices[0].finish_reason = v

    @property
    def n_completion(self) -> int:
        return sum(c.n_completion for c in self.choices)

    def usage(self) -> dict[str, Any]:
        u: dict[str, Any] = {"prompt_tokens": self.n_prompt, "completion_tokens": self.n_completion,
                             "total_tokens": self.n_prompt + self.n_completion}
        if self.n_cached:
            u["prompt_tokens_details"] = {"cached_tokens": self.n_cached}
        return u


def _chat_message(c: Choice) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": c.text if (c.text or not c.tool_calls) else None,
                           "refusal": None}
    if c.tool_calls:
        msg["tool_calls"] = c.tool_calls
    return msg


def chat_completion(r: Reply) -> dict[str, Any]:
    return {"id": r.id, "object": "chat.completion", "created": r.created, "model": r.model,
            "system_fingerprint": None,
            "choices": [{"index": c.index, "message": _chat_message(c),
                         "logprobs": {"content": c.logprobs, "refusal": None} if c.logprobs is not None else None,
                         "finish_reason": c.finish, **({"aotx": c.aotx} if len(r.choices) > 1 else {})}
                        for c in r.choices],
            "usage": r.usage(), "aotx": r.aotx}


def chat_chunk(r: Reply, delta: dict[str, Any], finish: str | None = None, index: int = 0,
               logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"id": r.id, "object": "chat.completion.chunk", "created": r.created, "model": r.model,
            "system_fingerprint": None,
            "choices": [{"index": index, "delta": delta,
                         "logprobs": {"content": logprobs, "refusal": None} if logprobs is not None else None,
                         "finish_reason": (finish if finish == "tool_calls" else FINISH.get(finish, "stop"))
                         if finish else None}]}


def _text_logprobs(entries: list[dict[str, Any]] | None, offset0: int = 0) -> dict[str, Any] | None:
    """The legacy completions ``logprobs`` object from chat-style entries."""
    if entries is None:
        return None
    offsets, at = [], offset0
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e.get("top_logprobs", [])} for e in entries],
            "text_offset": offsets}


def text_completion(r: Reply) -> dict[str, Any]:
    return {"id": r.id, "object": "text_completion", "created": r.created, "model": r.model,
            "system_fingerprint": None,
            "choices": [{"index": c.index, "text": c.text, "logprobs": _text_logprobs(c.logprobs),
                         "finish_reason": FINISH.get(c.finish_reason, "stop"),
                         **({"aotx": c.aotx} if len(r.choices) > 1 else {})} for c in r.choices],
            "usage": r.usage(), "aotx": r.aotx}


def text_chunk(r: Reply, text: str, finish: str | None = None, index: int = 0,
               logprobs: list[dict[str, Any]] | None = None, offset0: int = 0) -> dict[str, Any]:
    """One streamed completions chunk; ``offset0``: where its first logprob token starts in
    the choice's whole text (text_offset counts from the start of the completion)."""
    return {"id": r.id, "object": "text_completion", "created": r.created, "model": r.model,
            "system_fingerprint": None,
            "choices": [{"index": index, "text": text, "logprobs": _text_logprobs(logprobs, offset0),
                         "finish_reason": FINISH.get(finish, "stop") if finish else None}]}


def usage_chunk(r: Reply, chat: bool) -> dict[str, Any]:
    return {"id": r.id, "object": "chat.completion.chunk" if chat else "text_completion", "created": r.created,
            "model": r.model, "system_fingerprint": None, "choices": [], "usage": r.usage()}


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None,
               **extra: Any) -> dict[str, Any]:
    err = {"message": message, "type": type_, "param": param, "code": code}
    err.update(extra)
    return {"error": err}


def receipt_dict(rc: P.Receipt | None) -> dict[str, int] | None:
    if rc is None:
        return None
    return {"segment": rc.segment, "offset": rc.offset, "last_seq": rc.last_seq}
