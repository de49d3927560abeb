"""Images: OCI images and plain root directories kept as volumes (docs/images.md).

An image is a volume whose snapshots carry an ``image`` key in their meta
(the OCI runtime config: Env, Entrypoint, Cmd, WorkingDir, User); its tags
are the volume's branches. This package sits beside `fsio.py`, directly above
the engine, and speaks only the `Store` interface: `layers` applies layer
tarballs (untrusted input) to an in-memory tree, `sources` reads OCI layouts
and archives and checks every digest, `importer` publishes the result as one
change set, `export` writes an OCI layout back. Nothing here prints or reads
the environment.
"""
