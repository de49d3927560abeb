"""The mount layer: a lazy read-only view of pinned snapshots, under overlayfs.

`vfs.py` is the core (inodes, lookups, reads over the `Store` interface) and
knows nothing of FUSE; `fuse.py` only translates it to pyfuse3; `cache.py` is
the local content cache shared by mounts on a machine; `overlay.py` mounts
kernel overlayfs over the FUSE view and turns its upper directory into a
change set; `session.py` ties a mount's pieces and state together;
`process.py` is the process that serves one mount (`Prepared`: forked ahead
of its mount); `mountinfo.py` reads what the kernel has mounted. Nothing
here knows about packs or the index.
"""
