"""Booting images: `strata run --image` under bwrap and gVisor runs the image's own config.

The busybox image (tests/image/imagekit.py) is booted with no command, so its
Entrypoint and Cmd run with its Env in its WorkingDir; a command line
replaces Cmd, as in `docker run`. A Debian root from mmdebstrap, imported
as a plain directory, runs `apt-get --version` and `python3 -c`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from imagekit import TAG, Images, differences, tree_of_dir, tree_of_snapshot, umoci_unpack
from run_harness import StepEnv, mounts_under, wait_for

SANDBOXES = ["bwrap", pytest.param("gvisor", marks=pytest.mark.skipif(
    shutil.which("runsc") is None, reason="gVisor (runsc) is not installed (APT_OPTIONAL)"))]


@pytest.fixture
def ienv(tmp_path: Path) -> Iterator[StepEnv]:
    env = StepEnv(tmp_path)
    env.run("init")
    yield env
    clean = wait_for(lambda: env.leftovers() == ([], []), 5.0)
    left = env.leftovers()
    for mp in sorted(mounts_under(str(tmp_path)), key=len, reverse=True):
        subprocess.run(["umount", "-l", mp], capture_output=True)
    env.run("serve", "--stop", rc=None)
    assert clean, f"left behind: mounts {left[0]}, scratch {left[1]}"


def _run(env: StepEnv, *args: str) -> subprocess.CompletedProcess[str]:
    return env.run("run", *args, rc=None)


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_an_image_boots_its_own_entrypoint_and_cmd(ienv: StepEnv, images: Images,
                                                   sandbox: str) -> None:
    ienv.run("image", "import", str(images.oci_archive), f"busy:{TAG}")
    p = _run(ienv, "--sandbox", sandbox, "--image", f"busy:{TAG}")
    assert p.returncode == 0, p.stderr
    assert p.stdout == "hello from the image in /data\n"


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_a_command_line_replaces_cmd_and_the_volumes_publish(ienv: StepEnv, images: Images,
                                                             sandbox: str) -> None:
    ienv.run("image", "import", str(images.docker_archive), "busy")  # tag 'latest'
    ienv.run("volume", "create", "v")
    before = ienv.head("busy@latest")
    script = ("cat keep.txt link2; ls /opq; echo $GREETING > /storage/v/out; "
              "echo junk > /etc/junk; echo PATH=$PATH")
    p = _run(ienv, "--sandbox", sandbox, "--image", "busy", "-v", "v", "--", script)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == ["version 2", "a file linked from layer 2", "new1",
                                     "PATH=/bin"]
    assert ienv.cat("v", "out") == "the image\n"
    assert ienv.head("busy@latest") == before  # what the step did to the root is gone


def test_entrypoint_replaces_the_images(ienv: StepEnv, images: Images) -> None:
    ienv.run("image", "import", str(images.oci_archive), "busy")
    p = _run(ienv, "--sandbox", "bwrap", "--image", "busy", "--entrypoint", "",
             "--", "/bin/cat", "keep.txt")
    assert (p.returncode, p.stdout) == (0, "version 2\n"), p.stderr
    p = _run(ienv, "--sandbox", "bwrap", "--image", "busy", "--entrypoint", "/bin/pwd")
    assert (p.returncode, p.stdout) == (0, "/data\n"), p.stderr  # the image's Cmd is dropped
    p = _run(ienv, "--sandbox", "bwrap", "--entrypoint", "/bin/pwd", "-v", "x", "--", "x")
    assert p.returncode == 125 and "give --image" in p.stderr  # as any refused step


def test_a_volume_without_config_still_needs_a_command(ienv: StepEnv, images: Images) -> None:
    ienv.run("volume", "create", "plain")
    ienv.run("import", "plain", str(images.rootfs))
    p = _run(ienv, "--sandbox", "bwrap", "--image", "plain")
    assert p.returncode == 125 and "names none" in p.stderr  # strata could not run it
    p = _run(ienv, "--sandbox", "bwrap", "--image", "plain", "--", "/bin/cat", "/data/keep.txt")
    assert (p.returncode, p.stdout) == (0, "version 2\n"), p.stderr


# -- a real Debian root ----------------------------------------------------------------


@pytest.fixture(scope="session")
def debian_tar(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
               ) -> Path:
    """A minbase bookworm with python3-minimal from mmdebstrap, kept in pytest's cache.

    mmdebstrap fetches the packages from the machine's Debian mirror (about 25 s
    here); later sessions reuse the tarball.
    """
    if shutil.which("mmdebstrap") is None:
        pytest.fail("mmdebstrap is not installed (make apt-deps installs it)")
    if getattr(request.config, "cache", None) is not None:
        cache = Path(request.config.cache.mkdir("strata-mmdebstrap"))
    else:  # -p no:cacheprovider: build it for this session only
        cache = tmp_path_factory.mktemp("mmdebstrap")
    tar = cache / "bookworm-minbase-python3.tar"
    if not tar.exists():
        tmp = cache / "building.tar"
        p = subprocess.run(["mmdebstrap", "--variant=minbase", "--include=python3-minimal",
                            "--quiet", "bookworm", str(tmp)], capture_output=True, text=True)
        if p.returncode != 0:
            pytest.fail(f"mmdebstrap failed (no Debian mirror reachable?): {p.stderr[-2000:]}")
        os.rename(tmp, tar)
    return tar


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_a_debian_root_from_mmdebstrap_boots(ienv: StepEnv, debian_tar: Path,
                                             tmp_path: Path, sandbox: str) -> None:
    root = tmp_path / "rootfs"
    root.mkdir()
    with tarfile.open(debian_tar) as tf:
        tf.extractall(root, numeric_owner=True, filter="fully_trusted")
    ienv.run("image", "import", str(root), "debian:bookworm")
    p = _run(ienv, "--sandbox", sandbox, "--image", "debian:bookworm", "--",
             "sh", "-c", "apt-get --version | head -1; python3 -c 'print(6 * 7)'; "
             "cat /etc/debian_version")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].startswith("apt ") and lines[1] == "42" and lines[2].startswith("12"), lines


def test_a_debian_image_imports_to_what_umoci_unpacks_and_boots(ienv: StepEnv,
                                                                debian_tar: Path,
                                                                tmp_path: Path) -> None:
    """The tarball from mmdebstrap as the one layer of an OCI image (umoci raw add-layer).

    About 9,400 entries of a real distribution: hard links, setuid programs,
    device-free /dev, symlinked /lib; the import must equal `umoci unpack`.
    """
    layout = tmp_path / "layout"
    subprocess.run(["umoci", "init", "--layout", str(layout)], check=True)
    subprocess.run(["umoci", "new", "--image", f"{layout}:d"], check=True)
    subprocess.run(["umoci", "raw", "add-layer", "--image", f"{layout}:d", str(debian_tar)],
                   check=True)
    subprocess.run(["umoci", "config", "--image", f"{layout}:d",
                    "--config.cmd", "python3", "--config.cmd", "-c",
                    "--config.cmd", "import sys; print(sys.version_info[0])"], check=True)
    rootfs = umoci_unpack(layout, "d", tmp_path / "bundle")
    ienv.run("image", "import", str(layout), "deb:oci")
    with ienv.remote() as store:
        ours = tree_of_snapshot(store, store.head("deb", "oci"))
    assert len(ours) > 5000
    assert differences(ours, tree_of_dir(rootfs)) == []
    p = _run(ienv, "--sandbox", "bwrap", "--image", "deb:oci")  # its own Cmd
    assert (p.returncode, p.stdout) == (0, "3\n"), p.stderr
    p = _run(ienv, "--sandbox", "bwrap", "--image", "deb:oci", "--", "apt-get", "--version")
    assert p.returncode == 0 and p.stdout.startswith("apt "), p.stderr
