"""Host loss on hosts of their own (network + mount namespaces): nothing fsynced is lost.

The server runs in the root namespace with its store on the local disk; each
host reaches it over a veth pair. A round attaches the workspace on a new
host, checks what the last round acknowledged, starts a writer, and loses the
host at a random moment: every process SIGKILLed, the network dropped.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hosts import Host

from serverutil import Server, cli, free_port

HERE = Path(__file__).resolve().parent
PY = sys.executable


class Lab:
    def __init__(self, root: Path, url: str, token: str) -> None:
        self.root = root
        self.url = url
        self.token = token
        self.hosts = 0

    def host(self) -> tuple[Host, Path]:
        self.hosts += 1
        n = self.hosts
        env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": str(self.root),
               "STRATA_WORKSPACE_STATE": str(self.root / f"state{self.hosts}"),
               "PYTHONPATH": str(HERE.parents[1] / "src")}
        h = Host(n, env)
        d = self.root / f"mnt{self.hosts}"
        d.mkdir()
        return h, d

    def strata(self, host: Host, *args: str) -> subprocess.CompletedProcess[str]:
        url = f"http://{host.server_address}:{self.url}"
        return host.run(PY, "-m", "strata", *args[:2], "--server", url, "--token",
                        self.token, *args[2:])


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[Lab]:
    store = tmp_path / "store"
    assert cli("init", store=store).returncode == 0
    port = free_port()
    server = Server(store, args=("--listen", f"tcp:0.0.0.0:{port}")).start()
    try:
        assert cli("workspace", "create", "dev", "--size", "2G", store=store).returncode == 0
        p = cli("token", "create", "dev", "--rw", "--json", store=store)
        yield Lab(tmp_path, str(port), json.loads(p.stdout)["token"])
    finally:
        server.stop()


def _acked(out: bytes) -> list[str]:
    return out.decode().split("\n")[:-1]  # a last line without its newline was not acked


def _rounds(lab: Lab, rounds: int, start: list[str], check: list[str], seed: int) -> None:
    """Each round: attach on a new host, run `check` on it, start `start`, lose the host."""
    rng = random.Random(seed)
    acked: list[str] = []
    acked_round = -1  # the round whose writer acknowledged `acked`
    acking = 0  # rounds whose writer had something acknowledged before the loss
    for r in range(rounds + 1):
        host, d = lab.host()
        try:
            lab.strata(host, "workspace", "attach", "dev", str(d))
            if acked:
                p = host.run(*[a.replace("DIR", str(d)).replace("ROUND", str(acked_round))
                               for a in check], acked[-1], check=False)
                assert p.returncode == 0, f"round {r}: {p.stdout} {p.stderr}"
            if r == rounds:
                lab.strata(host, "workspace", "detach", str(d))
                assert acking >= rounds // 2, f"only {acking} of {rounds} rounds wrote anything"
                return
            writer = host.popen(*[a.replace("DIR", str(d)).replace("ROUND", str(r))
                                  for a in start],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            time.sleep(rng.uniform(0.3, 1.2))
            host.lose()
            assert writer.stdout is not None
            got = _acked(writer.stdout.read())
            if got:
                acking += 1
                acked, acked_round = got, r
            writer.wait()
        finally:
            host.close()


CHECK_RECORDS = """
import sys
recs = [r for r in open(sys.argv[1] + '/log-ROUND', 'rb').read().split(b'\\n')
        if r and r[:1] != b'\\0']  # the overwriting modes' file is zeros past the records
