"""A mount's recorded state: its scratch directory, `state.json`, and how to find it.

Each mount has a scratch directory (`STRATA_SCRATCH`, default
/var/tmp/strata/mounts/<id>) holding the FUSE lower mount point, one upper
and work directory per volume, and `state.json`: which snapshot each volume
is pinned to, which snapshot it last published, and the digest of what it
published (to tell uncommitted changes apart). The CLI finds a mount by its
mount point.

This module owns that record and the paths inside the scratch directory. It
never mounts, scans or publishes anything (mount/session.py does), and it
stays light: the step service imports it to check a request.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from dataclasses import dataclass, field, fields
from typing import Any

from strata.engine.errors import InvalidInput, NotFound


def scratch_root() -> str:
    return os.environ.get("STRATA_SCRATCH") or "/var/tmp/strata/mounts"


@dataclass
class VolumeState:
    name: str          # subdirectory name (multi-volume mounts) or "" for a single volume
    volume: str
    branch: str
    pinned: str        # the snapshot the lower view shows, for the mount's whole life
    base: str          # the snapshot this mount last published (or pinned)
    readonly: bool = False
    # A step's image: writable through a layer that is thrown away, never committed,
    # mounted beside the volumes (at the mount point's sibling "root"), not among them.
    throwaway: bool = False
    published: dict[str, str] = field(default_factory=dict)  # path -> digest, last commit


@dataclass
class MountState:
    id: str
    mountpoint: str
    scratch: str
    server: str | None
    volumes: list[VolumeState]
    single: bool = True
    pid: int = 0                # the mount process (the creator's, until it starts)
    # How the mount was made (these were state.json's "extra" object: see SETTINGS).
    token: str | None = None    # the bearer token the mount reads the store with
    store: str = ""             # the local store's directory, whose server may idle out
    keepalive: float = 0.0      # seconds between the mount process's keep-alive requests
    privileged: bool = False    # setuid bits and device nodes honoured (`--privileged`)
    # A step's mount (run/runner.py); a plain `strata mount` leaves these empty.
    run: str = ""               # the step's run id
    runner: int = 0             # the step's runner process
    stage: str = ""             # the step's staging directory, removed at teardown
    id_shift: int = 0           # the step's first id: owners appear shifted by it
    rw: str = ""                # a filesystem of its own for the writes (a step's --disk)
    pgid: int = 0               # the step's process group, while its command runs

    @property
    def is_step(self) -> bool:
        """A step's mount: never moved, never privileged, its writes volatile."""
        return bool(self.run)

    @property
    def guarded(self) -> bool:
        """Setuid bits and device nodes are only bytes (nosuid,nodev) on its volumes.

        Unless the mount was asked to honour them (`strata mount --privileged`);
        a step's volumes never do.
        """
        return self.is_step or not self.privileged

    @property
    def lower(self) -> str:
        return os.path.join(self.scratch, "lower")

    def upper(self, v: VolumeState) -> str:
        return os.path.join(self.scratch, self.rw, "upper", v.name or "_")

    def work(self, v: VolumeState) -> str:
        return os.path.join(self.scratch, self.rw, "work", v.name or "_")

    def target(self, v: VolumeState) -> str:
        if v.throwaway:
            return os.path.join(os.path.dirname(self.mountpoint), "root")
        return self.mountpoint if self.single else os.path.join(self.mountpoint, v.name)

    @property
    def committed(self) -> list[VolumeState]:
        """The volumes a commit publishes: writable ones that are not a throwaway layer."""
        return [v for v in self.volumes if not v.readonly and not v.throwaway]

    def statcache_path(self, v: VolumeState) -> str:
        """The volume's stat cache (mount/statcache.py): what its last commit read."""
        return os.path.join(self.scratch, "index", v.name or "_")

    def lower_of(self, v: VolumeState) -> str:
        return self.lower if self.single else os.path.join(self.lower, v.name)

    def save(self) -> None:
        # It may hold a bearer token: owner-only, like the directory around it.
        tmp = os.path.join(self.scratch, "state.json.tmp")
        # Fields one level deep, by hand: asdict() copies every published digest
        # recursively, and with indent json wrote one line per digest (together
        # a quarter of a second of each commit with 20k published files).
        doc = {f.name: getattr(self, f.name) for f in fields(self)}
        doc["volumes"] = [{f.name: getattr(v, f.name) for f in fields(v)} for v in self.volumes]
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write(json.dumps(doc, separators=(",", ":")))
        os.rename(tmp, os.path.join(self.scratch, "state.json"))

    @classmethod
    def load(cls, scratch: str) -> MountState:
        with open(os.path.join(scratch, "state.json")) as f:
            raw = json.load(f)
        # Written before the settings were fields: they sat in one "extra" object.
        extra = raw.pop("extra", None)
        if isinstance(extra, dict):
            for key in SETTINGS:
                if key in extra:
                    raw.setdefault(key, extra[key])
        raw["volumes"] = [VolumeState(**v) for v in raw["volumes"]]
        return cls(**raw)


