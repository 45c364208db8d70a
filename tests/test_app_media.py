"""How aotx-chat words what an attachment became (MediaInfo events)."""

from aotx.engine.present.format import media_text, shown_text
from aotx.engine import protocol as P


def test_transcript_is_shown_as_received():
    t = media_text(P.MediaInfo(id=1, kind="audio", route="specialist", name="clip.wav", text="the quick brown fox",
                               via="whisper-base"))
    assert "clip.wav" in t and "whisper-base" in t and t.endswith("the quick brown fox")


def test_ocr_says_the_model_saw_text_not_the_picture():
    t = media_text(P.MediaInfo(id=1, kind="image", route="specialist", name="shot.png", text="Meeting at 3",
                               via="rapidocr"))
    assert "not the picture" in t and t.endswith("Meeting at 3")
    assert "(nothing recognized)" in media_text(P.MediaInfo(id=1, kind="image", route="specialist", name="a.png"))


def test_refused_attachment_names_the_reason():
    t = media_text(P.MediaInfo(id=1, kind="image", route="refused", name="big.png", error="image too large"))
    assert t == "Attachment big.png was not used: image too large"


def test_media_text_says_the_model_saw_the_picture():
    t = media_text(P.MediaInfo(id=1, kind="image", route="encoder", name="cat.png", via="SmolVLM mmproj"))
    assert t == "Image cat.png went to the model's vision encoder (SmolVLM mmproj): the model sees the picture itself."
    assert "OCR" not in t


def test_history_hides_picture_markers():
    """A journaled message holds a marker where the picture went; the chat shows the
    words (the attachment is listed), and a retry resends them without the marker."""
    assert shown_text("<__image_0123456789abcdef__>\n\nwhat is this?") == "what is this?"
    assert shown_text("a <__image_0123456789abcdef__> b") == "a  b"
    assert shown_text("plain <__image_not_hex__>") == "plain <__image_not_hex__>"
