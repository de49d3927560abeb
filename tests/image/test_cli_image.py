"""`strata image ...` as a user types it: a real store, its server, real images."""

from __future__ import annotations

import json
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from imagekit import TAG, Images, tar_bytes, write_layout
from run_harness import StepEnv, mounts_under

from strata_harness import StrataEnv


@pytest.fixture
def cenv(tmp_path: Path) -> Iterator[StrataEnv]:
    env = StrataEnv(tmp_path)
    env.run("init")
    yield env
    env.run("serve", "--stop", rc=None)


def _list(env: StrataEnv) -> list[dict[str, object]]:
    return list(json.loads(env.run("image", "list", "--json").stdout))


def test_import_list_log_diff_inspect_rm(cenv: StrataEnv, images: Images) -> None:
    a = cenv.run("image", "import", str(images.layout), "app:1", "--source-ref", TAG
                 ).stdout.strip()
    b = cenv.run("image", "import", str(images.layout), "app:1", "--source-ref", f"{TAG}-2",
                 "-m", "second version").stdout.strip()
    cenv.run("image", "import", str(images.docker_archive), "ghcr.io/org/app").stdout.strip()
    cenv.run("volume", "create", "plain")  # a volume, not an image: not listed
    rows = _list(cenv)
    assert [(r["name"], r["tag"], r["source"]) for r in rows] == [
        ("app", "1", "oci"), ("ghcr.io_org_app", "latest", "docker-archive")]
    log = json.loads(cenv.run("image", "log", "app:1", "--json").stdout)
    assert [e["id"] for e in log] == [b, a] and log[0]["message"] == "second version"
    diff = json.loads(cenv.run("image", "diff", f"app#{a[:12]}", "app:1", "--json").stdout)
    assert diff == [{"path": "data/added.txt", "change": "added"},
                    {"path": "data/keep.txt", "change": "modified"}]
    config = json.loads(cenv.run("image", "inspect", "app@1").stdout)
    assert config["config"]["WorkingDir"] == "/data" and config["snapshot"] == b
    assert cenv.run("image", "log", "plain", rc=2).stderr.startswith(
        "strata: error: 'plain' is a volume, not an image")
    assert "has no tag 'nope'" in cenv.run("image", "log", "app:nope", rc=4).stderr
    cenv.run("image", "rm", "app", rc=2)  # which tag?
    cenv.run("image", "rm", "ghcr.io/org/app:latest")  # its last tag: the image goes
    cenv.run("image", "rm", "plain", "--all", rc=2)  # not an image: left alone
    assert [r["name"] for r in _list(cenv)] == ["app"]
    assert "ghcr.io_org_app" not in cenv.run("volume", "list").stdout.split()


def test_export_is_read_by_skopeo(cenv: StrataEnv, images: Images, tmp_path: Path) -> None:
    cenv.run("image", "import", str(images.oci_archive), "app:1")
    digest = cenv.run("image", "export", "app:1", str(tmp_path / "out")).stdout.strip()
    info = json.loads(subprocess.run(["skopeo", "inspect", f"oci:{tmp_path / 'out'}:1"],
                                     check=True, capture_output=True, text=True).stdout)
    assert info["Digest"] == digest
    cenv.run("image", "export", "app:1", str(tmp_path / "out"), rc=2)  # not empty


def test_a_hostile_image_exits_2_and_leaves_nothing(cenv: StrataEnv, tmp_path: Path) -> None:
    layout = write_layout(tmp_path / "bad", [tar_bytes(("../escape", {"data": b"x"}))])
    p = cenv.run("image", "import", str(layout), "bad:1", rc=2)
    assert "contains '..'" in p.stderr
    assert _list(cenv) == [] and cenv.run("volume", "list").stdout == ""
    bomb = write_layout(tmp_path / "bomb", [tar_bytes(("z", {"data": bytes(4 << 20)}))])
    p = cenv.run("image", "import", str(bomb), "bomb", "--max-bytes", "1M", rc=2)
    assert "tar bomb" in p.stderr and _list(cenv) == []


def test_a_workspace_seeded_from_an_image(tmp_path: Path, images: Images) -> None:
    env = StepEnv(tmp_path)
    env.run("init")
    try:
        env.run("image", "import", str(images.layout), "busy:t", "--source-ref", TAG)
        env.run("workspace", "create", "box", "--size", "256M", "--seed-image", "busy:t")
        p = env.run("run", "--root", "ws:box", "--sandbox", "bwrap", "--", "sh", "-c",
                    "cat /data/keep.txt /data/link2; stat -c '%a %u' /data/setuid /data/owned")
        assert p.stdout.splitlines() == ["version 2", "a file linked from layer 2",
                                         "4755 0", "640 1000"]
    finally:
        for mp in sorted(mounts_under(str(tmp_path)), key=len, reverse=True):
            subprocess.run(["umount", "-l", mp], capture_output=True)
        env.run("serve", "--stop", rc=None)


def test_import_from_a_tarball_of_a_plain_root_is_refused_clearly(cenv: StrataEnv,
                                                                 tmp_path: Path) -> None:
    with tarfile.open(tmp_path / "root.tar", "w") as tf:
        tf.add(__file__, "etc/file")
    p = cenv.run("image", "import", str(tmp_path / "root.tar"), "x", rc=2)
    assert "not an OCI layout, oci-archive or docker-archive" in p.stderr


def test_the_web_view_lists_images(tmp_path: Path, images: Images) -> None:
    import http.client

    from serverutil import Server, cli, free_port
    env = StrataEnv(tmp_path)
    env.run("init")
    env.run("image", "import", str(images.docker_archive), "app:1")
    env.run("volume", "create", "plain")
    env.run("serve", "--stop", rc=None)
    server = Server(env.store, tcp_port=free_port()).start()
    try:
        assert server.tcp_port is not None
        got = {}
        for vol in ("app", "plain"):  # a read-only token of each, as `strata ui` makes
            made = cli("token", "create", vol, "--ro", "--json", store=env.store)
            assert made.returncode == 0, made.stderr
            tok = json.loads(made.stdout)["token"]
            conn = http.client.HTTPConnection("127.0.0.1", server.tcp_port, timeout=30)
            conn.request("GET", "/ui/api/volumes", headers={"Cookie": f"strata_ui={tok}"})
            body = json.loads(conn.getresponse().read())
            conn.close()
            got[vol] = body["volumes"][0]
        assert got["app"]["image"] == {"ref": "app:1", "source": "docker-archive"}
        assert [b["name"] for b in got["app"]["branches"]] == ["1"]
        assert got["plain"]["image"] is None
    finally:
        server.stop()


def test_skopeo_style_sources(cenv: StrataEnv, images: Images) -> None:
    cenv.run("image", "import", f"oci:{images.layout}:{TAG}-2", "a:1")
    cenv.run("image", "import", f"oci-archive:{images.oci_archive}", "a:2")
    cenv.run("image", "import", f"docker-archive:{images.docker_archive}:img:{TAG}", "a:3")
    diff = json.loads(cenv.run("image", "diff", "a:2", "a:1", "--json").stdout)
    assert [d["path"] for d in diff] == ["data/added.txt", "data/keep.txt"]
    cenv.run("image", "import", f"oci:{images.layout}:{TAG}", "a:4", "--source-ref", "x",
             rc=2)
