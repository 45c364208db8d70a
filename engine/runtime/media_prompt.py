"""Images as embeddings in the prompt: markers, placeholder ids, the embedding store,
and the per-attachment context check.

How an image reaches the text model: the media thread encodes the picture
(``media/vision.py``) and stores its rows here under a key (the sha256 of the
file's bytes and the encoder's name, 16 hex digits); the user's message text
holds a marker ``<__image_KEY__>`` where the picture goes (the message is
journaled with it, so later turns of the conversation put the same picture in
the same place). ``encode_chat_with_images`` renders the chat, cuts it at the
markers and puts, for each image, ``n`` placeholder ids in its place: ids at or
above ``PLACEHOLDER_BASE`` (2^30, far past any vocabulary), derived from the key
and the row, so the same image gives the same ids and any other image differs
from its first position on. Prefix reuse (slots, capsules) compares ids, so it
reuses the KV of an identical image at an identical place and stops at the first
position of a different one. In the tick, ``ImageStore.rows_for(tokens)`` maps
the placeholder ids of a batch to their embedding rows, which the model writes
over the token embeddings of those positions.

Limits said plainly: the store lives in the engine's memory (bounded, least
recently used first out); after a restart, or once evicted, the engine encodes
an earlier turn's picture again from its journaled attachment file
(``restore``); when that file is gone or changed, the marker becomes the text
"[an image that is no longer available]". Raw prompts
(no template) splice images too, without the per-image context check. Two images whose keys lie closer
than their row count get ids moved apart (so the ids of the stored images never
clash); an image's ids are then not a function of its key alone, which only costs
prefix reuse across a restart.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from aotx.media.markers import MARKER_RE, image_key, marker  # noqa: F401 (re-exported)

PLACEHOLDER_BASE = 1 << 30
_RANGE = (1 << 31) - 1 - PLACEHOLDER_BASE
MISSING_TEXT = "[an image that is no longer available]"
DEFAULT_STORE_BYTES = 256 << 20


@dataclass(frozen=True)
class StoredImage:
    """One encoded picture: ``rows`` ``(n, d_model) float32``, ``ids`` its ``(n,)``
    placeholder ids, ``name`` the attachment's file name."""

    key: str
    name: str
    rows: np.ndarray
    ids: tuple[int, ...]

    @property
    def n(self) -> int:
        return int(self.rows.shape[0])


class ImageStore:
    """Encoded pictures by key, at most ``max_bytes`` of rows (least recently used
    leave first). Thread-safe: the media thread puts, the engine thread reads."""

    def __init__(self, max_bytes: int = DEFAULT_STORE_BYTES, *, wrap: tuple[Sequence[int], Sequence[int]] = ((), ())):
        self.max_bytes = max_bytes
        self.wrap = (tuple(wrap[0]), tuple(wrap[1]))  # token ids around each image (idefics3)
        self._items: OrderedDict[str, StoredImage] = OrderedDict()
        self._by_id: dict[int, tuple[StoredImage, int]] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, key: str, name: str, rows: np.ndarray) -> StoredImage:
        """Store ``rows`` ``(n, d) float32`` under ``key`` (a no-op if present) and return it."""
        rows = np.ascontiguousarray(rows, dtype=np.float32)
        with self._lock:
            got = self._items.get(key)
            if got is not None:
                self._items.move_to_end(key)
                return got
            # ids from the key; on a clash with a stored image's ids (two keys closer than
            # n apart, rare), step to another run: the ids stay unique within the store
            base = int(key, 16) % _RANGE
            for attempt in range(64):
                ids = tuple(PLACEHOLDER_BASE + (base + i) % _RANGE for i in range(rows.shape[0]))
                if not any(t in self._by_id for t in ids):
                    break
                base = (base + 0x9E3779B1) % _RANGE
            item = StoredImage(key, name, rows, ids)
            self._items[key] = item
            for i, t in enumerate(ids):
                self._by_id[t] = (item, i)
            self._bytes += rows.nbytes
            while self._bytes > self.max_bytes and len(self._items) > 1:
                _, old = self._items.popitem(last=False)
                self._bytes -= old.rows.nbytes
                for t in old.ids:
                    if self._by_id.get(t, (None,))[0] is old:
                        del self._by_id[t]
            return item

    def get(self, key: str) -> StoredImage | None:
        with self._lock:
            item = self._items.get(key)
            if item is not None:
                self._items.move_to_end(key)
            return item

    def rows_for(self, tokens: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray] | None:
        """For a batch's ``(N,)`` ids: ``(positions (k,) int64, rows (k, width) float32)``
        of its placeholder ids, or None when it has none (the usual tick). A placeholder
        whose image has left the store gets a zero row."""
        pos = np.nonzero(tokens >= PLACEHOLDER_BASE)[0]
        if pos.size == 0:
            return None
        out = np.zeros((pos.size, width), np.float32)
        with self._lock:
            for j, p in enumerate(pos):
                got = self._by_id.get(int(tokens[p]))
                if got is not None:
                    out[j] = got[0].rows[got[1]]
        return pos.astype(np.int64), out


