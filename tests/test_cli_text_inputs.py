"""Text that is not valid Unicode and numbers out of range: one line naming the field.

``aotx run`` with bytes that are not UTF-8 in its arguments or on standard input used
to end in a ``UnicodeEncodeError`` traceback (``encode_frame``), and a
``--max-tokens`` of 30 digits in an ``OverflowError`` one. Now each is one line on
stderr naming the field, exit code 2, nothing started. On the socket, a frame whose
text fields are not UTF-8 gets an ``Error`` reply and the connection goes on.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from aotx.engine import protocol as P
from aotx.engine.errors import ErrorCode, ProtocolError
from tests.test_cli_full_disk import engine, tiny  # noqa: F401 (fixtures)
from tests.test_connections import hello_frame, raw_client, read_frame, serve_null  # noqa: F401 (a fixture)

BIG = "1" + "0" * 29


def aotx(tmp_path, *args: bytes | str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, AOTX_HOME=str(tmp_path / "home"), PYTHONDONTWRITEBYTECODE="1")
    argv = [os.fsencode(sys.executable), b"-m", b"aotx.engine.cli.commands",
            *[a if isinstance(a, bytes) else a.encode() for a in args]]
    return subprocess.run(argv, input=stdin if stdin is not None else b"", capture_output=True, env=env, timeout=120)


def one_line(r: subprocess.CompletedProcess, *needles: str) -> str:
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode == 2, (r.returncode, err)
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    line = err.splitlines()[0]
    assert line.startswith("aotx: "), line
    for n in needles:
        assert n in line, (n, line)
    assert r.stdout == b""
    return line


@pytest.mark.parametrize("args,needles", [
    ((b"run", b"hi \xff there"), ("the prompt: not valid UTF-8", "byte 0xff at character 3")),
    ((b"run", b"--stop", b"\xfe", b"hi"), ("--stop: not valid UTF-8", "byte 0xfe")),
    ((b"run", b"--system", b"be \xc3", b"hi"), ("--system: not valid UTF-8", "byte 0xc3")),
    ((b"conversations", b"show", b"c\xff"), ("the id: not valid UTF-8",)),
])
def test_argv_that_is_not_utf8_is_one_line_naming_the_flag(tmp_path, args, needles):
    """Bytes that are not UTF-8 on the command line reached encode_frame as lone
    surrogates: a UnicodeEncodeError traceback."""
    one_line(aotx(tmp_path, *args), *needles)
    assert not (tmp_path / "home" / "run").exists() or not list((tmp_path / "home" / "run").glob("*.sock"))


@pytest.mark.parametrize("args", [(b"run",), (b"run", b"-")])
def test_stdin_that_is_not_utf8_is_one_line(tmp_path, args):
    one_line(aotx(tmp_path, *args, stdin=b"hello \x80\x81 world"),
             "standard input (the prompt) is not valid UTF-8", "byte 0x80 at byte 6")


@pytest.mark.parametrize("flag", ["--max-tokens", "--top-k", "--seed"])
def test_an_integer_too_big_for_the_protocol_is_one_line_naming_the_flag(tmp_path, flag):
    """``--max-tokens`` with 30 digits passed the range check (no upper bound) and ended
    in OverflowError in the encoder."""
    one_line(aotx(tmp_path, "run", flag, BIG, "hi"), f"{flag} must be", f"got {BIG}")


def test_the_encoder_names_a_field_that_cannot_be_utf8():
    msg = P.SubmitMessage(id=1, conv_id="c", text="ok", sampling=P.SamplingParams(stop=["fine", "bad \udcff"]))
    with pytest.raises(ProtocolError, match=r"SubmitMessage: sampling.stop\[1\] is not valid UTF-8"):
        P.encode_frame(msg)
    with pytest.raises(ProtocolError, match="a number is out of range"):
        P.encode_frame(P.SubmitMessage(id=1, conv_id="c", text="x", sampling=P.SamplingParams(max_tokens=1 << 70)))


def test_a_frame_whose_text_is_not_utf8_gets_an_error_reply_and_the_connection_goes_on(serve_null):  # noqa: F811
    _, path = serve_null()
    s = raw_client(path)
    assert isinstance(read_frame(s), P.Welcome)
    good = P.encode_frame(P.SubmitMessage(id=5, conv_id="c", text="abc"))[4:]
    for bad in (good.replace(b"\xa3abc", b"\xa3a\xff\xfe"), good.replace(b"\xa3abc", b"\xa3\xed\xa0\x80")):
        s.sendall(len(bad).to_bytes(4, "big") + bad)
        err = read_frame(s)
        assert isinstance(err, P.Error) and err.code == ErrorCode.BAD_FRAME and "UTF-8" in err.message, err
    s.sendall(P.encode_frame(P.Status(id=6)))
    assert isinstance(read_frame(s), P.Ok)
    s.close()


def test_the_encoder_refuses_a_message_over_the_frame_limit_naming_its_size():
    with pytest.raises(ProtocolError, match=r"SubmitMessage is 16,777,2\d\d bytes; the engine takes at most "
                                            r"16,777,216 \(16 MiB\)"):
        P.encode_frame(P.SubmitMessage(id=1, conv_id="c", text="a" * (16 << 20)))


def test_a_prompt_over_the_frame_limit_is_one_line_and_leaves_no_conversation(engine, tmp_path):  # noqa: F811
    """A 17 MB prompt on standard input was sent whole: the engine closed the connection at
    the frame's header and ``aotx run`` said "the engine connection broke: [Errno 32]
    Broken pipe", leaving behind the empty conversation it had created for it."""
    _eng, store, _fs, sock = engine
    r = aotx(tmp_path, "run", "--socket", str(sock), stdin=b"a" * (17 << 20))
    one_line(r, "the prompt is 17,825,792 bytes", "16 MiB")
    assert store.table.live() == []


def test_an_answer_over_the_frame_limit_becomes_an_error_for_its_request():
    """The engine's own answers go through the same encoder: one over the limit (a list of
    very many conversations) must reach the client as an Error naming the size, not raise
    on the engine thread."""
    from aotx.engine.ipc.server import Connection

    class Loop:
        sent: list[bytes] = []

        def call_soon_threadsafe(self, fn, data):
            self.sent.append(data)

    loop = Loop()
    conn = Connection(loop, writer=None, name="t")
    many = [P.ConversationView(conv_id=f"c{i}", title="t" * 200) for i in range(80_000)]
    conn.send(P.ConversationList(id=7, conversations=many))
    [frame] = loop.sent
    err = P.decode_payload(frame[4:])
    assert isinstance(err, P.Error) and err.id == 7 and err.code == ErrorCode.TOO_LONG
    assert "ConversationList is" in err.message and "16 MiB" in err.message


def test_a_frame_nested_too_deeply_gets_an_error_reply_and_the_connection_goes_on(serve_null):  # noqa: F811
    """50,000 nested maps in one frame ended the connection's task with a RecursionError
    traceback in the engine's log, and the client got its connection closed unanswered."""
    _, path = serve_null()
    s = raw_client(path)
    assert isinstance(read_frame(s), P.Welcome)
    bad = b"\x81\xa1a" * 50_000 + b"\xc0"
    s.sendall(len(bad).to_bytes(4, "big") + bad)
    err = read_frame(s)
    assert isinstance(err, P.Error) and err.code == ErrorCode.BAD_FRAME and "nested" in err.message, err
    s.sendall(P.encode_frame(P.Status(id=6)))
    assert isinstance(read_frame(s), P.Ok)
    s.close()
