"""The client protocol: framing as pure functions, the handshake, and fuzzed frames.

The framing tests are table-driven over ``protocol.py``'s pure functions. The
handshake and fuzz tests speak raw bytes to an in-process engine
(``engine_server`` in conftest.py): whatever a client sends (garbage, bad or
huge lengths, valid MessagePack of unknown types, wrong field types, truncated
frames, odd sampling values), the engine answers with an error or closes that
connection, and never crashes or hangs: after each case a fresh client still
lists conversations and the tick thread is alive.
"""

from __future__ import annotations

import math
import socket
import struct
import time

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aotx.engine.errors import ProtocolError
from aotx.engine import protocol as P

# ---- framing: pure functions ------------------------------------------------------

EVERY_MESSAGE = [
    P.Hello(protocol=1, client="t"),
    P.CreateConversation(id=1, title="t", system_prompt="s",
                         sampling=P.SamplingParams(repeat_penalty=1.0, temperature=0.0, stop=["x"])),
    P.ListConversations(id=2),
    P.ShowConversation(id=3, conv_id="c1"),
    P.SubmitMessage(id=4, conv_id="c1", text="héllo ✓", attachments=[P.Attachment(path="/a.png", kind="image")],
                    raw=True),
    P.Cancel(id=5, target=4),
    P.DeleteConversation(id=6, conv_id="c1"),
    P.RenameConversation(id=7, conv_id="c1", title=""),
    P.UpdateConversation(id=8, conv_id="c1", system_prompt=None),
    P.TruncateConversation(id=9, conv_id="c1", msg_id="m1"),
    P.Status(id=10),
    P.Welcome(protocol=1, engine="aotx", model="m", device="cpu"),
    P.Error(id=1, code="bad_request", message="no"),
    P.Ok(id=1),
    P.ConversationInfo(id=1, conversation=P.ConversationView(
        conv_id="c", title="", messages=[P.MessageView(msg_id="m", role="assistant", text="", token_ids=[1, 2])])),
    P.ConversationList(id=1, conversations=[]),
    P.Accepted(id=1, conv_id="c", msg_id="m", reply_id="r", seq=3, tick=4, prompt_ids=[1]),
    P.Token(id=1, token_id=5, text="", pos=9, tick=4, seq=5),
    P.Notice(id=1, kind="queued", resource="slots", message="m", position=2),
    P.Committed(id=1, msg_id="r", finish_reason="stop", n_prompt=3, n_completion=4, tick=5, seq=6,
                timings={"ttft_s": 0.5}),
    P.Durable(id=1, receipt=P.Receipt(segment=0, offset=10, last_seq=6)),
    P.StatusReply(id=1, model="m", device="cpu", ready=True, budget_bytes=1, used_bytes=1,
                  budget=[P.BudgetLine(name="weights", bytes=1)], slots=[P.SlotView(slot=0)], n_ctx=16),
]


