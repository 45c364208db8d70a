"""The HTTP gateway (``aotx gateway``): a front end in its own process.

``server`` (the application and the command), ``core`` (what every API asks of the
engine), ``limits`` (limits, errors, the body, the key check), ``link`` (the engine
connection), ``generation`` (one generation's events), ``streaming`` (SSE, clients
that leave), ``schema`` (OpenAI's requests) and ``shapes`` (its responses), ``openai``
(chat, completions, models), ``responses`` (the Responses API), ``anthropic`` (the
Messages API), ``media`` (images and audio in requests), ``auth`` (keys). It reaches
the engine through ``ipc.client`` only.
"""
