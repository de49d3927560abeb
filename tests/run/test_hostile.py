"""Hostile steps: real attack code in real bwrap and gVisor sandboxes, every attempt recorded.

`hostile_step.py` runs inside the sandbox as `python3 -c SOURCE TARGETS` and tries
to get out: the store's sockets and files, another running step's scratch
files, host files and processes, devices, mounts, namespaces, setuid binaries
planted in a volume, /sys and /proc/sys, the keyring, raw sockets and host
loopback services (its docstring lists them all). The test finds the targets
on the host, runs the probe as a step, prints every attempt (`pytest -s` shows
the table) and fails naming each attack that succeeded. After the probe the
store must be as the test left it (apart from what the probe itself could
publish to `v`) and `strata fsck` must pass. A fork bomb under `--pids 256`
and a disk fill under `--disk 64M` must hit their limits and leave the host
and the store unharmed; the same probe runs in a workspace root too.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from run_harness import StepEnv, StepResult, wait_for

HOSTILE = Path(__file__).with_name("hostile_step.py")
SOURCE = HOSTILE.read_text()
# The step's PATH: python3 is the system's /usr/bin/python3 in every sandbox (not this
# venv's interpreter, and not a pyenv shim under a /root the sandbox should not show).
STEP_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
MIB = 1 << 20

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bwrap not installed")
SANDBOXES = [pytest.param("bwrap", marks=needs_bwrap),
             pytest.param("gvisor", marks=pytest.mark.skipif(
                 shutil.which("runsc") is None, reason="gVisor (runsc) is not installed"))]

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="planting a setuid-root binary and a device node needs root")

# Every kind of attack the probe must have tried (a probe that silently skipped
# some would pass for the wrong reason).
ATTACKS = {"mountinfo-leak", "shared-namespace", "unix-connect", "tcp-connect", "read-file",
           "list-dir", "search-secret", "proc1-root", "proc1-environ", "proc-environ",
           "proc-root", "ptrace-attach", "mknod", "mount-tmpfs", "unshare-userns",
           "open-loop-control", "setuid-exec", "open-planted-device", "write-sys",
           "make-cgroup", "keyctl", "add-key", "raw-socket", "packet-socket"}


def hostile_cmd(targets: dict[str, Any]) -> list[str]:
    return ["python3", "-c", SOURCE, json.dumps(targets)]


def report_of(r: StepResult, key: str) -> dict[str, Any]:
    """The hostile program's one JSON line (the last line of the step's own output)."""
    for line in reversed(r.stdout.splitlines()):
        if line.startswith("{") and f'"{key}"' in line:
            answer: dict[str, Any] = json.loads(line)
            return answer
    raise AssertionError(f"the hostile program gave no report (step exit {r.rc})\n"
                         f"stdout: {r.stdout[-2000:]}\nstderr: {r.stderr[-4000:]}")


def table(title: str, attempts: list[dict[str, Any]]) -> str:
    lines = [f"== hostile probe: {title}: {len(attempts)} attempts, "
             f"{sum(a['succeeded'] for a in attempts)} succeeded"]
    for a in attempts:
        outcome = "SUCCEEDED" if a["succeeded"] else "blocked"
        lines.append(f"  {outcome:9} {a['name']:19} {a['target'][:70]:70} {a['detail'][:160]}")
    return "\n".join(lines)


# ------------------------------------------------------------------ the host's side


@dataclass
class World:
    """What the test set up on the host for a probe, and the targets it hands the probe."""

    targets: dict[str, Any]
    env: dict[str, str]
    victim: subprocess.Popen[str]
    planted: list[str] = field(default_factory=list)


def head_hex(path: Path, n: int = 16) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(n).hex()
    except OSError:
        return ""


def proc_start(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rpartition(b")")[2].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def host_pids(store: Path, known: dict[int, str]) -> list[dict[str, Any]]:
    """Host processes worth attacking: strata's own for this store, and the test's."""
    found = dict(known)
    try:
        found.setdefault(int((store / "lock").read_text().split()[0]), "store server")
    except (OSError, ValueError, IndexError):
        pass
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
        except OSError:
            continue
        if str(store).encode() in cmdline:
            found.setdefault(int(name), "strata: " + cmdline.replace(b"\0", b" ")[-60:].decode(
                errors="replace"))
    return [{"pid": pid, "start": proc_start(pid), "what": what}
            for pid, what in sorted(found.items()) if proc_start(pid) is not None]


def host_unix_sockets(store: Path, limit: int = 200) -> list[str]:
    """Path and abstract (@name) sockets of the host's /proc/net/unix, the store's first."""
    found = [str(p) for p in sorted(store.glob("*.sock*"))]
    with open("/proc/net/unix") as f:
        for line in f.read().splitlines()[1:]:
            parts = line.split(None, 7)
            if len(parts) == 8:
                found.append(parts[7])
    return list(dict.fromkeys(found))[:limit]


def files_under(top: Path, limit: int = 50) -> list[Path]:
    out: list[Path] = []
    for dirpath, _dirs, names in os.walk(top):
        out += [Path(dirpath, n) for n in sorted(names)]
        if len(out) >= limit:
            break
    return out[:limit]


def listing(path: Path, first: str | None = None) -> list[str]:
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return []
    if first is not None and first in names:  # the one name that must be in the sample
        names.remove(first)
        names.insert(0, first)
    return names[:200]


def plant(senv: StepEnv) -> list[str]:
    """A setuid-root copy of id(1) and a 0666 /dev/loop-control node (10,237) in `v`."""
    d = senv.root / "plant"
    d.mkdir()
    shutil.copy2("/usr/bin/id", d / "suid-id")
    os.chown(d / "suid-id", 0, 0)
    os.chmod(d / "suid-id", 0o4755)
    os.mknod(d / "loopctl", stat.S_IFCHR | 0o666, os.makedev(10, 237))
    os.chmod(d / "loopctl", 0o666)
    senv.run("import", "v", str(d))
    entries = {e["name"]: e for e in json.loads(senv.run("ls", "v", "--json").stdout)}
    # The attacks below are only meaningful if the store kept what was planted.
    assert entries["suid-id"]["mode"] == "4755" and entries["suid-id"]["uid"] == 0, entries
    assert entries["loopctl"]["type"] == "chardev" and entries["loopctl"]["rdev"] == [10, 237]
    return sorted(entries)


@contextmanager
def hostile_world(senv: StepEnv, sandbox: str, victim_sandbox: str | None = None
                  ) -> Iterator[World]:
    """Secrets, planted files, a listener, a running victim step: the probe's targets."""
    with ExitStack() as stack:
        marker = "strata-hostile-marker-" + secrets.token_hex(12)
        env = {"PATH": STEP_PATH, "STRATA_HOSTILE_MARKER": marker}
        store_secret = "strata-hostile-secret-" + secrets.token_hex(16)
        senv.run("volume", "create", "secret")
        senv.run("put", "secret", "s.txt", input=store_secret + "\n")
        planted = plant(senv)

        # A secret on the host outside the test's /tmp, where a sandbox that shows the
        # host's root would show it.
        host_dir = Path(tempfile.mkdtemp(prefix="strata-hostile-", dir="/var/tmp"))
        stack.callback(shutil.rmtree, host_dir, True)
        host_secret = "strata-hostile-host-" + secrets.token_hex(16)
        (host_dir / "secret").write_text(host_secret + "\n")

        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        stack.callback(listener.close)
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)

        victim = senv.start_step(["secret"], ["sh", "-c", "echo draft > /storage/secret/draft; "
                                              "exec sleep 30"], victim_sandbox or sandbox,
                                 env=env)

        def stop_victim() -> None:
            if victim.poll() is None:
                victim.kill()
            victim.communicate(timeout=60)
            wait_for(lambda: senv.leftovers() == ([], []), 30)

        stack.callback(stop_victim)
        assert wait_for(lambda: bool(senv.written("secret", "draft")), 60), (
            "the victim step never wrote its draft", victim.poll(),
            victim.communicate()[1][-2000:] if victim.poll() is not None else "")
        (draft,) = senv.written("secret", "draft")
        victim_dir = draft.parents[2]  # SCRATCH/<id>/upper/secret/draft
        known = {victim.pid: "the victim's `strata run`", os.getpid(): "the test (pytest)"}
        try:
            state = json.loads((victim_dir / "state.json").read_text())
            known[int(state["pid"])] = "the victim's mount process"
            known[int(state["runner"])] = "the victim's runner"
        except (OSError, ValueError, KeyError, TypeError):
            pass

        store = senv.store
        files = [*sorted(store.glob("packs/*")), *sorted(store.glob("index/*")),
                 store / "STRATA", store / "lock", victim_dir / "state.json",
                 *files_under(victim_dir / "upper"), *files_under(victim_dir / "lower"),
                 Path("/etc/shadow"), host_dir / "secret"]
        dirs = {str(p): listing(p, first) for p, first in (
            (Path("/root"), None), (Path("/home"), None), (Path("/work"), None),
            (Path("/var/tmp"), host_dir.name), (store, None), (senv.scratch, None),
            (victim_dir / "upper" / "secret", None))}
        targets = {
            "mode": "probe",
            "marker": marker,
            "host_marker": {"path": str(host_dir / "secret"), "content": host_secret},
            "host_ns": {ns: os.readlink(f"/proc/self/ns/{ns}")
                        for ns in ("user", "mnt", "pid", "net", "ipc", "uts")},
            "host_paths": [str(senv.root), str(host_dir)],
            "unix_sockets": host_unix_sockets(store),
            "tcp": [["127.0.0.1", listener.getsockname()[1]]],
            "files": [{"path": str(p), "head": head_hex(p)} for p in files],
            "dirs": dirs,
            "search": {"dirs": [str(store), str(senv.scratch)], "secrets": [store_secret]},
            "pids": host_pids(store, known),
            "storage": ["/storage/v"],
            "setuid": "/storage/v/suid-id",
            "device": "/storage/v/loopctl",
        }
        yield World(targets, env, victim, planted)