@pytest.mark.parametrize("msg", EVERY_MESSAGE, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(msg):
    frame = P.encode_frame(msg)
    assert P.frame_length(frame[:4]) == len(frame) - 4
    assert P.decode_payload(frame[4:]) == msg


@pytest.mark.parametrize("n, ok", [(0, True), (1, True), (P.MAX_FRAME, True), (P.MAX_FRAME + 1, False),
                                   (2 << 30, False), (0xFFFFFFFF, False)])
def test_frame_length_limit(n, ok):
    header = struct.pack(">I", n)
    if ok:
        assert P.frame_length(header) == n
    else:
        with pytest.raises(ProtocolError, match=f"frame of {n} bytes exceeds the limit of {P.MAX_FRAME}"):
            P.frame_length(header)


def _mp(obj) -> bytes:
    return msgspec.msgpack.encode(obj)


@pytest.mark.parametrize("payload, match", [
    (b"", "undecodable"),
    (b"\xc1", "undecodable"),                                   # a never-used msgpack byte
    (b"\x82\xa4type", "undecodable|invalid message"),         # truncated map
    (_mp([1, 2, 3]), "invalid message"),                        # not a map
    (_mp({"id": 1}), "invalid message.*type"),                  # no tag
    (_mp({"type": "launch_missiles", "id": 1}), "invalid message.*launch_missiles"),
    (_mp({"type": "list", "id": "one"}), r"invalid message.*\$\.id"),
    (_mp({"type": "submit", "id": 1, "conv_id": "c", "text": 5}), r"invalid message.*\$\.text"),
    (_mp({"type": "submit", "id": 1, "conv_id": "c", "text": "x", "sampling": {"temperature": "hot"}}),
     r"\$\.sampling\.temperature"),
    (_mp({"type": "show", "id": 1}), "conv_id"),                # missing field
    (b"\xa3\xff\xfe\xfd", "undecodable|invalid"),               # invalid UTF-8 str
])
def test_decode_payload_names_the_problem(payload, match):
    with pytest.raises(ProtocolError, match=match):
        P.decode_payload(payload)


def test_unknown_fields_are_ignored_for_forward_compatibility():
    assert P.decode_payload(_mp({"type": "list", "id": 3, "future_field": [1, 2]})) == P.ListConversations(id=3)


# ---- raw socket helpers -------------------------------------------------------------

def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise EOFError(f"closed after {len(buf)} of {n} bytes")
        buf += chunk
    return buf


def read_msg(s: socket.socket) -> P.Message:
    return P.decode_payload(_recv_exact(s, P.frame_length(_recv_exact(s, 4))))


def raw_connect(path, *, hello: bool = True, timeout: float = 15.0) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(str(path))
    if hello:
        s.sendall(P.encode_frame(P.Hello(protocol=P.PROTOCOL_VERSION, client="raw")))
        assert isinstance(read_msg(s), P.Welcome)
    return s


def read_until_eof(s: socket.socket, timeout: float = 10.0) -> list[P.Message]:
    """Every frame until the engine closes the connection; fails if it does not within ``timeout``."""
    out = []
    s.settimeout(timeout)
    try:
        while True:
            out.append(read_msg(s))
    except (EOFError, ConnectionResetError):
        return out
    except socket.timeout:
        raise AssertionError(f"the engine kept the connection open {timeout} s after EOF; got {out}") from None


def assert_engine_healthy(h, timeout: float = 15.0) -> None:
    """A fresh, well-behaved client lists conversations (within ``timeout`` s: at most a
    tick's wait); the tick thread is alive."""
    assert h.engine._thread.is_alive(), "the tick thread died"
    s = raw_connect(h.socket, timeout=timeout)
    try:
        s.sendall(P.encode_frame(P.ListConversations(id=77)))
        while True:
            m = read_msg(s)
            if getattr(m, "id", None) == 77:
                assert isinstance(m, P.ConversationList), m
                return
    finally:
        s.close()


# ---- handshake ------------------------------------------------------------------------

@pytest.fixture
def engine(engine_server):
    return engine_server(slots=2, context=128, journal=False)


def test_version_mismatch_names_both_versions(engine):
    s = raw_connect(engine.socket, hello=False)
    s.sendall(P.encode_frame(P.Hello(protocol=P.PROTOCOL_VERSION + 41, client="future")))
    msgs = read_until_eof(s)
    assert len(msgs) == 1 and isinstance(msgs[0], P.Error) and msgs[0].code == "version_mismatch"
    assert f"version {P.PROTOCOL_VERSION + 41}" in msgs[0].message
    assert f"version {P.PROTOCOL_VERSION}" in msgs[0].message
    assert_engine_healthy(engine)


async def test_client_library_reports_version_mismatch(engine, monkeypatch):
    from aotx.engine.ipc.client import EngineClient

    import aotx.engine.ipc.server as S

    monkeypatch.setattr(P, "PROTOCOL_VERSION", 99)  # the client library speaks 99 ...

    class _P:  # ... and the server still 1
        def __getattr__(self, name):
            return 1 if name == "PROTOCOL_VERSION" else getattr(P, name)

    monkeypatch.setattr(S, "P", _P())
    with pytest.raises(ProtocolError, match="version 99 is not supported.*version 1"):
        await EngineClient.connect(engine.socket, spawn=False)


@pytest.mark.parametrize("first, code", [
    (P.encode_frame(P.ListConversations(id=1)), "bad_request"),
    (P.encode_frame(P.Welcome(protocol=1, engine="x", model="m", device="cpu")), "bad_request"),
    (struct.pack(">I", 3) + b"\xc1\xc1\xc1", "bad_frame"),
    (struct.pack(">I", 2 << 30), "bad_frame"),
])
def test_first_message_must_be_hello(engine, first, code):
    s = raw_connect(engine.socket, hello=False)
    s.sendall(first)
    msgs = read_until_eof(s)
    assert len(msgs) == 1 and isinstance(msgs[0], P.Error) and msgs[0].code == code, msgs
    assert_engine_healthy(engine)


def test_silent_client_is_dropped_after_the_handshake_timeout(engine, monkeypatch):
    import aotx.engine.ipc.server as S

    monkeypatch.setattr(S, "HANDSHAKE_TIMEOUT_S", 0.3)
    s = raw_connect(engine.socket, hello=False)
    t0 = time.monotonic()
    assert read_until_eof(s, timeout=5) == []
    assert time.monotonic() - t0 < 5


# ---- malformed frames after a valid handshake ---------------------------------------

def test_two_gigabyte_frame_gets_an_error_and_a_close(engine):
    s = raw_connect(engine.socket)
    s.sendall(struct.pack(">I", 2 << 30) + b"\x00" * 64)
    msgs = read_until_eof(s)
    assert len(msgs) == 1 and msgs[0].code == "bad_frame" and "exceeds the limit" in msgs[0].message
    assert_engine_healthy(engine)


def test_bad_payload_keeps_the_connection_usable(engine):
    s = raw_connect(engine.socket)
    bad = [b"\xc1\xc1", _mp({"type": "nope", "id": 1}), _mp({"type": "list", "id": "x"}),
           P.encode_frame(P.Token(id=1, token_id=1, text="", pos=0, tick=0, seq=0))[4:]]
    for body in bad:
        s.sendall(struct.pack(">I", len(body)) + body)
    s.sendall(P.encode_frame(P.ListConversations(id=9)))
    replies = [read_msg(s) for _ in range(len(bad) + 1)]
    assert [type(m).__name__ for m in replies] == ["Error"] * len(bad) + ["ConversationList"]
    assert [m.code for m in replies[:-1]] == ["bad_frame", "bad_frame", "bad_frame", "bad_request"]
    assert replies[-1].id == 9
    s.close()


def test_oversized_stop_string_is_refused(engine):
    """A stop string's prefixes are kept for hold-back: a 20 000-character one must be refused
    up front, not exhaust the engine's memory (regression)."""
    s = raw_connect(engine.socket)
    s.sendall(P.encode_frame(P.CreateConversation(id=1)))
    conv = read_msg(s).conversation.conv_id
    sp = P.SamplingParams(repeat_penalty=1.0, temperature=0.0, max_tokens=2, stop=["x" * 20_000])
    t0 = time.monotonic()
    s.sendall(P.encode_frame(P.SubmitMessage(id=2, conv_id=conv, text="Hi", sampling=sp, raw=True)))
    m = read_msg(s)
    assert isinstance(m, P.Error) and m.code == "bad_request" and "stop" in m.message, m
    assert time.monotonic() - t0 < 5
    s.close()
    assert_engine_healthy(engine)


# ---- fuzzing ------------------------------------------------------------------------------

TAGS = ["hello", "create", "list", "show", "submit", "cancel", "delete", "rename", "update", "truncate",
        "status", "welcome", "error", "ok", "token", "committed", "durable", "status_reply", "nope", ""]

msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2 ** 63), 2 ** 64 - 1) | st.floats(allow_nan=True)
    | st.text(max_size=20) | st.binary(max_size=20),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
    max_leaves=12,
)

