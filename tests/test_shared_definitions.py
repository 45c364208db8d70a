"""One definition each, used everywhere: sampling parameters and their defaults, media kinds.

Regression: the defaults were written in cli.py, protocol.py and sampling.py;
media kinds were decided in three places that disagreed (the app and the CLI took
``.m4a``, which the media profile cannot decode, and the CLI sent ``.opus`` as an image).
"""

from __future__ import annotations

import msgspec
import pytest

from aotx.engine import protocol as P
from aotx.media import kinds

DEFAULTS = P.SamplingParams()


def test_cli_flags_default_to_the_protocol():
    from aotx.engine.cli.commands import build_parser

    args = build_parser().parse_args(["run", "hi"])
    for name in ("max_tokens", "temperature", "top_k", "top_p", "min_p", "repeat_penalty", "seed", "speculative"):
        assert getattr(args, name) == getattr(DEFAULTS, name), name


def test_sampler_and_gateway_default_to_the_protocol():
    from aotx.engine.gateway.schema import Limits, parse_chat
    from aotx.engine.runtime.sampling import SamplerConfig

    assert SamplerConfig() == SamplerConfig.of(DEFAULTS)
    assert Limits().default_max_tokens == DEFAULTS.max_tokens
    sp = parse_chat({"messages": [{"role": "user", "content": "hi"}]}, Limits()).sampling
    # the protocol's default runs to the context; so does the gateway's, unless a ceiling is set
    assert Limits().max_tokens_ceiling is None and sp == DEFAULTS
    sp = parse_chat({"messages": [{"role": "user", "content": "hi"}]}, Limits(max_tokens_ceiling=100)).sampling
    assert sp == msgspec.structs.replace(DEFAULTS, max_tokens=100)


@pytest.mark.parametrize("body,param", [
    ({"repeat_penalty": 0}, "repeat_penalty"),   # would divide by zero in the sampler
    ({"temperature": 2.5}, "temperature"),       # OpenAI's range
    ({"top_k": -1}, "top_k"),
])
def test_gateway_refuses_what_the_protocol_refuses(body, param):
    from aotx.engine.gateway.schema import BadRequest, Limits, parse_chat

    with pytest.raises(BadRequest) as e:
        parse_chat({"messages": [{"role": "user", "content": "hi"}], **body}, Limits())
    assert e.value.param == param


@pytest.mark.parametrize("name", sorted(kinds.EXTENSIONS) + ["clip.m4a", "notes.txt", "x.MP3"])
def test_app_and_cli_take_the_media_profiles_kinds(name, tmp_path):
    from aotx.engine.present.attach import kind_of_extension

    name = name if "." in name[1:] else "file" + name
    want = kinds.kind_of_name(name)
    assert kind_of_extension(name) == (want.value if want else None)
    assert (kinds.kind_of_name("clip.m4a"), kinds.kind_of_name("voice.opus")) == (None, kinds.MediaKind.AUDIO)


def test_app_sniff_is_the_media_profiles():
    from aotx.engine.present.attach import sniff
    from aotx.media.profile import sniff as profile_sniff

    for head in (b"\x89PNG\r\n\x1a\n" + b"\0" * 8, b"II*\0" + b"\0" * 12, b"OggS" + b"\0" * 12, b"hello world 1234"):
        found = profile_sniff(head)
        assert sniff(head) == (found[0] if found else None)