def store_state(senv: StepEnv) -> dict[str, dict[str, str]]:
    volumes = [v["name"] for v in json.loads(senv.run("volume", "list", "--json").stdout)]
    return {v: senv.branches(v) for v in volumes}


def entries(senv: StepEnv, volume: str) -> dict[str, tuple[Any, ...]]:
    out = json.loads(senv.run("ls", volume, "--json").stdout)
    return {e["path"]: (e["type"], e["mode"], e["uid"], e["gid"], e["size"], e.get("rdev"))
            for e in out}


def probe(senv: StepEnv, world: World, title: str, sandbox: str, *extra: str,
          durable: frozenset[str] = frozenset()) -> None:
    """Run the probe in `v`; fail naming every attack that worked or any harm to the store.

    `durable` volumes (a workspace root) may move: they are not a transaction.
    """
    assert world.victim.poll() is None, "the victim step ended before the probe"
    before, v_before = store_state(senv), entries(senv, "v")
    r = senv.step(["v"], hostile_cmd(world.targets), sandbox, *extra, env=world.env,
                  timeout=300)
    attempts: list[dict[str, Any]] = report_of(r, "attempts")["attempts"]
    print("\n" + table(title, attempts))
    problems: list[str] = []
    won = [a for a in attempts if a["succeeded"]]
    if won:
        problems.append(f"{len(won)} of {len(attempts)} attacks succeeded ({title}):\n" +
                        "\n".join(f"  {a['name']} {a['target']}: {a['detail']}" for a in won))
    missing = ATTACKS - {a["name"] for a in attempts}
    if missing:
        problems.append(f"the probe never tried: {sorted(missing)}")
    if r.rc != 0:
        problems.append(f"the probe step exited {r.rc}: {r.stderr[-2000:]}")
    # The store: every other volume as it was; `v` changed only by the probe's own paths.
    after = store_state(senv)
    for volume in sorted(set(before) | set(after)):
        if volume != "v" and volume not in durable and before.get(volume) != after.get(volume):
            problems.append(f"volume {volume} changed: {before.get(volume)} -> "
                            f"{after.get(volume)}")
    if set(before.get("v", {})) != set(after.get("v", {})):
        problems.append(f"the branches of v changed: {before.get('v')} -> {after.get('v')}")
    v_after = entries(senv, "v")
    changed = sorted(p for p in set(v_before) | set(v_after)
                     if v_before.get(p) != v_after.get(p) and not p.startswith("hostile-"))
    if changed:
        problems.append(f"v changed beyond the probe's own paths: {changed}")
    fsck = json.loads(senv.run("fsck", "--json", rc=None).stdout or "{}")
    if not fsck.get("ok"):
        problems.append(f"fsck after the probe: {fsck}")
    assert not problems, "\n\n".join(problems)


