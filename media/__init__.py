"""aotx.media: media profiles, from an attached file to what the model receives.

``image`` and ``audio`` decode and normalize files (Pillow, soundfile + soxr);
``whisper`` (speech to text, CTranslate2) and ``ocr`` (image to text, RapidOCR)
are the specialists for text-only models; ``profile`` says which media a model
takes and at what memory cost (``profile_for``), prepares one attachment
(``prepare``) and renders the results into the user's message
(``render_for_prompt``); ``vision`` runs a vision model's own encoder and
projector (llama.cpp's mmproj GGUF), so the model receives the picture itself.
"""
