"""One step: pin volumes, mount them, run the command, publish or discard.

Exit status 0 publishes every changed read-write volume in one atomic
commit; any other outcome (non-zero exit, a signal, the memory limit, the
timeout, or the death of the runner, noticed by the mount process) publishes
nothing and removes the scratch data. A conflicting publish keeps the
rejected change set on `rejected/<run-id>` for inspection and exits 3.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from strata.engine.errors import Conflict, Expired, InvalidInput, StrataError, Unavailable
from strata.engine.interface import ChangeSet, Store
from strata.mount import mountinfo
from strata.mount.cache import trim_if_due
from strata.mount.overlay import unmount_under
from strata.mount.session import (
    SWEEP_AFTER,
    commit,
    limit_writes,
    remove_stage,
    sweep_abandoned_steps,
    teardown,
    uncommitted_changes,
    upload_changes,
)
from strata.mount.state import MountState, VolumeState, new_state, scratch_root
from strata.procs import alive
from strata.run.identity import STEPS_DIR, IdRange, UserNamespace, idmapped_mount, make_stage
from strata.run.imagecfg import image_process
from strata.run.sandbox import DEFAULT_PIDS, Jail, build_command, run_command
from strata.run.spec import IMAGE_NAME, VolumeSpec

if TYPE_CHECKING:
    from strata.mount.process import Prepared

log = logging.getLogger(__name__)

LEASE_TTL = 15.0
PIN_TTL = 60.0  # the step's base snapshots, renewed with the leases
CONFLICT_EXIT = 3


@dataclass
class StepResult:
    run_id: str
    status: int
    published: dict[str, str] = field(default_factory=dict)
    conflicts: list[str] = field(default_factory=list)
    rejected: dict[str, str] = field(default_factory=dict)
    timed_out: bool = False
    oom: bool = False
    timings: dict[str, float] = field(default_factory=dict)
    # With an image: what its boot trace did by the time the command ended
    # (mount/boottrace.py's events: "prefetch", "prefetched", "recorded").
    boot: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        doc = {"run": self.run_id, "status": self.status, "published": self.published,
               "conflicts": self.conflicts, "rejected": self.rejected,
               "timed_out": self.timed_out, "oom": self.oom, "timings": self.timings}
        if self.boot:
            doc["boot"] = self.boot
        return doc


class _Leases:
    """Leases held for :exclusive volumes, renewed in the background while the step runs."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.held: dict[str, tuple[str, str, str]] = {}  # name -> (volume, branch, lease id)
        self.pins: dict[str, list[str]] = {}  # volume -> pin ids (garbage collection)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost: list[str] = []

    def acquire(self, name: str, volume: str, branch: str, holder: str,
                wait: float) -> str:
        deadline = time.monotonic() + wait
        delay = 0.05
        while True:
            try:
                lease = self.store.acquire_lease(volume, branch, LEASE_TTL, holder)
                self.held[name] = (volume, branch, lease.id)
                return lease.id
            except Unavailable:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(delay)
                delay = min(delay * 2, 0.5)

    def pin(self, volume: str, sid: str) -> None:
        """Keep the step's base snapshot from garbage collection while it runs."""
        self.pins.setdefault(volume, []).extend(self.store.pin(volume, [sid], PIN_TTL))

    def unpin(self) -> None:
        for volume, pins in self.pins.items():
            with contextlib.suppress(StrataError):
                self.store.release_pins(volume, pins)
        self.pins.clear()

    def start(self) -> None:
        if self.held or self.pins:
            self._thread = threading.Thread(target=self._renew, daemon=True)
            self._thread.start()

    def _renew(self) -> None:
        while not self._stop.wait(LEASE_TTL / 3):
            for name, (volume, branch, lease) in list(self.held.items()):
                try:
                    self.store.renew_lease(volume, branch, lease, LEASE_TTL)
                except StrataError:
                    self.lost.append(name)
            for volume, pins in list(self.pins.items()):
                with contextlib.suppress(StrataError):  # a lost pin: the age cutoff remains
                    self.store.renew_pins(volume, pins, PIN_TTL)

    def tokens(self) -> dict[str, str]:
        return {name: f for name, (_v, _b, f) in self.held.items()}

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for volume, branch, lease in self.held.values():
            with contextlib.suppress(StrataError):
                self.store.release_lease(volume, branch, lease)
        self.held.clear()
        self.unpin()