# ------------------------------------------------------------------ tests


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_hostile_probe(senv: StepEnv, sandbox: str) -> None:
    with hostile_world(senv, sandbox) as world:
        probe(senv, world, sandbox, sandbox)


def processes_with(token: str) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid():
            try:
                if token.encode() in Path(f"/proc/{name}/cmdline").read_bytes():
                    found.append(int(name))
            except OSError:
                pass
    return found


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_hostile_forkbomb(senv: StepEnv, sandbox: str) -> None:
    """Forks until refused: `--pids 256` stops it near 256; the host can still fork."""
    token = secrets.token_hex(8)
    # The cap and the time limit keep a sandbox without a pids limit from hurting the host.
    targets = {"mode": "forkbomb", "cap": 2048, "seconds": 20, "token": token}
    t0 = time.monotonic()
    r = senv.step(["v"], hostile_cmd(targets), sandbox, "--pids", "256",
                  env={"PATH": STEP_PATH}, timeout=180)
    reported = '"forked"' in r.stdout
    if sandbox == "gvisor" and not reported:
        # gVisor's kernel has no process limit of its own: the host cgroup (its Sentry's
        # threads and one stub process per address space) ends the whole sandbox, which
        # is the step's failure and nothing else's.
        print(f"\n== hostile forkbomb (gvisor): the sandbox was ended, step exit {r.rc}, "
              f"{time.monotonic() - t0:.1f}s")
        assert r.rc != 0 and time.monotonic() - t0 < 60, (r.rc, r.stderr[-2000:])
    else:
        report = report_of(r, "forked")
        print(f"\n== hostile forkbomb ({sandbox}): {report}, step exit {r.rc}, "
              f"{time.monotonic() - t0:.1f}s")
        # The step may end either way (a bomb may fail it); the bomb must have been
        # refused by the limit, not stopped by its own cap or time limit.
        assert report["stopped_by"] == "EAGAIN", (report, r.rc, r.stderr[-2000:])
        assert 16 <= report["forked"] < (256 if sandbox == "bwrap" else 1024) + 8, report
    # The host still runs, and nothing of the bomb is left.
    assert subprocess.run(["true"], timeout=30).returncode == 0
    assert wait_for(lambda: processes_with(token) == [], 10), processes_with(token)
    senv.wait_clean(10)
    assert senv.ls("v") == []


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_hostile_diskfill(senv: StepEnv, sandbox: str) -> None:
    """Fills its volume: `--disk 64M` gives ENOSPC by 64 MiB; the failed step publishes nothing."""
    before = senv.head("v")
    # The cap keeps a sandbox without a disk limit from filling the host's disk.
    targets = {"mode": "diskfill", "path": "/storage/v/hostile-fill", "cap": 1 << 30,
               "seconds": 120}
    script = 'python3 -c "$1" "$2"; echo "hostile-exit=$?"; exit 1'
    r = senv.step(["v"], ["sh", "-c", script, "hostile", SOURCE, json.dumps(targets)], sandbox,
                  "--disk", "64M", env={"PATH": STEP_PATH}, timeout=300)
    report = report_of(r, "bytes")
    print(f"\n== hostile diskfill ({sandbox}): {report}, step exit {r.rc}")
    assert report["errno"] == 28, report  # ENOSPC, not the cap, the time limit or another error
    assert MIB <= report["bytes"] <= 64 * MIB, report
    assert "hostile-exit=0" in r.stdout, r.stdout[-500:]
    assert r.rc == 1, (r.rc, r.stderr[-2000:])
    assert senv.head("v") == before and senv.ls("v") == []
    senv.wait_clean(10)
    fsck = json.loads(senv.run("fsck", "--json").stdout)
    assert fsck["ok"], fsck


