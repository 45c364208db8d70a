"""The client operations: what each protocol operation does to the engine's tables.

Owns: ``Operations``, one handler per protocol operation (conversations: create, list,
show, rename, update, truncate, fork, delete, switch model; messages: submit, count
tokens, cancel; models: list, load, unload; status) and the dispatch table from
operation type to handler, checked complete against ``protocol.OPERATIONS`` when it is
built. Each handler runs on the engine thread after ``protocol.validate``; it raises an
``AotxError`` to refuse (the engine turns it into the client's ``Error``, and a refused
operation writes nothing) and answers through ``sink.send``.

Leaves to others: the loop, the tick and the request tables (``engine.py``: a handler
reaches them through its ``Engine``), a message's way in (``submit.py``), loading
models (``models.ModelSet``), conversation state (``store.py``).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import Any, Protocol

from aotx.engine import protocol as P
from aotx.engine.errors import Busy, ModelError, NotFound, RequestError, close_matches
from aotx.engine.journal.conversations import Conversation
from aotx.engine.runtime.catalog import Catalog
from aotx.engine.runtime.models import ModelSet, ServedModel
from aotx.engine.runtime.requests import Request, Sink
from aotx.engine.runtime.store import ConversationStore


class EngineTables(Protocol):
    """What the handlers read and change of their engine (``engine.Engine``): the
    conversation store, the models, the catalog, the tick number, whether a budget is
    kept, and the engine's table of accepted requests."""

    store: ConversationStore
    models: ModelSet
    catalog: Catalog
    tick: int
    has_budget: bool

    def requests(self) -> list[Request]: ...
    def preparing(self) -> set[str]: ...
    def is_busy(self, conv_id: str) -> bool: ...
    def enqueue(self, r: Request | None, m: ServedModel | None = None) -> None: ...
    def cancel(self, r: Request) -> None: ...
    def status_reply(self, rid: int) -> P.StatusReply: ...