field_names = st.sampled_from(["id", "conv_id", "text", "title", "target", "msg_id", "sampling", "raw",
                               "attachments", "protocol", "system_prompt", "at_msg_id"]) | st.text(max_size=6)

typed_maps = st.builds(lambda tag, fields: {"type": tag, **fields}, st.sampled_from(TAGS),
                       st.dictionaries(field_names, msgpack_values, max_size=5))

weird_numbers = (st.integers(-(2 ** 63), 2 ** 63 - 1) | st.floats(allow_nan=True, allow_infinity=True))
# max_tokens is always there and tiny: a client that goes away no longer cancels its reply (the
# engine writes it to the end), and the default length runs to the context
sampling_maps = st.fixed_dictionaries({"max_tokens": st.integers(-3, 3)}, optional={
    "temperature": weird_numbers, "top_k": st.integers(-(2 ** 63), 2 ** 63 - 1), "top_p": weird_numbers,
    "min_p": weird_numbers, "repeat_penalty": weird_numbers, "repeat_last_n": st.integers(-(2 ** 63), 2 ** 63 - 1),
    "seed": st.none() | st.integers(-(2 ** 63), 2 ** 64 - 1),
    "stop": st.lists(st.text(max_size=5), max_size=3),
})


def frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


@st.composite
def fuzz_input(draw) -> tuple[str, bytes]:
    kind = draw(st.sampled_from(["garbage", "bad_length", "huge", "msgpack", "typed", "truncated", "submit"]))
    if kind == "garbage":
        data = draw(st.binary(min_size=1, max_size=200))
    elif kind == "bad_length":  # a header that does not match what follows
        data = struct.pack(">I", draw(st.integers(0, 1 << 20))) + draw(st.binary(max_size=64))
    elif kind == "huge":
        data = struct.pack(">I", draw(st.integers(P.MAX_FRAME + 1, 2 ** 32 - 1))) + draw(st.binary(max_size=16))
    elif kind == "msgpack":
        data = frame(_mp(draw(msgpack_values)))
    elif kind == "typed":
        data = frame(_mp(draw(typed_maps)))
    elif kind == "truncated":
        whole = frame(_mp(draw(typed_maps)))
        data = whole[:draw(st.integers(1, max(1, len(whole) - 1)))]
    else:  # a well-formed submit with odd values, into a real conversation (filled in below)
        data = _mp({"type": "submit", "id": draw(st.integers(-(2 ** 63), 2 ** 64 - 1)), "conv_id": "{conv}",
                    "text": draw(st.text(max_size=12)), "raw": draw(st.booleans()),
                    "sampling": draw(sampling_maps)})
    return kind, data


