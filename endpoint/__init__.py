"""rolloutd's agent-facing endpoint: the per-job HTTP API an unmodified agent talks to instead of a
model server, recording every call as exact token ids (docs/HARNESS.md).

* :mod:`rolloutd.endpoint.session`: ``EndpointSession``, one job's endpoint (admission, budget,
  the backend call, the trajectory), composing
  :mod:`~rolloutd.endpoint.tree` (``ConversationTree``: segments, extension, forks, spliced replies),
  :mod:`~rolloutd.endpoint.stops` (stop strings, token text) and
  :mod:`~rolloutd.endpoint.bounds` (``EndpointLimits``, ``EndpointBounds``, the cheap refusals);
* :mod:`rolloutd.endpoint.app`: ``make_app``, the ASGI routes; :mod:`rolloutd.endpoint.server`:
  ``serve``/``EndpointServer``, uvicorn with the connection bounds;
* :mod:`rolloutd.endpoint.wire`: the types every API shape shares (``EndpointError``, ``Msg``,
  ``Sampling``, ``WireRequest``, ``Reply``); :mod:`rolloutd.endpoint.shapes`: one module per API
  shape (``chat``: OpenAI Chat Completions and Completions, ``responses``, ``anthropic``, ``gemini``).

Long texts are tokenized in :mod:`rolloutd.llm.encode_worker` (it stays in ``llm``: the tokenizer
utilities' ``FastEncoder`` uses it, and ``llm`` never imports this package).

Arrows: this package imports :mod:`rolloutd.llm` (client, conversation, toolparse, tokenizer
utilities), never the reverse; ``handlers`` import it (docs/ARCHITECTURE.md).
"""
