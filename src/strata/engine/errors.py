"""The exception tree, grouped by what a caller does about each error.

Each class maps to one CLI exit code and one HTTP status (see README and
docs/design.md). Nothing in the engine prints; it raises one of these.
"""

from __future__ import annotations


class StrataError(Exception):
    """Base of every error strata raises on purpose."""

    exit_code = 1
    http_status = 500


class InvalidInput(StrataError):
    """The request itself is wrong: a hostile path, a bad name, a malformed id."""

    exit_code = 2
    http_status = 400


class NotFound(StrataError):
    """A volume, branch, snapshot, object or path does not exist."""

    exit_code = 4
    http_status = 404


class Expired(NotFound):
    """A snapshot that garbage collection removed under a retention policy (HTTP 410)."""

    http_status = 410


class AlreadyExists(StrataError):
    """A volume or branch of that name already exists (or a bucket object, to a create-only put)."""

    exit_code = 1
    http_status = 409


class Conflict(StrataError):
    """Both sides changed the same paths since the base; nothing was published."""

    exit_code = 3
    http_status = 409

    def __init__(self, paths: list[str], message: str | None = None) -> None:
        self.paths = sorted(set(paths))
        super().__init__(message or f"conflict on {len(self.paths)} path(s): " + ", ".join(
            p or "/" for p in self.paths[:10]) + (" ..." if len(self.paths) > 10 else ""))


class Corrupt(StrataError):
    """Stored bytes fail their checksum or cannot be decoded."""

    exit_code = 1
    http_status = 500

    def __init__(self, pack: str, offset: int, detail: str) -> None:
        self.pack = pack
        self.offset = offset
        self.detail = detail
        super().__init__(f"corrupt record in {pack} at offset {offset}: {detail}")


class Unauthentic(Corrupt):
    """Bytes read from a bucket that do not verify under the store's key: never used.

    Forged, altered, put back under another name, or sealed with another key.
    """

    def __init__(self, name: str, offset: int, detail: str) -> None:
        super().__init__(name, offset, detail)
        self.args = (f"bucket object {name} fails authentication"
                     + (f" at offset {offset}" if offset else "") + f": {detail}",)


class NoConditionalWrites(StrataError):
    """The bucket's backend ignores If-None-Match, so two owners could both write.

    Not retried: the bucket (or the proxy in front of it) must be fixed.
    """

    http_status = 500


class Unavailable(StrataError):
    """The store is busy or changing owner; retry later."""

    exit_code = 1
    http_status = 503

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        self.retry_after = retry_after
        super().__init__(message)


class Locked(Unavailable):
    """The branch is leased by another holder: retry when the lease ends (HTTP 423).

    Not a 503: the server is fine, the branch is taken. A subclass of
    Unavailable, so callers that wait and retry keep doing so.
    """

    http_status = 423


class BucketUnavailable(Unavailable):
    """The bucket did not answer (after obstore's retries): nothing was changed by us."""


class Fenced(Unavailable):
    """Another owner took the store over: this one must stop acknowledging writes.

    An Unavailable: the store is served elsewhere now, so a client retries
    (and finds the new owner); the fenced server exits with this exit code.
    """


class Forbidden(StrataError):
    """The caller may not do this (read-only, wrong scope)."""

    exit_code = 1
    http_status = 403


class Unauthenticated(Forbidden):
    """No valid credentials: a missing, malformed, unknown, revoked or expired token."""

    http_status = 401


class StoreFailed(StrataError):
    """The store hit an I/O error while writing and refuses further writes."""

    exit_code = 1
    http_status = 500


def no_object(oid: bytes) -> NotFound:
    """The one answer for an object that does not exist, or is out of the caller's scope."""
    return NotFound(f"object {oid.hex()} not found")


class HelperFailed(StrataError):
    """A process strata started for the caller (a workspace's attach daemon) could not do it.

    Neither the request's fault nor worth an immediate retry: the message,
    and the helper's own log, say why.
    """

    exit_code = 1
    http_status = 500


class Stayed(Unavailable):
    """A mount could not move onto other snapshots now and stays where it is; retry later.

    The message says why: a process uses the mount, a file is open for
    writing, or an uncommitted entry (a renamed directory, a hard link) only
    a commit resolves. Exit code 1, as every Unavailable. HTTP 409, not 503:
    the server is fine, the mount is busy (as Locked is 423).
    """

    exit_code = 1
    http_status = 409


class WritesDropped(StrataError):
    """A detach found the workspace fenced: what was written after that is not in the store.

    Nothing to retry: another holder took the branch over, and the message
    says how many bytes written here were dropped. Exit code 1, HTTP 500.
    """

    exit_code = 1
    http_status = 500
