"""Full-text search over conversations: titles and every message's text.

Owns: an SQLite FTS5 index (in memory, one per app) of the conversations the engine
has, and turning what a user types into a safe FTS5 query. The app keeps the index in
step with the engine's conversation table (which the journal rebuilds): at connect
and at every status poll it compares each conversation's ``updated_at`` with what is
indexed, indexes again the ones that changed (``show``), and drops the ones gone; a
reply that finishes here is indexed at once. Leaves showing hits to the sidebar.

Why in the app and not the engine: the engine already answers ``list`` and ``show``;
an index beside the screen needs no protocol change and costs one ``show`` per
changed conversation. Limits said plainly: the index lives as long as the app (it is
rebuilt at start, one ``show`` per conversation).
"""

from __future__ import annotations

import re
import sqlite3
from dataclasses import dataclass

from aotx.engine import protocol as P

_WORD = re.compile(r"\w+", re.UNICODE)


@dataclass(frozen=True)
class Hit:
    """A conversation that matches: ``msg_id`` of its best matching message ("" when
    only the title matched) and a short ``snippet`` around the match."""

    conv_id: str
    title: str
    msg_id: str = ""
    snippet: str = ""


def fts_query(text: str) -> str:
    """What a user typed -> an FTS5 query: every word must appear, the last one as a
    prefix (search as you type); quotes, operators and punctuation are never syntax
    (``don't``, ``C++``, ``a-b`` and ``NOT`` are searched as words). "" for no words."""
    words = _WORD.findall(text)
    if not words:
        return ""
    quoted = [f'"{w}"' for w in words]
    quoted[-1] += "*"
    return " ".join(quoted)


class SearchIndex:
    """Titles and message texts of conversations, searchable with FTS5."""

    def __init__(self) -> None:
        self.db = sqlite3.connect(":memory:", check_same_thread=False)
        self.db.executescript(
            "CREATE TABLE convs(conv_id TEXT PRIMARY KEY, title TEXT, updated_at REAL);"
            "CREATE VIRTUAL TABLE msgs USING fts5(conv_id UNINDEXED, msg_id UNINDEXED, text,"
            " tokenize = 'unicode61 remove_diacritics 2');"
            "CREATE VIRTUAL TABLE titles USING fts5(conv_id UNINDEXED, title,"
            " tokenize = 'unicode61 remove_diacritics 2');")

    def indexed_at(self) -> dict[str, float]:
        """conv_id -> the ``updated_at`` its indexed copy had."""
        return dict(self.db.execute("SELECT conv_id, updated_at FROM convs"))

    def stale(self, convs: list[P.ConversationView]) -> tuple[list[str], list[str]]:
        """(ids to index again: new or changed since indexed, ids to drop: gone)."""
        have = self.indexed_at()
        now = {c.conv_id: c.updated_at for c in convs}
        changed = [cid for cid, t in now.items() if have.get(cid) != t]
        gone = [cid for cid in have if cid not in now]
        return changed, gone

    def put(self, conv: P.ConversationView) -> None:
        """Index ``conv`` (a ``show`` answer, with its messages), replacing its old rows."""
        with self.db:
            self._drop(conv.conv_id)
            self.db.execute("INSERT INTO convs VALUES (?, ?, ?)", (conv.conv_id, conv.title, conv.updated_at))
            self.db.execute("INSERT INTO titles VALUES (?, ?)", (conv.conv_id, conv.title))
            self.db.executemany("INSERT INTO msgs VALUES (?, ?, ?)",
                                [(conv.conv_id, m.msg_id, m.text) for m in conv.messages if m.text])

    def rename(self, conv_id: str, title: str) -> None:
        with self.db:
            self.db.execute("UPDATE convs SET title = ? WHERE conv_id = ?", (title, conv_id))
            self.db.execute("DELETE FROM titles WHERE conv_id = ?", (conv_id,))
            self.db.execute("INSERT INTO titles VALUES (?, ?)", (conv_id, title))

    def drop(self, conv_id: str) -> None:
        with self.db:
            self._drop(conv_id)

    def _drop(self, conv_id: str) -> None:
        for table in ("convs", "titles", "msgs"):
            self.db.execute(f"DELETE FROM {table} WHERE conv_id = ?", (conv_id,))

    def search(self, text: str, limit: int = 50) -> list[Hit]:
        """Conversations matching every word of ``text``: title matches first, then the
        best-ranked (BM25) message of each other conversation, each conversation once."""
        q = fts_query(text)
        if not q:
            return []
        hits: dict[str, Hit] = {}
        for conv_id, title in self.db.execute(
                "SELECT t.conv_id, c.title FROM titles t JOIN convs c USING (conv_id) "
                "WHERE titles MATCH ? ORDER BY rank LIMIT ?", (q, limit)):
            hits.setdefault(conv_id, Hit(conv_id, title))
        rows = self.db.execute(
            "SELECT m.conv_id, c.title, m.msg_id, snippet(msgs, 2, '', '', '…', 8) FROM msgs m "
            "JOIN convs c USING (conv_id) WHERE msgs MATCH ? ORDER BY rank LIMIT ?", (q, limit * 4))
        for conv_id, title, msg_id, snip in rows:
            old = hits.get(conv_id)
            if old is None:
                hits[conv_id] = Hit(conv_id, title, msg_id, " ".join(snip.split()))
            elif not old.msg_id:
                hits[conv_id] = Hit(conv_id, title, msg_id, " ".join(snip.split()))
        return list(hits.values())[:limit]
