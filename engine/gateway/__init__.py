"""The HTTP gateway (``aotx gateway``): a front end in its own process.

``server`` (Starlette routes, limits, the OpenAI chat and completions API), ``schema``
(OpenAI's request and response shapes), ``responses`` (the Responses API),
``anthropic`` (the Messages API), ``media`` (images and audio in requests), ``auth``
(keys). It reaches the engine through ``ipc.client`` only.
"""
