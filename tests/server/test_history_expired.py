"""History ends cleanly where a retention policy let it go (what a new user hit).

After `policy set jobs --keep-last 2` and `gc --min-age 0`, `strata log jobs`
failed with "object … not found" and printed nothing, and the web view's
history page showed only "snapshot … expired".
"""

from __future__ import annotations

import http.cookiejar
import json
import urllib.request
from pathlib import Path

from serverutil import Server, cli, free_port
from strata.engine.local import init_store


def test_history_ends_at_the_first_expired_snapshot(tmp_path: Path) -> None:
    store = tmp_path / "s"
    init_store(str(store))
    server = Server(store, tcp_port=free_port()).start()
    try:
        assert cli("volume", "create", "jobs", store=store).returncode == 0
        for i in range(5):
            assert cli("put", "jobs", "f", "-m", f"v{i}", store=store,
                       input=f"{i}\n".encode()).returncode == 0
        assert cli("policy", "set", "jobs", "--keep-last", "2", store=store).returncode == 0
        assert cli("gc", "--min-age", "0", store=store).returncode == 0
        for how in ({"store": store}, {"server": server.unix_url}):
            p = cli("log", "jobs", **how)  # type: ignore[arg-type]
            assert p.returncode == 0, p.stderr
            lines = p.stdout.decode().splitlines()
            assert [ln.split()[-1] for ln in lines[:2]] == ["v4", "v3"]
            assert lines[2] == "(older history expired: retention policy)"
            assert len(json.loads(cli("log", "jobs", "--json", **how).stdout)) == 2  # type: ignore[arg-type]
        token = json.loads(cli("token", "create", "jobs", "--ro", "--json",
                               store=store).stdout)["token"]
        jar = http.cookiejar.CookieJar()
        web = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
        web.open(f"{server.tcp_url}/ui/login?token={token}", timeout=30).read()
        with web.open(f"{server.tcp_url}/ui/api/log?v=jobs&b=live", timeout=30) as r:
            page = json.loads(r.read())
        assert [e["message"] for e in page["entries"]] == ["v4", "v3"]
        assert page["older_expired"] is True and page["next"] is None
    finally:
        server.stop()