def _pinned_heads(store: Store, specs: list[VolumeSpec], leases: _Leases) -> list[str]:
    """The heads at one instant, each pinned.

    A head that moved and was collected in between is read again.
    """
    for _ in range(5):
        heads = store.heads([(spec.volume, spec.branch) for spec in specs])
        try:
            for spec, head in zip(specs, heads, strict=True):
                leases.pin(spec.volume, head)
            return heads
        except Expired:
            leases.unpin()
    raise Unavailable("the branches keep moving while garbage collection runs; retry")


def run_step(store: Store, specs: list[VolumeSpec], argv: list[str], *, sandbox: str = "bwrap",
             timeout: float | None = None, memory: int | None = None, network: bool = False,
             lease_wait: float = 600.0, message: str | None = None,
             identical: bool = False, mounter: Prepared | None = None,
             mounter_env: bool = False,
             on_publish: Callable[[], None] | None = None,
             on_done: Callable[[StepResult], None] | None = None,
             root: tuple[str, str] | None = None, pids: int | None = DEFAULT_PIDS,
             disk: int | None = None, image: VolumeSpec | None = None,
             takeover: bool = False, entrypoint: str | None = None) -> StepResult:
    """Run `argv` as one transaction over `specs` (see the module docstring).

    `mounter` is a mount process forked already (the step service forks it
    before a client arrives), which with `mounter_env` takes this process's
    environment when it is handed the mount; `on_publish` is called just
    before the publish is sent, `on_done` with the final result before the
    mount is torn down (the service answers its client then).

    With `root` (a workspace's volume and branch) the workspace is the
    sandbox's whole root and the volumes are at /storage in it. The root is
    durable, not part of the transaction: it is detached (flushed) when the
    command ends, whatever its status, and only then are the volumes
    published (exit 0) or dropped.

    With `image` (a volume holding a root filesystem) the sandbox's root is
    that volume as of the step's start, mounted lazily like any volume, with
    a writable layer that is thrown away: only the volumes persist. An
    imported image's config gives the command, environment, directory and
    user (run/imagecfg.py); `entrypoint` replaces its Entrypoint and Cmd.
    """
    if image is not None and root is not None:
        raise InvalidInput("give a workspace root or an image, not both")
    from strata.mount.process import Prepared
    from strata.server.client import RemoteStore
    if not isinstance(store, RemoteStore):
        raise StrataError("steps need a store server (the mount process reads through it)")
    if disk is not None and not 1 << 20 <= disk <= 1 << 50:
        raise InvalidInput("--disk takes 1M to 1P bytes")
    t0 = time.monotonic()
    run_id = uuid.uuid4().hex[:12]
    result = StepResult(run_id, 0)
    # Wall-clock time the runner began, to set against timestamps the command takes.
    result.timings["began"] = time.time()
    leases = _Leases(store)
    state: MountState | None = None
    # The mount process first: it loads the FUSE stack while this one pins and forks.
    if mounter is None:
        mounter = Prepared(watch_pid=os.getpid())
    sweep_abandoned_steps()  # what runners killed at the wrong moment left behind
    ws_root = (_WorkspaceRoot(store, *root, run_id, takeover=takeover) if root is not None
               else None)
    jail = StepJail(sandbox, run_id)
    try:
        for spec in specs:
            if spec.exclusive and not spec.run_scoped:
                leases.acquire(spec.name, spec.volume, spec.branch, f"run {run_id}",
                               lease_wait)
        # One instant for every volume: a multi-volume publish is seen whole or not at
        # all (heads read one by one could fall between its branches).
        if image is not None and image.branch == "live":
            image = _image_branch(store, image)
        pinned = _pinned_heads(store, specs + ([image] if image is not None else []), leases)
        process = None
        if image is not None:  # the image's own command, environment, directory and user
            from strata.image.meta import find_meta, runtime_of
            process = image_process(runtime_of(find_meta(store, pinned[-1])), argv,
                                    entrypoint=entrypoint)
            argv = process.argv
        vols = []
        for spec, head in zip(specs, pinned[:len(specs)], strict=True):
            branch = spec.branch
            if spec.run_scoped:
                branch = f"run/{run_id}"
                store.fork(spec.volume, branch, at=head)
                if spec.exclusive:
                    leases.acquire(spec.name, spec.volume, branch, f"run {run_id}",
                                   lease_wait)
            vols.append(VolumeState(spec.name, spec.volume, branch, head, head,
                                    readonly=not spec.writable))
        if image is not None:
            vols.append(VolumeState(IMAGE_NAME, image.volume, image.branch, pinned[-1],
                                    pinned[-1], throwaway=True))
        leases.start()
        # Everything of the step lives in the mount's scratch directory (the volume
        # directory, the OCI bundle, runsc's state), so the mount process's teardown
        # removes it all when this runner dies.
        jail.open()
        storage = os.path.join(jail.stage, "storage")
        os.mkdir(storage, 0o755)
        state = st = new_state(storage, store.url, vols, single=False, save=False)
        st.run, st.runner, st.stage = run_id, os.getpid(), jail.stage
        # The mount shows owners as the step's ids.
        st.id_shift = jail.id_base or 0
        if disk is not None:
            limit_writes(st, disk)  # the step's writes on a filesystem of that size
        st.token = store.token
        st.save()
        error = mounter.start_mount(st, dict(os.environ) if mounter_env else None)
        if error is not None:
            raise StrataError(f"could not mount the step's volumes: {error}")
        # The mount process recorded its pid; keep it when this runner saves the state
        # again (a sweep must see that someone still owns this scratch).
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            st.pid = type(st).load(st.scratch).pid
        if image is not None:
            jail.show_root(st.target(vols[-1]), throwaway=True)
        if ws_root is not None:
            ws_root.attach()
            os.makedirs(os.path.join(ws_root.dir, "storage"), exist_ok=True)  # mount point
            jail.show_root(ws_root.dir)
        launch = build_command(sandbox, argv, storage, network=network,
                               workdir=state.scratch, run_id=run_id, memory=memory,
                               jail=jail.jail, pids=pids, image=process)
        result.timings["start"] = time.monotonic() - t0
        t1 = time.monotonic()

        def started(pgid: int) -> None:
            # The mount process kills this group if the runner dies before it ends.
            st.pgid = pgid
            st.save()

        try:
            outcome = run_command(launch, cwd=storage, timeout=timeout, memory=memory,
                                  pids=pids, cgroup_name=f"strata-{run_id}", on_start=started)
        finally:
            jail.started()
        t2 = time.monotonic()
        state.pgid = 0
        state.save()
        result.timings["command"] = t2 - t1
        result.status, result.timed_out, result.oom = (outcome.status, outcome.timed_out,
                                                       outcome.oom)
        if result.timed_out:
            result.status = 124  # as coreutils timeout(1) reports it
        if image is not None:
            result.boot = _boot_events(state)
        jail.hide_root()  # before the workspace's own unmount, which it would hold up
        root_head = ws_root.detach() if ws_root is not None else None
        if result.status == 0:
            if leases.lost:
                raise Unavailable(f"lost the lease on {', '.join(leases.lost)}; not publishing")
            if on_publish is not None:
                on_publish()
            _publish(store, state, result, argv, message, leases.tokens(), identical)
        if ws_root is not None and root_head is not None:
            result.published[ws_root.volume] = root_head  # durable whatever the status
        if result.status not in (0, CONFLICT_EXIT):  # a conflict is announced by the server
            _announce_failure(store, state, result, argv)
        result.timings["finish"] = time.monotonic() - t2
        if on_done is not None:
            on_done(result)
        return result
    finally:
        jail.hide_root()
        if ws_root is not None:
            ws_root.close()
        mounter.cancel()  # a mount process never handed a state exits
        if state is not None:
            try:
                teardown(state, lazy=True)  # also removes the stage
            except Exception:  # the step's answer stands; the sweep removes what is left
                log.warning("teardown of step %s failed", state.mountpoint, exc_info=True)
        jail.close()
        leases.release()
        if state is not None:
            shutil.rmtree(state.scratch, ignore_errors=True)
            # Step mounts do not measure the content cache: keep it bounded from here.
            with contextlib.suppress(OSError):
                trim_if_due()


