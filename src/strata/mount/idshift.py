"""Owners seen shifted: how a sandboxed step's mount shows stored ids, and reads them back.

A bwrap step runs in a user namespace whose id 0 is host id `base` (see
run/identity.py). Its volumes' lower layer (FUSE) therefore reports every
stored owner plus `base`, overlayfs copies files up with those host ids and
creates new ones with the writer's host ids, and the commit takes `base`
off again. A shift of 0 is the identity: every other mount.
"""

from __future__ import annotations

OVERFLOW = 65534  # what an id outside a namespace's map shows as (the kernel's overflowuid)


def shift(uid: int, base: int) -> int:
    """A stored id as the step's host view shows it."""
    host = uid + base
    return host if host < 0xFFFFFFFF else base + OVERFLOW


def unshift(host: int, base: int) -> int:
    """An id the step's host view holds, as it is stored."""
    return host - base if host >= base else host
