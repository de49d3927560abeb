"""Image names: how `debian:bookworm`-style references map onto volumes and branches.

An image is a volume; each of its tags is a branch of that volume. So
``debian:bookworm`` is the volume ``debian``, branch ``bookworm``, and a name
without a tag means ``latest``, as in docker. A repository path's ``/`` (a
registry or an organisation: ``ghcr.io/org/app``) becomes ``_`` in the
volume name (``ghcr.io_org_app``), since a volume name is one component; the
reference as given is kept in the image's meta. strata's own form
``VOLUME@BRANCH`` is accepted too. Digests (``name@sha256:...``) are not
references here: a snapshot id (``VOLUME#SNAPSHOT``) names one version.
"""

from __future__ import annotations

from dataclasses import dataclass

from strata.engine.errors import InvalidInput
from strata.engine.names import check_branch, check_volume

DEFAULT_TAG = "latest"


@dataclass(frozen=True, slots=True)
class ImageRef:
    volume: str
    branch: str
    given: str          # the reference as the user wrote it

    def __str__(self) -> str:
        return f"{self.volume}:{self.branch}"


def parse_image_ref(text: str, *, default_tag: str = DEFAULT_TAG) -> ImageRef:
    """`NAME[:TAG]` (docker's form) or `VOLUME@BRANCH` (strata's) as a volume and branch."""
    if not text:
        raise InvalidInput("an image reference is empty")
    if "@" in text:
        volume, _, branch = text.partition("@")
        if branch.startswith("sha256:"):
            raise InvalidInput(f"{text!r}: digest references are not supported; "
                               f"use NAME:TAG or NAME#SNAPSHOT")
    else:
        slash = text.rfind("/")
        colon = text.rfind(":")
        if colon > slash:
            volume, branch = text[:colon], text[colon + 1:]
        else:
            volume, branch = text, default_tag
        volume = volume.replace("/", "_")
    try:
        check_volume(volume)
    except InvalidInput:
        raise InvalidInput(f"{text!r}: the image name {volume!r} is not a volume name "
                           f"(letters, digits, '.', '_', '-'; '/' becomes '_')") from None
    try:
        check_branch(branch)
    except InvalidInput:
        raise InvalidInput(f"{text!r}: the tag {branch!r} is not a branch name "
                           f"(letters, digits, '.', '_', '-', not starting with '.', '_' "
                           f"or '-')") from None
    return ImageRef(volume, branch, text)
