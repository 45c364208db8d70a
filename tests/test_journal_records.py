"""Record framing: round trips and a table of damaged frames."""

from __future__ import annotations

import pytest

from aotx.engine.journal import records as R


SAMPLES = [
    R.ConversationCreated("c1", "Trip to Lyon", 1700000000.5, "Be brief.", {"temperature": 0.2}),
    R.ConversationCreated("c2"),
    R.ConversationRenamed("c1", "Lyon ✈ notes"),
    R.ConversationDeleted("c2"),
    R.ConversationUpdated("c1", None, {"top_k": 0}),
    R.ConversationTruncated("c1", "m3"),
    R.MessageAccepted("c1", "m1", "user", "hello\x00world", {"seed": 7},
                      [R.AttachmentRef("ab" * 32, "image", "cat.png", "/tmp/cat.png")], 12.0),
    R.MessageAccepted("c1", "m2", "assistant"),
    R.TokensCommitted("c1", "m2", 17, [1, 2, 65535, 2**31 - 1], "héllo"),
    R.TokensCommitted("c1", "m2", 21, [], ""),
    R.MessageFinished("c1", "m2", "stop", 17, 5),
    R.CapsuleStored("c1", "/x/c1.capsule", "sha256:00", 22),
    R.Checkpoint(10, [{"conv_id": "c1", "title": "t"}], 3.0),
]


@pytest.mark.parametrize("record", SAMPLES, ids=lambda r: type(r).__name__)
def test_frame_round_trip(record):
    frame = R.encode_frame(record, tick=2**40 + 3, seq=99)
    assert len(frame) == R.frame_size(record)
    got, tick, seq, end = R.decode_frame(b"junk" + frame, 4)
    assert (got, tick, seq, end) == (record, 2**40 + 3, 99, 4 + len(frame))


def test_type_ids_are_unique_and_nonzero():
    ids = [cls.type_id for cls in R.RECORD_TYPES.values()]
    assert len(set(ids)) == len(ids) and 0 not in ids


def _frame():
    return R.encode_frame(R.TokensCommitted("c", "m", 0, [1, 2, 3], "abc"), 5, 6)


def _flip(b: bytes, i: int) -> bytes:
    return b[:i] + bytes([b[i] ^ 0x10]) + b[i + 1:]


def _bad_type(f: bytes) -> bytes:
    # a valid CRC over an unknown type: what a newer writer's record looks like
    head = R.RECORD_HEADER.pack(200, 5, 6, len(f) - R.FRAME_OVERHEAD)
    body = head + f[22:-4]
    return body + R.CRC.pack(R.crc32c(body))


def _bad_payload(f: bytes) -> bytes:
    payload = b"\xc1"  # never valid MessagePack
    head = R.RECORD_HEADER.pack(7, 5, 6, len(payload))
    return head + payload + R.CRC.pack(R.crc32c(head + payload))


DAMAGED = [
    ("header cut", lambda f: f[:10], "torn"),
    ("payload cut", lambda f: f[:-5], "torn"),
    ("crc cut", lambda f: f[:-1], "torn"),
    ("zero tail", lambda f: b"\x00" * 64, "zeros"),
    ("short zero tail", lambda f: b"\x00" * 7, "zeros"),
    ("flipped payload", lambda f: _flip(f, 30), "corrupt"),
    ("flipped seq", lambda f: _flip(f, 12), "corrupt"),
    ("flipped crc", lambda f: _flip(f, len(f) - 2), "corrupt"),
    ("huge length", lambda f: f[:18] + b"\xff\xff\xff\x7f" + f[22:], "corrupt"),
    ("type zero, garbage", lambda f: b"\x00\x00" + f[2:], "corrupt"),
    ("unknown type", _bad_type, "corrupt"),
    ("undecodable payload", _bad_payload, "corrupt"),
]


@pytest.mark.parametrize("name,damage,kind", DAMAGED, ids=[d[0] for d in DAMAGED])
def test_damaged_frames_are_refused_with_kind_and_offset(name, damage, kind):
    data = b"H" * 8 + damage(_frame())
    with pytest.raises(R.FrameError) as e:
        R.decode_frame(data, 8)
    assert e.value.kind == kind
    assert e.value.offset == 8
    assert "offset 8" in str(e.value)


def test_segment_header_round_trip_and_damage():
    h = R.encode_segment_header(7, 1234, R.FLAG_CHECKPOINT)
    assert len(h) == R.HEADER_BYTES
    got = R.decode_segment_header(h + b"rest")
    assert (got.version, got.number, got.base_seq, got.checkpoint) == (R.FORMAT_VERSION, 7, 1234, True)
    newer = R.decode_segment_header(R.encode_segment_header(1, 1, 0, version=R.FORMAT_VERSION + 1))
    assert newer.version == R.FORMAT_VERSION + 1  # decodes; the reader decides to refuse it
    for bad, kind in [(h[:20], "torn"), (b"\x00" * 32, "zeros"), (b"NOTAJRNL" + h[8:], "corrupt"),
                      (_flip(h, 20), "corrupt")]:
        with pytest.raises(R.FrameError) as e:
            R.decode_segment_header(bad)
        assert e.value.kind == kind