def _image_branch(store: Store, image: VolumeSpec) -> VolumeSpec:
    """A bare `--image NAME`: its ``live`` branch, or ``latest`` when it has only that."""
    branches = store.list_branches(image.volume)
    if "live" not in branches and "latest" in branches:
        return dataclasses.replace(image, branch="latest")
    return image


class StepJail:
    """The runner's side of a step's sandbox: its staging directory, id range, namespace.

    A bwrap step gets a host id range of its own and a user namespace over
    it, and its staging directory belongs to that range's root; a workspace
    root is shown to it through an idmapped mount in that directory. gVisor
    and `none` steps get the staging directory alone (root's, 0700).
    """

    def __init__(self, sandbox: str, run_id: str) -> None:
        self.sandbox, self.run_id = sandbox, run_id
        self.jail: Jail | None = None
        self._ids: IdRange | None = None
        self._userns: UserNamespace | None = None
        self._view: str | None = None

    @property
    def stage(self) -> str:
        assert self.jail is not None
        return self.jail.stage

    @property
    def id_base(self) -> int:
        return self.jail.id_base if self.jail is not None else 0

    def open(self) -> None:
        if self.sandbox == "bwrap":
            self._ids = IdRange.allocate()
            self._userns = UserNamespace(self._ids.base)
            stage = make_stage(self.run_id, self._ids.base)
            self.jail = Jail(stage, self._userns.path, self._ids.base)
        else:
            self.jail = Jail(make_stage(self.run_id, None))

    def show_root(self, root_dir: str, *, throwaway: bool = False) -> None:
        """Make the mounted filesystem at `root_dir` the sandbox's root.

        A `throwaway` root (an image's overlay, in the stage already, owners
        shifted like the volumes') is used as it is; a workspace is shown to
        a bwrap step through an idmapped mount.
        """
        assert self.jail is not None
        if throwaway or self._userns is None:
            # (gVisor's gofer serves a workspace as it is)
            self.jail.root = root_dir
            return
        view = os.path.join(self.jail.stage, "root")
        os.mkdir(view, 0o755)
        idmapped_mount(root_dir, view, self._userns.fd)
        self._view = self.jail.root = view

    def started(self) -> None:
        """The command has its descriptors: ours can go."""
        if self.jail is not None:
            for fd in self.jail.fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            self.jail.fds.clear()

    def hide_root(self) -> None:
        if self._view is not None:
            unmount_under(self._view)
            self._view = None

    def close(self) -> None:
        self.started()
        self.hide_root()
        if self.jail is not None:
            remove_stage(self.jail.stage)
        if self._userns is not None:
            self._userns.close()
            self._userns = None
        if self._ids is not None:
            self._ids.close()
            self._ids = None


