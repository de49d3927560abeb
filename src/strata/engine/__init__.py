"""The storage engine: packs, index, content-addressed objects, trees, refs.

The engine knows nothing of FUSE, HTTP or sandboxes. Everything above it talks
to it through the `Store` interface in `strata.engine.interface`.
"""
