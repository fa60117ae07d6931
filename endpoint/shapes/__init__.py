"""One module per API shape the endpoint serves, each translating its requests to a
:class:`~rolloutd.endpoint.wire.WireRequest` (or the chat path's messages) and rendering a
:class:`~rolloutd.endpoint.wire.Reply` back: ``chat`` (OpenAI Chat Completions and Completions),
``responses`` (OpenAI Responses), ``anthropic`` (Messages), ``gemini`` (generateContent)."""