def has_markers(messages: Sequence[dict]) -> bool:
    return any(isinstance(m.get("content"), str) and MARKER_RE.search(m["content"]) for m in messages)


def missing_keys(messages: Sequence[dict], store: ImageStore) -> set[str]:
    """Keys of the image markers in ``messages`` whose rows are not in ``store``."""
    keys = {k for m in messages if isinstance(m.get("content"), str) for k in MARKER_RE.findall(m["content"])}
    return {k for k in keys if store.get(k) is None}


def restore(files: Sequence[tuple[str, str]], missing: set[str], vision, store: ImageStore) -> int:
    """Encode again the pictures among ``files`` ((path, name) of a conversation's image
    attachments, as journaled) whose key is in ``missing`` (after a restart or an
    eviction). A file that is gone, changed (another key) or unreadable is skipped: its
    marker then reads as ``MISSING_TEXT``. Returns how many were restored. Blocking:
    call it off the tick thread."""
    from aotx.media import image as image_mod

    done = 0
    for path, name in files:
        if not missing:
            break
        try:
            data = open(path, "rb").read()  # noqa: SIM115 - one read
        except OSError:
            continue
        key = image_key(data, vision.name)
        if key not in missing:
            continue
        try:
            rows = vision.embed_image(image_mod.load_image(path))
        except Exception:  # noqa: BLE001 - a damaged file stays missing
            continue
        store.put(key, name, rows)
        missing.discard(key)
        done += 1
    return done


def encode_chat_with_images(tokenizer, template, messages: Sequence[dict], store: ImageStore) -> list[int]:
    """Prompt ids for ``messages`` (as ``chat_template.encode_chat``) with each image
    marker replaced by its placeholder ids (wrapped in ``store.wrap``). Markers whose
    image is not in the store become ``MISSING_TEXT``. Raises TemplateError."""
    from aotx.engine.model.chat_template import content_spans

    msgs = []
    for m in messages:
        c = m.get("content")
        if isinstance(c, str):
            c = MARKER_RE.sub(lambda mo: mo.group(0) if store.get(mo.group(1)) else MISSING_TEXT, c)
        msgs.append({**m, "content": c})
    bos_text = tokenizer.token_to_piece(tokenizer.bos_id) if tokenizer.bos_id is not None else ""
    eos_text = tokenizer.token_to_piece(tokenizer.eos_id) if tokenizer.eos_id is not None else ""
    kw = dict(add_generation_prompt=True, bos_token=bos_text, eos_token=eos_text)
    text = template.render(msgs, **kw)
    spans = content_spans(template, msgs, text, tokenizer.special_texts, **kw)
    ids: list[int] = []
    at = 0

    def piece(a: int, b: int) -> None:
        if b <= a:
            return
        local = [(max(s, a) - a, min(e, b) - a) for s, e in spans if e > a and s < b]
        ids.extend(tokenizer.encode(text[a:b], parse_special=True, plain_spans=local))

    for mo in MARKER_RE.finditer(text):
        item = store.get(mo.group(1))
        if item is None:  # cannot happen after the substitution above, unless evicted since
            continue
        piece(at, mo.start())
        ids.extend(store.wrap[0])
        ids.extend(item.ids)
        ids.extend(store.wrap[1])
        at = mo.end()
    piece(at, len(text))
    if tokenizer.add_bos and tokenizer.bos_id is not None and not (ids and ids[0] == tokenizer.bos_id):
        ids.insert(0, tokenizer.bos_id)
    return ids