class _WorkspaceRoot:
    """A workspace attached as a command's whole root, for the length of a step.

    It is attached outside the step's scratch directory: a teardown that
    removes the scratch must never reach into a workspace still mounted. This
    process owns the attach: if it dies, the attach daemon detaches by itself
    (which flushes) once the command's processes, which die with it, are gone,
    and the next step with a workspace root sweeps the directory.
    """

    def __init__(self, store: Store, volume: str, branch: str, run_id: str, *,
                 takeover: bool = False) -> None:
        from strata.server.client import RemoteStore
        if not isinstance(store, RemoteStore):
            raise StrataError("a workspace root needs a store server")
        self.store, self.volume, self.branch = store, volume, branch
        self.takeover = takeover
        _sweep_workspace_roots()  # what earlier runners of `--root` that died left
        self.work = os.path.join(scratch_root(), f"root-{run_id}")
        self.dir = os.path.join(self.work, "root")
        self.attached = False

    def attach(self) -> None:
        from strata.server.client import RemoteStore
        from strata.workspace.attach import attach
        from strata.workspace.state import attached
        assert isinstance(self.store, RemoteStore)
        if not self.takeover:
            for att in attached():
                if (att.volume, att.branch) == (self.volume, self.branch) and alive(att.pid) \
                        and not att.snapshot:
                    raise InvalidInput(
                        f"ws:{self.volume}@{self.branch} is attached at {att.dir} on this "
                        "host: detach it first, or pass --takeover to fence that attach "
                        "(what is written there after is then dropped)")
        os.makedirs(self.dir)
        with open(os.path.join(self.work, "runner"), "w") as f:
            f.write(str(os.getpid()))
        try:
            attach(self.store.url, self.store.token, self.volume, self.branch, self.dir,
                   owner=os.getpid())
        except BaseException:
            self._clean()
            raise
        self.attached = True

    def __enter__(self) -> _WorkspaceRoot:
        self.attach()
        return self

    def detach(self) -> str:
        """Detach (which flushes everything the command wrote); the workspace's head."""
        from strata.workspace.attach import detach
        if self.attached:
            self.attached = False
            detach(self.dir)
        return self.store.head(self.volume, self.branch)

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Detach if still attached (errors ignored: the step is failing), then clean up."""
        try:
            if self.attached:
                try:
                    self.detach()
                except Exception:
                    log.warning("detaching the workspace root %s failed", self.dir,
                                exc_info=True)
        finally:
            self._clean()

    def _clean(self) -> None:
        _remove_root_work(self.work)


def _remove_root_work(work: str) -> None:
    with contextlib.suppress(OSError):
        os.rmdir(os.path.join(work, "root"))  # only when empty: never into a mounted workspace
    shutil.rmtree(os.path.join(work, "bundle"), ignore_errors=True)
    shutil.rmtree(os.path.join(work, "runsc-root"), ignore_errors=True)
    with contextlib.suppress(OSError):
        os.unlink(os.path.join(work, "runner"))
    with contextlib.suppress(OSError):
        os.rmdir(work)


def _sweep_workspace_roots() -> None:
    """Remove what runners of `--root` steps that died left: their attach is gone by now.

    Only once the runner is gone, nothing is mounted beneath (its attach
    daemon detached by itself) and nothing changed for SWEEP_AFTER seconds.
    """
    root = scratch_root()
    try:
        names = [n for n in os.listdir(root) if n.startswith("root-")]
    except OSError:
        return
    if not names:
        return
    mounted = [m.point for m in mountinfo.read()]
    for name in names:
        work = os.path.join(root, name)
        try:
            if time.time() - os.stat(work).st_mtime < SWEEP_AFTER:
                continue
            with open(os.path.join(work, "runner")) as f:
                runner = int(f.read())
        except (OSError, ValueError):
            continue
        if alive(runner) or any(mp == work or mp.startswith(work + "/") for mp in mounted):
            continue
        # The staging directory of the step that made it (named by its run id).
        remove_stage(os.path.join(STEPS_DIR, name.removeprefix("root-")))
        _remove_root_work(work)


def run_in_workspace(store: Store, volume: str, branch: str, argv: list[str], *,
                     sandbox: str = "bwrap", timeout: float | None = None,
                     memory: int | None = None, network: bool = False,
                     pids: int | None = DEFAULT_PIDS, takeover: bool = False) -> StepResult:
    """Run `argv` with an attached workspace as the sandbox's whole root filesystem.

    A workspace is durable, not transactional: what the command wrote stays,
    whatever its exit status, as on a machine's disk. The workspace is
    attached for the command (fencing any other holder) and detached after,
    which flushes it. `run_step(..., root=...)` adds volumes beside it.
    """
    t0 = time.monotonic()
    run_id = uuid.uuid4().hex[:12]
    result = StepResult(run_id, 0)
    if sandbox not in ("bwrap", "gvisor"):
        raise InvalidInput(f"a workspace root needs a sandbox (bwrap or gvisor), "
                           f"not {sandbox!r}")
    jail = StepJail(sandbox, run_id)
    try:
        with _WorkspaceRoot(store, volume, branch, run_id, takeover=takeover) as root:
            jail.open()
            jail.show_root(root.dir)
            launch = build_command(sandbox, argv, "", network=network, workdir=root.work,
                                   run_id=run_id, memory=memory, jail=jail.jail, pids=pids)
            result.timings["start"] = time.monotonic() - t0
            t1 = time.monotonic()
            try:
                outcome = run_command(launch, cwd="/", timeout=timeout, memory=memory,
                                      pids=pids, cgroup_name=f"strata-{run_id}")
            finally:
                jail.started()
            result.timings["command"] = time.monotonic() - t1
            jail.hide_root()
            result.published = {volume: root.detach()}
    finally:
        jail.close()
    result.status, result.timed_out, result.oom = (outcome.status, outcome.timed_out,
                                                   outcome.oom)
    if result.timed_out:
        result.status = 124
    return result


def _boot_events(state: MountState) -> list[dict[str, Any]]:
    """What the image's boot trace did so far, as the mount process noted it (best effort)."""
    import json
    out: list[dict[str, Any]] = []
    with contextlib.suppress(OSError, ValueError):
        with open(os.path.join(state.scratch, "boot-trace.json")) as f:
            out = [json.loads(line) for line in f.read().splitlines()[:16] if line]
    return out