# MountState's fields that say how the mount was made, not what it holds. state.json
# kept them in an "extra" object until they became fields; MountState.load still
# reads that. A move (mount/move.py) carries them to the new mount.
SETTINGS = ("token", "store", "keepalive", "privileged", "run", "runner", "stage",
            "id_shift", "rw", "pgid")


def new_state(mountpoint: str, server: str | None, volumes: list[VolumeState],
              single: bool, *, save: bool = True) -> MountState:
    """A new scratch directory and its state; `save=False` leaves state.json to the caller.

    The settings (token, a step's run id, ...) are set on the state by the
    caller, which then saves it.

    (A scratch without state.json is never swept: nobody can tell whose it is.)
    """
    mid = uuid.uuid4().hex[:12]
    root = scratch_root()
    os.makedirs(root, mode=0o700, exist_ok=True)
    scratch = os.path.join(root, mid)
    os.mkdir(scratch, 0o700)  # state.json (a token), the upper directory: owner only
    os.makedirs(os.path.join(scratch, "lower"), mode=0o700)
    for v in volumes:
        os.makedirs(os.path.join(scratch, "upper", v.name or "_"), mode=0o755)
        os.makedirs(os.path.join(scratch, "work", v.name or "_"), mode=0o700)
    state = MountState(mid, os.path.realpath(mountpoint), scratch, server, volumes, single,
                       os.getpid())
    if save:
        state.save()
    return state


@dataclass(frozen=True)
class MountRef:
    """One REF of `strata mount`, parsed: NAME=VOLUME[@BRANCH|#SNAPSHOT][:ro]."""

    name: str             # the subdirectory asked for ("" for the volume's name)
    volume: str
    branch: str | None    # None: a snapshot
    snapshot: str | None  # a snapshot id or unique prefix
    ro: bool = False


def mount_volumes(store: Any, refs: list[MountRef], *, ro: bool, single: bool
                  ) -> list[VolumeState]:
    """What each REF mounts, resolved to snapshots now (`store` is a RemoteStore)."""
    scope = store.whoami()
    vols: list[VolumeState] = []
    for ref in refs:
        readonly = ro or ref.ro or not scope.get("writable", True)
        if ref.branch is None and not readonly:
            raise InvalidInput(f"{ref.volume}#{ref.snapshot}: a writable mount needs a branch "
                               "(VOLUME or VOLUME@BRANCH); add :ro or --ro to mount a snapshot")
        if ref.snapshot is not None:
            store.list_branches(ref.volume)  # the volume must exist
            sid = store.find_snapshot(ref.snapshot)
        else:
            sid = store.head(ref.volume, ref.branch or "live")
        label = "" if single else (ref.name or ref.volume)
        if not single and label in {v.name for v in vols}:
            raise InvalidInput(f"two volumes would appear as {label!r}; name them NAME=REF")
        vols.append(VolumeState(label, ref.volume, ref.branch or "", sid, sid,
                                readonly=readonly))
    return vols


def find_mount(mountpoint: str) -> MountState:
    """The state of the strata mount at (or containing, for multi-volume) `mountpoint`."""
    real = os.path.realpath(mountpoint)
    root = scratch_root()
    if os.path.isdir(root):
        for mid in os.listdir(root):
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                st = MountState.load(os.path.join(root, mid))
                if st.mountpoint == real:
                    return st
    raise NotFound(f"{mountpoint} is not a strata mount")
