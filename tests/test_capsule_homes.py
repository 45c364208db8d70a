"""The capsule cache's three homes (device -> host -> disk), least recently used
eviction between them, and lookup across them, on a KV cache whose "device" copies are
a stand-in array type with CuPy's ``.get()`` (the real CUDA cache is covered in
test_cuda_state.py on a GPU machine)."""

from __future__ import annotations

import numpy as np

from aotx.engine.state import capsule as C
from aotx.engine.state.cache import CapsuleCache


class _DevArray:
    """Stands in for a CuPy array: ``.get()`` copies to the host; counts the copies."""

    copies = 0

    def __init__(self, a: np.ndarray):
        self._a = a.copy()
        self.shape, self.nbytes, self.dtype = a.shape, a.nbytes, a.dtype

    def get(self) -> np.ndarray:
        _DevArray.copies += 1
        return self._a.copy()

    def __getitem__(self, idx):
        return self._a[idx]


class _KV:
    """A KV cache of 4 slots, 2 layers, 1 KV head, 64 positions, head_dim 8."""

    def __init__(self):
        rng = np.random.default_rng(0)
        self.k = rng.standard_normal((4, 2, 1, 64, 8)).astype(np.float32)
        self.v = rng.standard_normal((4, 2, 1, 64, 8)).astype(np.float32)

    slot_shape = (2, 1, 64, 8)

    def snapshot_slot(self, slot, n, *, device=False):
        k, v = self.k[slot, :, :, :n].copy(), self.v[slot, :, :, :n].copy()
        return (_DevArray(k), _DevArray(v)) if device else (k, v)

    def restore_slot(self, slot, k, v, n):
        self.k[slot, :, :, :n] = k[:, :, :n]
        self.v[slot, :, :, :n] = v[:, :, :n]


def _cap(kv, slot, n, device):
    return C.snapshot(kv, slot, list(range(100 * slot, 100 * slot + n)), fingerprint="fp", device=device)


def test_device_capsules_demote_to_host_then_disk_least_recently_used_first(tmp_path):
    kv = _KV()
    one = _cap(kv, 0, 32, True).nbytes  # 2 * 2*1*32*8*4 + 32*4 = 4224 bytes
    assert one == 4224
    cache = CapsuleCache(tmp_path, device_bytes=2 * one, host_bytes=one, disk_bytes=10 * one, fingerprint="fp")
    for slot in range(4):
        cache.park(f"c{slot}", _cap(kv, slot, 32, True))
    u = cache.usage()
    # c0 fell to the host, then c1 pushed c0 to disk; c2 and c3 stay on the device
    assert sorted(cache.device) == ["c2", "c3"] and sorted(cache.host) == ["c1"] and sorted(cache.disk) == ["c0"]
    assert (u["device_bytes"], u["device_count"], u["host_count"], u["disk_count"]) == (2 * one, 2, 1, 1)
    assert isinstance(cache.host["c1"].k, np.ndarray) and cache.host["c1"].home == "host"
    # the demoted capsule carries a real checksum, and the file round-trips byte-exact
    C.verify(cache.host["c1"])
    back = C.load(cache.disk["c0"][0])
    assert back.k.tobytes() == kv.k[0, :, :, :32].tobytes() and back.header.crc32c != 0


def test_lookup_prefers_the_longest_prefix_across_homes_and_restores_from_the_device(tmp_path):
    kv = _KV()
    cache = CapsuleCache(None, device_bytes=1 << 20, host_bytes=1 << 20, fingerprint="fp")
    cache.park("dev", _cap(kv, 1, 40, True))
    cache.park("host", _cap(kv, 2, 20, False))
    cap, n, _ = cache.best_for("other", list(range(100, 130)) + [7, 7])
    assert cap.home == "device" and n == 30
    before = _DevArray.copies
    C.restore(cap, kv, 3, fingerprint="fp", n=n)
    assert _DevArray.copies == before, "a device capsule restores without a host copy"
    assert kv.k[3, :, :, :30].tobytes() == kv.k[1, :, :, :30].tobytes()
    cap, n, _ = cache.best_for("other", list(range(200, 215)))
    assert cap.home == "host" and n == 15


def test_without_a_device_budget_capsules_park_in_host_memory():
    kv = _KV()
    cache = CapsuleCache(None, host_bytes=1 << 20, fingerprint="fp")
    cache.park("a", _cap(kv, 0, 16, False))
    u = cache.usage()
    assert u["device_budget"] == 0 and u["device_count"] == 0 and u["host_count"] == 1
