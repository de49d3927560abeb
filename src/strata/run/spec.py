"""Volume specs for `strata run -v`: NAME[@BRANCH][:ro|:rw][:exclusive][:run]."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from strata.engine.errors import InvalidInput
from strata.engine.names import check_branch, check_volume

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class VolumeSpec:
    volume: str
    branch: str = "live"
    writable: bool = True
    exclusive: bool = False
    run_scoped: bool = False

    @property
    def name(self) -> str:
        return self.volume


def parse_spec(text: str) -> VolumeSpec:
    head, *flags = text.split(":")
    volume, sep, branch = head.partition("@")
    check_volume(volume)
    if sep:
        check_branch(branch)
    else:
        branch = "live"
    writable, exclusive, run_scoped = True, False, False
    seen_mode = False
    for flag in flags:
        if flag in ("ro", "rw"):
            if seen_mode:
                raise InvalidInput(f"{text!r}: give :ro or :rw once")
            seen_mode, writable = True, flag == "rw"
        elif flag == "exclusive":
            exclusive = True
        elif flag == "run":
            run_scoped = True
        else:
            raise InvalidInput(f"{text!r}: unknown flag {flag!r} "
                               "(use :ro, :rw, :exclusive, :run)")
    if exclusive and not writable:
        raise InvalidInput(f"{text!r}: :exclusive needs a writable volume")
    return VolumeSpec(volume, branch, writable, exclusive, run_scoped)


IMAGE_NAME = ".image"  # the image's place among a step's mounts (no volume is named so)


def parse_image(text: str) -> VolumeSpec:
    """`--image VOLUME[@BRANCH]` or `NAME:TAG`: a volume holding a root filesystem.

    A bare NAME is the branch ``live``; the runner takes ``latest`` instead
    when the volume has only that (an image imported without a tag).
    """
    if "@" not in text and ":" in text:
        from strata.image.refs import parse_image_ref
        ref = parse_image_ref(text)
        return VolumeSpec(ref.volume, ref.branch, writable=False)
    volume, sep, branch = text.partition("@")
    check_volume(volume)
    if sep:
        check_branch(branch)
    return VolumeSpec(volume, branch if sep else "live", writable=False)