n = int(sys.argv[2])
have = [int(r[:8]) for r in recs]
assert have[:n] == list(range(1, n + 1)), (n, have[:5], len(have))
"""


def test_durable_records_survive_twenty_host_losses(lab: Lab) -> None:
    # fsync, fdatasync, O_DSYNC, O_SYNC and sync(2), four rounds each (ws_writer.py).
    _rounds(lab, 20, [PY, str(HERE / "ws_writer.py"), "DIR/log-ROUND", "ROUND"],
            [PY, "-c", CHECK_RECORDS.replace("sys.argv[1]", "'DIR'").replace(
                "sys.argv[2]", "sys.argv[1]")], seed=11)


CHECK_SQLITE = """
import sqlite3, sys
db = sqlite3.connect('DIR/db')
assert db.execute('pragma integrity_check').fetchall() == [('ok',)]
ids = [r[0] for r in db.execute('select id from t order by id')]
n = int(sys.argv[1])
assert ids[:n] == list(range(1, n + 1)), (n, len(ids))
"""


def test_committed_sqlite_transactions_survive_host_loss(lab: Lab) -> None:
    _rounds(lab, 5, [PY, str(HERE / "ws_sqlite.py"), "DIR/db"], [PY, "-c", CHECK_SQLITE],
            seed=12)


def test_acknowledged_git_commits_survive_host_loss(lab: Lab) -> None:
    # git fsyncs its objects (core.fsync=all) but not the directory after renaming a
    # ref into place, so on any disk the branch may point one commit back after a
    # crash: the acknowledged commit object must be there, and fsck clean.
    check = ["sh", "-c", 'cd DIR/repo && git fsck --strict && git cat-file -e "$0^{commit}"']
    _rounds(lab, 5, ["sh", str(HERE / "ws_git.sh"), "DIR/repo"], check, seed=13)


def test_a_frozen_host_never_writes_again_once_another_attached(lab: Lab) -> None:
    one, d1 = lab.host()
    two, d2 = lab.host()
    try:
        lab.strata(one, "workspace", "attach", "dev", str(d1))
        one.run("sh", "-c", f"echo one > {d1}/f && sync -f {d1}")
        writer = one.popen("sh", "-c", f"while :; do date >> {d1}/late; sync -f {d1}; done",
                           stderr=subprocess.DEVNULL)
        time.sleep(0.3)
        one.freeze()  # SIGSTOP every process of host one, its daemon too
        lab.strata(two, "workspace", "attach", "dev", str(d2))
        two.run("sh", "-c", f"cat {d2}/f && echo two > {d2}/g && sync -f {d2}")
        late = two.run("sh", "-c", f"wc -c < {d2}/late").stdout.strip()
        one.freeze(signal.SIGCONT)  # host one thaws and goes on writing: refused
        time.sleep(1.0)
        writer.kill()
        lab.strata(two, "workspace", "detach", str(d2))
        one.lose()
        three, d3 = lab.host()
        try:
            lab.strata(three, "workspace", "attach", "dev", str(d3))
            assert three.run("cat", f"{d3}/f", f"{d3}/g").stdout == "one\ntwo\n"
            # Exactly what host two saw of `late`: nothing host one wrote after thawing.
            assert three.run("sh", "-c", f"wc -c < {d3}/late").stdout.strip() == late
            lab.strata(three, "workspace", "detach", str(d3))
        finally:
            three.close()
    finally:
        one.close()
        two.close()


def test_three_forks_on_three_hosts_see_only_their_own_changes(lab: Lab) -> None:
    base, d = lab.host()
    try:
        lab.strata(base, "workspace", "attach", "dev", str(d))
        base.run("sh", "-c", f"echo base > {d}/shared")
        lab.strata(base, "workspace", "detach", str(d))
    finally:
        base.close()
    hosts = []
    try:
        for n in ("one", "two", "three"):
            assert cli("workspace", "fork", "dev", n, store=lab.root / "store").returncode == 0
            h, hd = lab.host()
            hosts.append((n, h, hd))
            lab.strata(h, "workspace", "attach", f"dev@{n}", str(hd))
        for n, h, hd in hosts:  # all three attached at once, each changed its own way
            h.run("sh", "-c", f"echo {n} > {hd}/shared && echo {n} > {hd}/{n} && sync -f {hd}")
        for n, h, hd in hosts:
            assert h.run("cat", f"{hd}/shared").stdout == f"{n}\n"
            assert h.run("ls", str(hd)).stdout.split() == sorted(["lost+found", "shared", n])
            lab.strata(h, "workspace", "detach", str(hd))
    finally:
        for _n, h, _hd in hosts:
            h.close()
