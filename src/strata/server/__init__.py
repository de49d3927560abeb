"""The server layer: one process owns a store and serves it over HTTP.

`app.py` is the HTTP API (aiohttp), `client.py` the remote `Store` that talks
to it, `wire.py` the encodings both share, `tokens.py` bearer tokens, and
`serve.py` the owning process (listeners, handoff, stop). Nothing here knows
about packs or trees: the server calls the engine only through `LocalStore`'s
public methods.
"""