def _announce_failure(store: Store, state: MountState, result: StepResult,
                      argv: list[str]) -> None:
    """Tell `watch` and the web view that this step ended without publishing (best effort)."""
    note = getattr(store, "note_step", None)
    if note is None:
        return
    for v in state.committed:
        with contextlib.suppress(StrataError, OSError):
            note(v.volume, v.branch, result.run_id, result.status, timed_out=result.timed_out,
                 oom=result.oom, argv=argv)


def _publish(store: Store, state: MountState, result: StepResult, argv: list[str],
             message: str | None, leases: dict[str, str], identical: bool) -> None:
    msg = message or f"run {result.run_id}: {' '.join(argv)[:200]}"
    meta = {"run": result.run_id, "argv": argv[:64]}
    try:
        done = commit(store, state, message=msg, meta=meta, leases=leases, identical=identical,
                      remember=False)
        result.published = {name: sid for name, sid in done.published.items()
                            if any(v.name == name for v in state.committed)}
    except Conflict as exc:
        result.status = CONFLICT_EXIT
        result.conflicts = exc.paths
        _keep_rejected(store, state, result, msg, meta)


def _keep_rejected(store: Store, state: MountState, result: StepResult, msg: str,
                   meta: dict[str, Any]) -> None:
    """Publish the refused change sets on rejected/<run-id>, from the snapshots they saw."""
    branch = f"rejected/{result.run_id}"
    for v in state.committed:
        changes, scan = uncommitted_changes(store, state, v, cache=False)
        if not changes:
            continue
        with contextlib.suppress(StrataError):
            store.fork(v.volume, branch, at=v.pinned)
            upload = upload_changes(store, changes, scan)  # batched, bounded memory
            (sid,) = store.publish([ChangeSet(v.volume, branch, v.pinned, changes,
                                              f"rejected: {msg}", meta)], upload)
            result.rejected[v.name] = sid
