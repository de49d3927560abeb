"""One step: pin volumes, mount them, run the command, publish or discard.

Exit status 0 publishes every changed read-write volume in one atomic
commit; any other outcome (non-zero exit, a signal, the memory limit, the
timeout, or the death of the runner, noticed by the mount process) publishes
nothing and removes the scratch data. A conflicting publish keeps the
rejected change set on `rejected/<run-id>` for inspection and exits 3.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from strata.engine.errors import Conflict, Expired, StrataError, Unavailable
from strata.engine.interface import ChangeSet, Store
from strata.mount.cache import trim_if_due
from strata.mount.session import (
    SWEEP_AFTER,
    MountState,
    VolumeState,
    commit,
    new_state,
    pending,
    scratch_root,
    sweep_abandoned_steps,
    teardown,
    upload_changes,
)
from strata.procs import alive
from strata.run.sandbox import build_command, run_command
from strata.run.spec import VolumeSpec

if TYPE_CHECKING:
    from strata.mount.process import Prepared

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

    def to_json(self) -> dict[str, Any]:
        return {"run": self.run_id, "status": self.status, "published": self.published,
                "conflicts": self.conflicts, "rejected": self.rejected,
                "timed_out": self.timed_out, "oom": self.oom, "timings": self.timings}


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
             root: tuple[str, str] | None = None) -> StepResult:
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
    """
    from strata.mount.process import Prepared
    from strata.server.client import RemoteStore
    if not isinstance(store, RemoteStore):
        raise StrataError("steps need a store server (the mount process reads through it)")
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
    ws_root = _WorkspaceRoot(store, *root, run_id) if root is not None else None
    try:
        for spec in specs:
            if spec.exclusive and not spec.run_scoped:
                leases.acquire(spec.name, spec.volume, spec.branch, f"run {run_id}",
                               lease_wait)
        # One instant for every volume: a multi-volume publish is seen whole or not at
        # all (heads read one by one could fall between its branches).
        pinned = _pinned_heads(store, specs, leases)
        vols = []
        for spec, head in zip(specs, pinned, strict=True):
            branch = spec.branch
            if spec.run_scoped:
                branch = f"run/{run_id}"
                store.fork(spec.volume, branch, at=head)
                if spec.exclusive:
                    leases.acquire(spec.name, spec.volume, branch, f"run {run_id}",
                                   lease_wait)
            vols.append(VolumeState(spec.name, spec.volume, branch, head, head,
                                    readonly=not spec.writable))
        leases.start()
        # Everything of the step lives in the mount's scratch directory (the volume
        # directory, the OCI bundle, runsc's state), so the mount process's teardown
        # removes it all when this runner dies.
        state = st = new_state(os.path.join(scratch_root(), "_"), store.url, vols,
                               single=False, extra={"run": run_id, "runner": os.getpid()},
                               save=False)
        storage = os.path.join(st.scratch, "storage")
        os.mkdir(storage, 0o755)
        st.mountpoint = storage
        st.extra["token"] = store.token
        st.save()
        error = mounter.go(st, dict(os.environ) if mounter_env else None)
        if error is not None:
            raise StrataError(f"could not mount the step's volumes: {error}")
        # The mount process recorded its pid; keep it when this runner saves the state
        # again (a sweep must see that someone still owns this scratch).
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            st.pid = type(st).load(st.scratch).pid
        if ws_root is not None:
            ws_root.attach()
            os.makedirs(os.path.join(ws_root.dir, "storage"), exist_ok=True)  # mount point
        cmd, env = build_command(sandbox, argv, storage, network=network,
                                 workdir=state.scratch, run_id=run_id, memory=memory,
                                 root=ws_root.dir if ws_root is not None else None)
        result.timings["start"] = time.monotonic() - t0
        t1 = time.monotonic()

        def started(pgid: int) -> None:
            # The mount process kills this group if the runner dies before it ends.
            st.extra["pgid"] = pgid
            st.save()

        outcome = run_command(cmd, env, cwd=storage, timeout=timeout, memory=memory,
                              cgroup_name=f"strata-{run_id}", on_start=started)
        t2 = time.monotonic()
        state.extra.pop("pgid", None)
        state.save()
        result.timings["command"] = t2 - t1
        result.status, result.timed_out, result.oom = (outcome.status, outcome.timed_out,
                                                       outcome.oom)
        if result.timed_out:
            result.status = 124  # as coreutils timeout(1) reports it
        root_head = ws_root.detach() if ws_root is not None else None
        if result.status == 0:
            if leases.lost:
                raise Unavailable(f"lost the lease on {', '.join(leases.lost)}; not publishing")
            if on_publish is not None:
                on_publish()
            _publish(store, state, result, argv, message, leases.tokens(), identical)
        if ws_root is not None and root_head is not None:
            result.published[ws_root.volume] = root_head  # durable whatever the status
        result.timings["finish"] = time.monotonic() - t2
        if on_done is not None:
            on_done(result)
        return result
    finally:
        if ws_root is not None:
            ws_root.close()
        mounter.cancel()  # a mount process never handed a state exits
        if state is not None:
            with contextlib.suppress(Exception):
                teardown(state, lazy=True)
        leases.release()
        if state is not None:
            shutil.rmtree(state.scratch, ignore_errors=True)
            # Step mounts do not measure the content cache: keep it bounded from here.
            with contextlib.suppress(OSError):
                trim_if_due()