# ------------------------------------------------------------------ a workspace root


# Extension modules the probe never imports whose libraries are big (libcrypto, libdb, ...).
HEAVY_MODULES = ("_ssl", "_hashlib", "_sqlite3", "_dbm", "_gdbm", "nis", "_curses",
                 "_curses_panel", "readline", "_tkinter", "_lzma", "_bz2", "_decimal", "_uuid")


def python_root(target: Path) -> Path:
    """A small root with this machine's python3.11, sh (dash) and id, and their libraries."""
    lib = Path("/usr/lib/python3.11")
    sh = os.path.realpath(shutil.which("sh") or "/bin/sh")
    target.mkdir(parents=True)
    for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):  # merged /usr, as here
        if Path("/", top).is_symlink():
            to = os.readlink(Path("/", top))
            (target / top).symlink_to(to)
            (target / top).resolve().mkdir(parents=True, exist_ok=True)
    modules = [m for m in sorted((lib / "lib-dynload").glob("*.so"))
               if m.name.split(".")[0] not in HEAVY_MODULES]
    needed: set[str] = set()
    for exe in ["/usr/bin/python3.11", sh, "/usr/bin/id", *map(str, modules)]:
        needed.add(exe)
        out = subprocess.run(["ldd", exe], capture_output=True, text=True).stdout
        needed.update(word for word in out.split() if word.startswith("/"))
    for name in sorted(needed):
        real = os.path.realpath(name)
        if real.startswith(str(lib) + "/"):
            continue  # copied with the standard library below
        dest = target / real.lstrip("/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        if not dest.exists():
            shutil.copy2(real, dest)
        link = target / name.lstrip("/")  # the name the loader asks for (a soname link)
        if not os.path.lexists(link):
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(real)
    skip = {"test", "tests", "idlelib", "tkinter", "ensurepip", "site-packages",
            "dist-packages", "__pycache__", "lib2to3", "pydoc_data", "turtledemo", "distutils",
            "config-3.11-x86_64-linux-gnu",
            *(m.name for m in (lib / "lib-dynload").glob("*.so")
              if m.name.split(".")[0] in HEAVY_MODULES)}
    shutil.copytree(lib, target / lib.relative_to("/"), symlinks=True,
                    ignore=lambda _d, names: [n for n in names if n in skip])
    (target / "usr" / "bin" / "python3").symlink_to("python3.11")
    if not os.path.lexists(target / "bin" / "sh"):
        (target / "bin").mkdir(exist_ok=True)
        (target / "bin" / "sh").symlink_to(sh)
    for d in ("proc", "dev", "tmp", "etc", "root", "var/tmp", "storage"):
        (target / d).mkdir(parents=True, exist_ok=True)
    (target / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n"
                                           "nobody:x:65534:65534:nobody:/:/bin/sh\n")
    (target / "etc" / "group").write_text("root:x:0:\nnogroup:x:65534:\n")
    (target / "etc" / "hostname").write_text("hostile\n")
    return target


@needs_bwrap
def test_hostile_probe_in_a_workspace_root(senv: StepEnv) -> None:
    """The same probe with a workspace as the sandbox's whole root (`--root ws:box`)."""
    from ws_harness import cleanup
    senv.env["STRATA_WORKSPACE_STATE"] = str(senv.root / "state")
    try:
        seed = python_root(senv.root / "seed")
        senv.run("workspace", "create", "box", "--size", "1G", "--seed", str(seed))
        shutil.rmtree(seed)
        with hostile_world(senv, "bwrap") as world:
            probe(senv, world, "bwrap, workspace root", "bwrap", "--root", "ws:box",
                  durable=frozenset({"box"}))
    finally:
        cleanup(senv.root)