class Operations:
    """The handlers of one engine's client operations; ``table`` maps each protocol
    operation type to its handler (every one has a handler: checked here)."""

    def __init__(self, engine: EngineTables) -> None:
        self.engine = engine
        self.store, self.models, self.catalog = engine.store, engine.models, engine.catalog   # fixed at start
        self.table: dict[type, Callable[[Any, Sink], None]] = {
            P.CreateConversation: self._create, P.ListConversations: self._list, P.ShowConversation: self._show,
            P.SubmitMessage: self._submit, P.Cancel: self._cancel_op, P.DeleteConversation: self._delete,
            P.RenameConversation: self._rename, P.UpdateConversation: self._update,
            P.TruncateConversation: self._truncate, P.ForkConversation: self._fork, P.Status: self._status,
            P.ListModels: self._list_models, P.LoadModel: self._load_model, P.UnloadModel: self._unload_model,
            P.SwitchModel: self._switch_model, P.CountTokens: self._count_tokens,
            P.Embed: self._embed, P.Tokenize: self._tokenize, P.Detokenize: self._detokenize,
            P.SetContextPolicy: self._set_context,
        }
        self._embedders: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # LocalModel -> Embedder
        assert set(self.table) == set(P.OPERATIONS), "every protocol operation has a handler"

    def _create(self, op: P.CreateConversation, sink: Sink) -> None:
        model = self._model_name(op.model) if op.model else self.models.default_name
        view = self.store.create(op.title, op.system_prompt, op.sampling, tick=self.engine.tick,
                                 messages=[(m.role, m.text, m.meta) for m in op.messages], model=model,
                                 origin=op.origin, context=op.context)
        sink.send(P.ConversationInfo(id=op.id, conversation=view))

    def _list(self, op: P.ListConversations, sink: Sink) -> None:
        sink.send(P.ConversationList(id=op.id, conversations=self.store.list_views(busy=self._busy_convs())))

    def _show(self, op: P.ShowConversation, sink: Sink) -> None:
        sink.send(P.ConversationInfo(id=op.id, conversation=self.store.view(op.conv_id, busy=self._busy_convs())))

    def _submit(self, op: P.SubmitMessage, sink: Sink) -> None:
        """A message runs on the model it names, else its conversation's (else the
        default). Naming another model switches the conversation to it (journaled with
        the reply); a conversation whose model is no longer installed runs on the
        default, with a notice. A model not loaded is loaded first."""
        conv = self.store.get(op.conv_id)
        self._require_idle(op.conv_id)
        if op.after and (not conv.messages or conv.messages[-1].msg_id != op.after):
            raise Busy(f"conversation {op.conv_id} has moved on from message {op.after}: another turn came after it")
        current = conv.model or self.models.default_name
        want = op.model or current
        try:
            m, _ = self._ensure(want, op.id, sink)
        except (NotFound, ModelError) as e:
            # a conversation coming back to a model that is gone (NotFound) or whose file no
            # longer loads (ModelError: deleted, truncated or replaced while this engine ran)
            if op.model or want == self.models.default_name:
                raise
            found, why = self._recorded_file(conv, want) if isinstance(e, NotFound) else ("", "")
            if found:  # not installed, but the file it was loaded from is still there
                m, _ = self._ensure(found, op.id, sink)
            else:
                m, _ = self._ensure(self.models.default_name, op.id, sink)
                gone = "is not installed any more" if isinstance(e, NotFound) else "cannot be loaded any more"
                sink.send(P.Notice(id=op.id, kind="model", resource="model",
                                   message=f"this conversation ran on {want}, which {gone} ({why or e}); this "
                                           f"reply runs on {m.name}, the engine's default (choose another with "
                                           f"--model, or Ctrl+O in aotx-chat)"))
        else:
            if m.name != current and conv.messages:
                sink.send(P.Notice(id=op.id, kind="model", resource="model",
                                   message=f"switched this conversation from {current} to {m.name}: {m.name} reads "
                                           f"its {len(conv.messages)} earlier messages again; what {current} "
                                           f"saved of it stays valid for {current}"))
        vocab = getattr(getattr(getattr(m, "lm", None), "config", None), "vocab_size", 0)
        if op.sampling is not None and op.sampling.logit_bias and vocab and max(op.sampling.logit_bias) >= vocab:
            raise RequestError(f"logit_bias: token id {max(op.sampling.logit_bias)} is past the vocabulary of "
                               f"{m.name} ({vocab:,} tokens)")
        self.engine.enqueue(m.submitter.submit(op, sink, self.engine.tick), m)

    def _local(self, model: str, rid: int, sink: Sink, what: str) -> Any:
        """The loaded local model ``model`` names ("" the default; loaded when it is not)."""
        m, _ = self._ensure(model or self.models.default_name, rid, sink)
        if getattr(m, "kind", "") == "remote":
            raise RequestError(f"{m.name} is a remote model: its {what} are its server's")
        return m

    def _embed(self, op: P.Embed, sink: Sink) -> None:
        """Embeddings of ``op.texts`` on the engine thread, between ticks (``embeddings.py``)."""
        from aotx.engine.runtime.embeddings import Embedder

        m = self._local(op.model, op.id, sink, "embeddings")
        e = self._embedders.get(m)
        if e is None:
            e = self._embedders[m] = Embedder(m.lm, m.n_ctx, getattr(self.engine, "kv_type", "f16"))
        sink.send(e.embed(op))

    def _tokenize(self, op: P.Tokenize, sink: Sink) -> None:
        from aotx.engine.runtime.embeddings import tokenize

        sink.send(tokenize(self._local(op.model, op.id, sink, "tokens").lm, op))

    def _detokenize(self, op: P.Detokenize, sink: Sink) -> None:
        from aotx.engine.runtime.embeddings import detokenize

        sink.send(detokenize(self._local(op.model, op.id, sink, "tokens").lm, op))

    def _count_tokens(self, op: P.CountTokens, sink: Sink) -> None:
        """The prompt's token count on the model named (loaded first when it is not)."""
        m, _ = self._ensure(op.model or self.models.default_name, op.id, sink)
        if not hasattr(m.submitter, "count"):
            raise RequestError(f"{m.name} is a remote model: its prompts are made and counted by its server")
        m.submitter.count(op, sink)

    @staticmethod
    def _recorded_file(conv: Conversation, name: str) -> tuple[str, str]:
        """(path, "") of the file the conversation's model ``name`` was loaded from, as its
        last reply recorded it, when that file is still there with the same fingerprint;
        else ("", why not: "" when nothing was recorded)."""
        path = getattr(conv, "model_path", "")
        if not path or conv.model != name:
            return "", ""
        from aotx.engine.model.loader import file_fingerprint

        if not os.path.isfile(path):
            return "", f"its file {path} is gone"
        try:
            fp = file_fingerprint(path)
        except (ModelError, OSError) as e:
            return "", f"its file {path} cannot be read: {e}"
        if fp != conv.model_fingerprint:
            return "", f"its file {path} now holds another model (fingerprint {fp}, not {conv.model_fingerprint})"
        return path, ""

    def _cancel_op(self, op: P.Cancel, sink: Sink) -> None:
        for m in self.models:
            if hasattr(m.submitter, "cancel_preparing"):  # a remote model prepares nothing here
                m.submitter.cancel_preparing(op, sink)
        for r in self.engine.requests():
            if (op.target and r.rid == op.target and r.sink is sink) or (op.conv_id and r.conv_id == op.conv_id):
                self.engine.cancel(r)
        sink.send(P.Ok(id=op.id))

    def _delete(self, op: P.DeleteConversation, sink: Sink) -> None:
        self._require_idle(op.conv_id)
        self.store.delete(op.conv_id, tick=self.engine.tick)
        for m in self.models:
            m.forget(op.conv_id)
        sink.send(P.Ok(id=op.id))

    def _rename(self, op: P.RenameConversation, sink: Sink) -> None:
        self.store.rename(op.conv_id, op.title, tick=self.engine.tick)
        sink.send(P.Ok(id=op.id))

    def _update(self, op: P.UpdateConversation, sink: Sink) -> None:
        self.store.update(op.conv_id, op.system_prompt, op.sampling, tick=self.engine.tick)
        sink.send(P.Ok(id=op.id))

    def _truncate(self, op: P.TruncateConversation, sink: Sink) -> None:
        self._require_idle(op.conv_id)
        self.store.truncate(op.conv_id, op.msg_id, tick=self.engine.tick)
        sink.send(P.Ok(id=op.id))

    def _fork(self, op: P.ForkConversation, sink: Sink) -> None:
        view = self.store.fork(op.conv_id, op.at_msg_id or None, tick=self.engine.tick)
        sink.send(P.ConversationInfo(id=op.id, conversation=view))

    def _status(self, op: P.Status, sink: Sink) -> None:
        sink.send(self.engine.status_reply(op.id))

    def _list_models(self, op: P.ListModels, sink: Sink) -> None:
        ms, counted = self.models, self.engine.has_budget
        sink.send(P.ModelList(id=op.id, models=ms.infos(), budget_bytes=ms.total if counted else 0,
                              used_bytes=ms.used() if counted else 0, models_dir=str(self.catalog.models_dir)))

    def _load_model(self, op: P.LoadModel, sink: Sink) -> None:
        already = self.models.get(op.model) is not None
        m, unloaded = self._ensure(op.model, op.id, sink, evict_idle=op.evict_idle or None)
        info = m.info()
        info.default = m.name == self.models.default_name
        sink.send(P.ModelLoaded(id=op.id, model=info, unloaded=unloaded, already=already))

    def _unload_model(self, op: P.UnloadModel, sink: Sink) -> None:
        name = op.model if self.models.get(op.model) is not None else self._loaded_name(op.model)
        if name == self.models.default_name:  # it stays (README); unloading it left no model loaded
            raise RequestError(f"{name} is the engine's default model: it stays loaded (unload the models loaded "
                               f"beside it; `aotx stop` frees all of them)")
        self.models.unload(name)
        sink.send(P.Ok(id=op.id))

    def _model_name(self, ref: str) -> str:
        """The catalog name ``ref`` names; a loaded model's own name first (its file may be gone
        from the models folder: it still runs, as `aotx models` shows it loaded)."""
        if self.models.get(ref) is not None:
            return ref
        return self.catalog.resolve(ref).name

    def _loaded_name(self, ref: str) -> str:
        """The loaded model ``ref`` names (a catalog name or path); NotFound when none."""
        try:
            name = self.catalog.resolve(ref).name
        except NotFound:
            name = ref
        if self.models.get(name) is None:
            near = close_matches(ref, list(self.models.loaded))
            hint = f"; did you mean {', '.join(near)}?" if near else ""
            raise NotFound(f"model {ref!r} is not loaded{hint} (loaded: {', '.join(self.models.loaded) or 'none'})")
        return name

    def _switch_model(self, op: P.SwitchModel, sink: Sink) -> None:
        self._require_idle(op.conv_id)
        self.store.get(op.conv_id)
        name = self._model_name(op.model)
        self.store.switch_model(op.conv_id, name, tick=self.engine.tick)
        sink.send(P.ConversationInfo(id=op.id, conversation=self.store.view(op.conv_id, busy=self._busy_convs())))

    def _set_context(self, op: P.SetContextPolicy, sink: Sink) -> None:
        self._require_idle(op.conv_id)
        self.store.set_context(op.conv_id, op.policy, tick=self.engine.tick)
        sink.send(P.ConversationInfo(id=op.id, conversation=self.store.view(op.conv_id, busy=self._busy_convs())))

    # ---- what the handlers share ---------------------------------------------------------

    def _ensure(self, name: str, rid: int, sink: Sink,
                evict_idle: bool | None = None) -> tuple[ServedModel, list[str]]:
        """The loaded model ``name`` (loaded now when it is not; the client is told)."""
        def on_load(message: str) -> None:
            sink.send(P.Notice(id=rid, kind="model", resource="model", message=message))

        m, unloaded = self.models.ensure(name, evict_idle=evict_idle, on_load=on_load)
        for u in unloaded:
            sink.send(P.Notice(id=rid, kind="model", resource="memory",
                               message=f"unloaded the idle model {u} to make room for {m.name}"))
        return m, unloaded

    def _busy_convs(self) -> set[str]:
        return {r.conv_id for r in self.engine.requests()} | self.engine.preparing()

    def _require_idle(self, conv_id: str) -> None:
        if conv_id in self.engine.preparing():
            raise Busy(f"conversation {conv_id} is preparing a message; wait for it or cancel it first")
        if self.engine.is_busy(conv_id):
            raise Busy(f"conversation {conv_id} is generating; cancel it first")
