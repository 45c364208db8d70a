"""Where parked capsules live: device memory, host memory and disk, each with an LRU budget.

Owns: which capsule is in which home, eviction (least recently used first:
device -> host -> disk -> gone), lookup by conversation or by longest shared token prefix
(so a fork or an edit finds its parent's state), and the bytes per home that
admission and ``aotx status`` report. Disk files are named by conversation id
under the capsules folder and written crash-safely by ``capsule.save``; a write
that fails (a full disk) leaves no temporary file, drops that capsule (it is a
cache: the journal's tokens rebuild the state) and is counted in ``usage()``,
and temporary files a crash left are removed when the cache opens.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from aotx.engine.fileio import OS, FileIO
from aotx.engine.state import capsule as C

log = logging.getLogger("aotx.capsules")


class CapsuleCache:
    """device_bytes / host_bytes / disk_bytes: budgets per home (bytes; device 0 = no
    device home, as on the CPU backend); directory: the disk home."""

    def __init__(self, directory: Path | None, *, host_bytes: int = 512 << 20, disk_bytes: int = 4 << 30,
                 fingerprint: str = "", device_bytes: int = 0, fs: FileIO = OS, kv_type: str = "",
                 numerics: str = ""):
        self.dir = Path(directory) if directory else None
        self.kv_type = kv_type  # the engine's KV type: a disk capsule of another is not restored
        # the engine's arithmetic (set by the executor when empty): nor is one of other numerics
        self.numerics = numerics
        self.fs = fs
        self.write_errors = 0
        self.last_write_error = ""
        self.device_budget = device_bytes
        self.host_budget = host_bytes
        self.disk_budget = disk_bytes
        self.fingerprint = fingerprint
        self.device: dict[str, C.Capsule] = {}
        self.host: dict[str, C.Capsule] = {}
        self.disk: dict[str, tuple[Path, int, float]] = {}  # conv -> (path, bytes, last_used)
        self._lock = threading.Lock()
        if self.dir is not None:
            fs.mkdir(self.dir)
            removed = C.remove_temporary(self.dir, fs)
            if removed:
                log.info("capsules: removed %d temporary file(s) a failed or interrupted write left: %s",
                         len(removed), ", ".join(removed))
            for p in self.dir.glob("*.caps"):
                if p.is_file():
                    self.disk[p.stem] = (p, p.stat().st_size, p.stat().st_mtime)

    # ---- accounting ------------------------------------------------------------

    def usage(self) -> dict[str, int]:
        with self._lock:
            return {"device_bytes": sum(c.nbytes for c in self.device.values()), "device_count": len(self.device),
                    "device_budget": self.device_budget,
                    "host_bytes": sum(c.nbytes for c in self.host.values()), "host_count": len(self.host),
                    "disk_bytes": sum(b for _, b, _ in self.disk.values()), "disk_count": len(self.disk),
                    "host_budget": self.host_budget, "disk_budget": self.disk_budget,
                    "write_errors": self.write_errors}

    # ---- homes ---------------------------------------------------------------------

    def park(self, conv_id: str, cap: C.Capsule) -> None:
        """Keep ``cap`` as ``conv_id``'s state: in the device home when it was snapshot
        there (``capsule.snapshot(device=True)``), else in host memory; evict least
        recently used beyond each budget (device -> host -> disk)."""
        cap.last_used = time.monotonic()
        with self._lock:
            self.device.pop(conv_id, None)
            self.host.pop(conv_id, None)
            if cap.home == "device":
                self.device[conv_id] = cap
                self._evict_device()
            else:
                cap.home = "host"
                self.host[conv_id] = cap
                self._evict_host()

    def _evict_device(self) -> None:
        while self.device and sum(c.nbytes for c in self.device.values()) > self.device_budget:
            victim = min(self.device, key=lambda k: self.device[k].last_used)
            self.host[victim] = C.to_host(self.device.pop(victim))
            self._evict_host()

    def _evict_host(self) -> None:
        while self.host and sum(c.nbytes for c in self.host.values()) > self.host_budget:
            victim = min(self.host, key=lambda k: self.host[k].last_used)
            cap = self.host.pop(victim)
            if self.dir is not None and victim not in self.disk:
                try:
                    self._write(victim, cap)
                except OSError:
                    pass  # counted and logged by _write; the capsule is dropped (a cache)

    def _write(self, conv_id: str, cap: C.Capsule) -> Path:
        path = self.dir / f"{conv_id}.caps"
        try:
            size = C.save(cap, path, self.fs)
        except OSError as e:
            self.write_errors += 1
            self.last_write_error = f"{path}: {e.strerror or e}"
            log.warning("capsule of %s not written (%s); its state will be rebuilt from the journal", conv_id,
                        e.strerror or e)
            raise
        self.disk[conv_id] = (path, size, time.monotonic())
        while self.disk and sum(b for _, b, _ in self.disk.values()) > self.disk_budget:
            victim = min(self.disk, key=lambda k: self.disk[k][2])
            p, _, _ = self.disk.pop(victim)
            self._unlink(p)
        return path

    def _unlink(self, p: Path) -> None:
        try:
            self.fs.unlink(p)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("could not remove capsule %s: %s", p, e.strerror or e)

    def store_on_disk(self, conv_id: str, cap: C.Capsule) -> Path | None:
        """Write ``cap`` to the disk home (crash-safe). Returns its path, or None without a disk home."""
        if self.dir is None:
            return None
        with self._lock:
            return self._write(conv_id, cap)

    def drop(self, conv_id: str) -> None:
        """Forget a conversation's capsules (deleted, or its history changed)."""
        with self._lock:
            self.device.pop(conv_id, None)
            self.host.pop(conv_id, None)
            entry = self.disk.pop(conv_id, None)
        if entry:
            self._unlink(entry[0])

    # ---- lookup ----------------------------------------------------------------------

    def best_for(self, conv_id: str, prompt: list[int]) -> tuple[C.Capsule | None, int, str]:
        """The capsule sharing the longest token prefix with ``prompt`` (its own
        conversation's first, then any parked one, e.g. a fork's parent); a capsule with
        recurrent state counts only when all of it is a prefix (``capsule.usable_prefix``).
        Returns (capsule, shared prefix length, note); loads from disk when needed.
        A disk capsule of another model or KV type is dropped and the note says so."""
        with self._lock:
            best, best_n = None, 0
            for cid, cap in list(self.device.items()) + list(self.host.items()):
                n = C.usable_prefix(cap, prompt)
                if n > best_n or (n == best_n and n and cid == conv_id):
                    best, best_n = cap, n
            parked = conv_id in self.host or conv_id in self.device
            disk_entry = self.disk.get(conv_id) if not parked else None
        note = ""
        if disk_entry is not None:
            try:
                cap = C.load(disk_entry[0])
                if cap.header.fingerprint != self.fingerprint:
                    note = (f"the capsule on disk belongs to model {cap.header.fingerprint}, not "
                            f"{self.fingerprint}: re-prefilling from the journal's tokens")
                    self.drop(conv_id)
                elif self.numerics and cap.header.numerics != self.numerics:
                    made = cap.header.numerics or "an earlier version's arithmetic"
                    note = (f"the capsule on disk was computed with {made}, this engine computes with "
                            f"{self.numerics}: re-prefilling from the journal's tokens")
                    self.drop(conv_id)
                elif self.kv_type and cap.header.kv_type != self.kv_type:
                    note = (f"the capsule on disk holds {cap.header.kv_type} KV, this engine's KV cache is "
                            f"{self.kv_type} (--kv-type): re-prefilling from the journal's tokens")
                    self.drop(conv_id)
                else:
                    n = C.usable_prefix(cap, prompt)
                    if n > best_n:
                        best, best_n = cap, n
                        note = f"restored {n} tokens from the capsule on disk"
            except C.CapsuleError as e:
                note = f"{e}: re-prefilling from the journal's tokens"
                self.drop(conv_id)
        if best is not None:
            best.last_used = time.monotonic()
        return best, best_n, note
