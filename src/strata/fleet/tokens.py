"""A fleet store's scoped tokens, kept in the bucket so they move with the store.

A store's tokens live in `STORE/tokens.json` (server/tokens.py: hashes of the
secrets, never the secrets). The store's bucket tier does not carry that
file, so a member that claims a store would start with none. The member
keeps a copy at `fleet/tokens/<store>` in the fleet's prefix instead:

- saved after every token made or revoked through the fleet port, before the
  caller hears the answer, and once more when the owner hands the store on
  (catching tokens made on the owner's own socket);
- restored into the store's directory by the claimant, after the restore
  from the bucket and before the store serves.

The copy is the file's bytes, sealed with the fleet's key when it has one
(as packs are), so a writer to the bucket without the key cannot add a
token. A copy of an unknown format is refused, never half read. A store
with no copy starts with no tokens. This module reads and writes; it serves
nothing.
"""

from __future__ import annotations

import os

from strata.engine.bucket import Bucket
from strata.engine.errors import NotFound
from strata.engine.seal import BucketKey
from strata.server.tokens import TOKENS_FILE, TokenStore


def _name(store: str) -> str:
    return f"fleet/tokens/{store}"


def stamp(store_dir: str) -> tuple[int, int] | None:
    """The tokens file's (mtime_ns, size), to tell whether it changed; None without one."""
    try:
        st = os.stat(os.path.join(store_dir, TOKENS_FILE))
    except FileNotFoundError:
        return None
    return st.st_mtime_ns, st.st_size


def save(bucket: Bucket, key: bytes | None, store: str, store_dir: str) -> None:
    """Copy `store_dir`'s tokens file to the bucket (nothing to do without one)."""
    path = os.path.join(store_dir, TOKENS_FILE)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return
    name = _name(store)
    if key is not None:
        data = BucketKey(key).seal(name, data)
    bucket.put(name, data)


def restore(bucket: Bucket, key: bytes | None, store: str, store_dir: str) -> bool:
    """Put the bucket's copy of the tokens into `store_dir`; False if there is none."""
    name = _name(store)
    try:
        data = bucket.get_stored(name)
    except NotFound:
        return False
    if key is not None:
        data = BucketKey(key).open(name, data)  # Unauthentic: refused, never half read
    path = os.path.join(store_dir, TOKENS_FILE)
    tmp = path + ".restore"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, path)
    TokenStore(store_dir)  # the version check, now: a clear refusal rather than at serve
    return True
