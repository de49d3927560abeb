"""The server layer: one process owns a store and serves it over HTTP and the lean stream.

Who owns what:

- `serve.py`: the owning process: listeners, takeover and handoff, stop,
  background garbage collection.
- `app.py`: the HTTP API's routes and middleware, and `ServerState`, what
  every handler shares. `auth.py` decides who is asking (one token check);
  `bodies.py` reads request bodies and holds the byte budgets;
  `admission.py` caps TCP connections; `openapi.py` describes the API.
- `lean.py`: the owner's msgpack stream on a second unix socket, for the
  hot calls (object reads, publish, `strata ls`).
- `events.py`: the event feed (publishes, conflicts, forks, in order) and
  its server-sent-events answer. `history.py`: what a snapshot changed, and
  what a rejected run conflicted with.
- `ui.py`: the read-only web view's routes; `previews.py` reads the files it
  shows; `ui_static/` is its page.
- `tokens.py` and `visibility.py`: bearer tokens, and which snapshots a
  token's volume may name.
- `client.py`: the remote `Store` that talks to all this (it caches tree
  nodes, as any `Store` reader may); `wire.py`: the encodings both sides
  share.

The server reads the engine through `LocalStore`'s public methods and the
`Store` interface. Trees are read, never written, and only by the modules
that show or count what a snapshot holds: `lean.py` (`list`), `events.py`
and `history.py` (change counts, conflicts), `ui.py` and `previews.py`.
Nothing here writes a pack, an index or a tree node: every change goes
through the engine's publish.
"""
