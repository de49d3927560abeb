"""What an image's config asks of a step: its command, environment, directory and user.

An image imported from OCI keeps its runtime config (strata/image/meta.py);
`strata run --image` applies it as `docker run` does: the command line
replaces Cmd and follows the Entrypoint, the image's Env is the step's
environment (over the few variables a rooted step takes from the caller),
WorkingDir is the directory the command starts in, and User the identity it
runs as. A volume holding a plain root directory has no config, and a step
on it runs its command line as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from strata.engine.errors import InvalidInput


@dataclass(frozen=True, slots=True)
class ImageProcess:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None      # None: /storage, or / without volumes, as for any step
    uid: int = 0
    gid: int = 0


def _user(text: str) -> tuple[int, int]:
    """A config's User as numbers: ``root``, ``UID`` or ``UID:GID`` (names are not looked up)."""
    if text in ("", "root", "0", "root:root", "0:0"):
        return 0, 0
    user, _, group = text.partition(":")
    try:
        uid = 0 if user == "root" else int(user)
        gid = (0 if group == "root" else int(group)) if group else uid
    except ValueError:
        raise InvalidInput(f"the image runs as user {text!r}; strata reads a numeric "
                           f"UID[:GID] or root only") from None
    if not (0 <= uid < 65536 and 0 <= gid < 65536):
        raise InvalidInput(f"the image's user {text!r} is outside the step's id range")
    return uid, gid


def image_process(runtime: dict[str, Any], argv: list[str], *,
                  entrypoint: str | None = None) -> ImageProcess:
    """The step's process from an image's runtime config and the command line given.

    `entrypoint` (``--entrypoint``) replaces the image's Entrypoint and, as in
    docker, drops its Cmd; "" leaves no Entrypoint at all.
    """
    if entrypoint is not None:
        runtime = {**runtime, "Entrypoint": [entrypoint] if entrypoint else [], "Cmd": []}
    entry = list(runtime.get("Entrypoint") or [])
    cmd = list(argv) if argv else list(runtime.get("Cmd") or [])
    full = entry + cmd
    if not full:
        raise InvalidInput("no command given, and the image names none (Entrypoint/Cmd)")
    env: dict[str, str] = {}
    for item in runtime.get("Env") or []:
        key, sep, value = item.partition("=")
        if sep and key:
            env[key] = value
    cwd = runtime.get("WorkingDir") or None
    if cwd is not None and not cwd.startswith("/"):
        cwd = "/" + cwd
    uid, gid = _user(str(runtime.get("User") or ""))
    return ImageProcess(full, env, cwd, uid, gid)