def test_fuzzed_frames_never_crash_or_hang_the_engine(engine):
    s = raw_connect(engine.socket, timeout=300.0)
    s.sendall(P.encode_frame(P.CreateConversation(id=1)))
    conv = read_msg(s).conversation.conv_id
    # one real reply first: fuzzed submits now run (their replies outlive the connection), so
    # pay the kernels' first-use compile (tens of seconds on a busy machine) here, not inside
    # a fuzz case's 15-second health check
    warm = "a few words to prefill, " * 8  # a multi-row prefill and a decode step
    s.sendall(P.encode_frame(P.SubmitMessage(id=2, conv_id=conv, text=warm, raw=True,
                                             sampling=P.SamplingParams(max_tokens=2))))
    while not isinstance(read_msg(s), (P.Committed, P.Error)):
        pass
    s.close()
    seen: set[str] = set()

    @settings(max_examples=100, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(fuzz_input())
    def case(inp):
        kind, data = inp
        seen.add(kind)
        if kind == "submit":
            data = frame(data.replace(_mp("{conv}"), _mp(conv)))
        s = raw_connect(engine.socket)
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
            msgs = read_until_eof(s)  # the engine must end the connection after EOF
        finally:
            s.close()
        for m in msgs:
            assert not (isinstance(m, P.Error) and m.code == "internal"), (kind, m)
        if kind == "submit":  # its reply outlives the connection now: cancel it, keep the engine idle
            c = raw_connect(engine.socket, timeout=120.0)
            try:
                c.sendall(P.encode_frame(P.Cancel(id=9, conv_id=conv)))
                while not isinstance(read_msg(c), (P.Ok, P.Error)):
                    pass
            finally:
                c.close()
        assert_engine_healthy(engine, timeout=120.0)  # the cancel lands after the tick under way

    case()
    assert seen >= {"garbage", "bad_length", "huge", "msgpack", "typed", "truncated", "submit"}
    # generations started by fuzzed submits were cancelled (they no longer end with their connections)
    deadline = time.monotonic() + 30
    while engine.engine._running or engine.engine._waiting:
        assert time.monotonic() < deadline, "fuzzed generations were not cancelled"
        time.sleep(0.05)
    assert engine.engine.ready and engine.engine._thread.is_alive()


def test_math_is_finite_in_fuzz_ranges():
    # the fuzz's float strategy includes nan and inf; make sure msgpack carries them
    for v in (math.nan, math.inf, -math.inf):
        got = P.decode_payload(_mp({"type": "submit", "id": 1, "conv_id": "c", "text": "",
                                    "sampling": {"temperature": v}})).sampling.temperature
        assert (math.isnan(got) and math.isnan(v)) or got == v