class _WorkspaceRoot:
    """A workspace attached as a command's whole root, for the length of a step.

    It is attached outside the step's scratch directory: a teardown that
    removes the scratch must never reach into a workspace still mounted. This
    process owns the attach: if it dies, the attach daemon detaches by itself
    (which flushes) once the command's processes, which die with it, are gone,
    and the next step with a workspace root sweeps the directory.
    """

    def __init__(self, store: Store, volume: str, branch: str, run_id: str) -> None:
        from strata.server.client import RemoteStore
        if not isinstance(store, RemoteStore):
            raise StrataError("a workspace root needs a store server")
        self.store, self.volume, self.branch = store, volume, branch
        _sweep_workspace_roots()  # what earlier runners of `--root` that died left
        self.work = os.path.join(scratch_root(), f"root-{run_id}")
        self.dir = os.path.join(self.work, "root")
        self.attached = False

    def attach(self) -> None:
        from strata.server.client import RemoteStore
        from strata.workspace.attach import attach
        assert isinstance(self.store, RemoteStore)
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
                with contextlib.suppress(Exception):
                    self.detach()
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
    with open("/proc/self/mountinfo") as f:
        mounted = [line.split()[4] for line in f]
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
        _remove_root_work(work)


def run_in_workspace(store: Store, volume: str, branch: str, argv: list[str], *,
                     sandbox: str = "bwrap", timeout: float | None = None,
                     memory: int | None = None, network: bool = False) -> StepResult:
    """Run `argv` with an attached workspace as the sandbox's whole root filesystem.

    A workspace is durable, not transactional: what the command wrote stays,
    whatever its exit status, as on a machine's disk. The workspace is
    attached for the command (fencing any other holder) and detached after,
    which flushes it. `run_step(..., root=...)` adds volumes beside it.
    """
    t0 = time.monotonic()
    run_id = uuid.uuid4().hex[:12]
    result = StepResult(run_id, 0)
    with _WorkspaceRoot(store, volume, branch, run_id) as root:
        cmd, env = build_command(sandbox, argv, "", network=network, workdir=root.work,
                                 run_id=run_id, memory=memory, root=root.dir)
        result.timings["start"] = time.monotonic() - t0
        t1 = time.monotonic()
        outcome = run_command(cmd, env, cwd=root.dir, timeout=timeout, memory=memory,
                              cgroup_name=f"strata-{run_id}")
        result.timings["command"] = time.monotonic() - t1
        result.published = {volume: root.detach()}
    result.status, result.timed_out, result.oom = (outcome.status, outcome.timed_out,
                                                   outcome.oom)
    if result.timed_out:
        result.status = 124
    return result


def _publish(store: Store, state: MountState, result: StepResult, argv: list[str],
             message: str | None, leases: dict[str, str], identical: bool) -> None:
    msg = message or f"run {result.run_id}: {' '.join(argv)[:200]}"
    meta = {"run": result.run_id, "argv": argv[:64]}
    try:
        done = commit(store, state, message=msg, meta=meta, leases=leases, identical=identical,
                      remember=False)
        result.published = {name: sid for name, sid in done.published.items()
                            if any(v.name == name and not v.readonly for v in state.volumes)}
    except Conflict as exc:
        result.status = CONFLICT_EXIT
        result.conflicts = exc.paths
        _keep_rejected(store, state, result, msg, meta)


def _keep_rejected(store: Store, state: MountState, result: StepResult, msg: str,
                   meta: dict[str, Any]) -> None:
    """Publish the refused change sets on rejected/<run-id>, from the snapshots they saw."""
    branch = f"rejected/{result.run_id}"
    for v in state.volumes:
        if v.readonly:
            continue
        changes, scan = pending(store, state, v, cache=False)
        if not changes:
            continue
        with contextlib.suppress(StrataError):
            store.fork(v.volume, branch, at=v.pinned)
            upload = upload_changes(store, changes, scan)  # batched, bounded memory
            (sid,) = store.publish([ChangeSet(v.volume, branch, v.pinned, changes,
                                              f"rejected: {msg}", meta)], upload)
            result.rejected[v.name] = sid