def encode_raw_with_images(tokenizer, text: str, store: ImageStore) -> list[int]:
    """Prompt ids of a raw (no template) prompt, as ``tokenizer.encode(text,
    add_special=True)``, with each image marker replaced by its placeholder ids (a
    marker whose picture is gone becomes ``MISSING_TEXT``)."""
    text = MARKER_RE.sub(lambda mo: mo.group(0) if store.get(mo.group(1)) else MISSING_TEXT, text)
    ids: list[int] = []
    at = 0
    for mo in MARKER_RE.finditer(text):
        item = store.get(mo.group(1))
        if item is None:
            continue
        if mo.start() > at:
            ids.extend(tokenizer.encode(text[at:mo.start()], parse_special=False))
        ids.extend(store.wrap[0])
        ids.extend(item.ids)
        ids.extend(store.wrap[1])
        at = mo.end()
    if at < len(text):
        ids.extend(tokenizer.encode(text[at:], parse_special=False))
    if tokenizer.add_bos and tokenizer.bos_id is not None:
        ids.insert(0, tokenizer.bos_id)
    if tokenizer.add_eos and tokenizer.eos_id is not None:
        ids.append(tokenizer.eos_id)
    return ids


def suggest_context(need: int, n_ctx_train: int) -> int:
    """The smallest power of two >= ``need`` (at least 512), or 0 past the model's trained context."""
    n = 512
    while n < need:
        n *= 2
    return n if n <= n_ctx_train else 0


def admit_images(text: str, encode: Callable[[str], list[int]], n_ctx: int, n_ctx_train: int,
                 store: ImageStore, refuse: Callable[[str, int, int], Any]) -> tuple[str, list[int]]:
    """Fit this message's images into the context, leaving out the ones that do not fit.

    ``text`` is the new user message (with markers), ``encode(text)`` the prompt ids of
    the conversation with it. While the prompt plus one reply token exceeds ``n_ctx``,
    the last image of the message is replaced by a one-line note and
    ``refuse(message, asked, free)`` is called with its positions asked and the
    positions free without it. Returns the text to journal and its prompt ids (which
    may still be too long: the caller refuses that as a whole)."""
    ids = encode(text)
    keys = [mo.group(1) for mo in MARKER_RE.finditer(text)]
    while len(ids) + 1 > n_ctx and keys:
        key = keys.pop()
        item = store.get(key)
        asked = (item.n + len(store.wrap[0]) + len(store.wrap[1])) if item else 0
        name = item.name if item else "image"
        rest = len(ids) - asked
        free = max(0, n_ctx - 1 - rest)
        sug = suggest_context(len(ids) + 1 + 256, n_ctx_train)
        fix = (f"start a new conversation or serve with --context {sug}" if sug and sug > n_ctx else
               "start a new conversation" if rest + 1 < n_ctx else
               "start a new conversation (this one alone fills the context)")
        msg = (f"image {name} needs {asked} tokens of context, {free} free in this conversation: {fix}")
        refuse(msg, asked, free)
        text = text.replace(marker(key), left_out_note(name), 1)
        ids = encode(text)
    return text, ids


def left_out_note(name: str) -> str:
    """What the model reads where a picture that did not fit would have been."""
    return f"[Attachment {name} left out: no room in the context]"


def special_wrap(tokenizer, projector: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Token ids llama.cpp puts around one image for ``projector`` when the vocabulary
    has them (``mtmd.cpp``: idefics3 wraps the global image in
    ``<fake_token_around_image><global-img>`` ... ``<fake_token_around_image>``); ((), ()) otherwise."""
    if projector != "idefics3":
        return (), ()
    try:
        pre = tokenizer.encode("<fake_token_around_image><global-img>", parse_special=True)
        post = tokenizer.encode("<fake_token_around_image>", parse_special=True)
    except Exception:  # noqa: BLE001 - a vocabulary without them
        return (), ()
    if len(pre) == 2 and len(post) == 1:
        return tuple(pre), tuple(post)
    return (), ()
