"""Validation of paths, volume and branch names, and snapshot ids."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from strata.engine.errors import InvalidInput
from strata.engine.names import (
    MAX_NAME,
    MAX_PATH,
    check_branch,
    check_hex_id,
    check_path,
    check_volume,
    split_path,
)

HOSTILE_PATHS = [
    "..",
    "../etc/passwd",
    "a/../../b",
    "a/..",
    ".",
    "./a",
    "a/./b",
    "/",
    "/etc/passwd",
    "//a",
    "a//b",
    "a/",
    "a/b/",
    "a\0b",
    "\0",
    "a/" + "n" * (MAX_NAME + 1),
    "é" * 128,  # 256 bytes in UTF-8, 128 characters
    "/".join(["d" * 200] * 21),  # every name fine, the whole path over 4096 bytes
    "\ud800",  # a lone surrogate: not encodable, not even with surrogateescape
    "a/\udfff/b",
]


@pytest.mark.parametrize("path", HOSTILE_PATHS)
def test_hostile_paths_are_refused(path: str) -> None:
    with pytest.raises(InvalidInput):
        split_path(path)
    with pytest.raises(InvalidInput):
        check_path(path)


@pytest.mark.parametrize("path", [None, b"a", 3, ["a"]])
def test_non_string_paths_are_refused(path: object) -> None:
    with pytest.raises(InvalidInput, match="string"):
        split_path(path)  # type: ignore[arg-type]


@pytest.mark.parametrize("path,parts", [
    ("", ()),
    ("a", ("a",)),
    ("a/b/c", ("a", "b", "c")),
    ("...", ("...",)),
    ("..a/.b", ("..a", ".b")),
    (" a /b ", (" a ", "b ")),
    ("dir\\x", ("dir\\x",)),
    ("n" * MAX_NAME, ("n" * MAX_NAME,)),
    ("é" * 127, ("é" * 127,)),  # 254 bytes
    ("a\udcffb", ("a\udcffb",)),  # a byte that is not UTF-8, kept by surrogateescape
])
def test_ordinary_paths_split_into_components(path: str, parts: tuple[str, ...]) -> None:
    assert split_path(path) == parts
    assert check_path(path) == path


def test_path_length_limit_is_exact() -> None:
    name = "d" * 255
    ok = "/".join([name] * 16)  # 16*255 + 15 = 4095 bytes
    assert len(ok) <= MAX_PATH
    split_path(ok)
    with pytest.raises(InvalidInput, match="longer"):
        split_path(ok + "/" + "x" * (MAX_PATH - len(ok)))


@given(st.lists(st.text(st.characters(blacklist_characters="/\0",
                                      blacklist_categories=("Cs",)), min_size=1, max_size=12),
                min_size=1, max_size=6))
def test_split_is_the_inverse_of_join(parts: list[str]) -> None:
    path = "/".join(parts)
    if any(p in (".", "..") for p in parts):
        with pytest.raises(InvalidInput):
            split_path(path)
    else:
        assert split_path(path) == tuple(parts)


@pytest.mark.parametrize("name", ["v", "vol-1", "A.b_c", "0", "x" * 128])
def test_good_volume_names(name: str) -> None:
    assert check_volume(name) == name


@pytest.mark.parametrize("name", ["", ".hidden", "-x", "_x", "a/b", "a b", "x" * 129, "ü",
                                  "a\0", "..", None, 5])
def test_bad_volume_names(name: object) -> None:
    with pytest.raises(InvalidInput):
        check_volume(name)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["live", "run/abc", "a/b/c", "x.y-z_1"])
def test_good_branch_names(name: str) -> None:
    assert check_branch(name) == name


@pytest.mark.parametrize("name", ["", "/a", "a/", "a//b", "../x", "a/..", ".x", "a/.b",
                                  "a b", "x" * 256, "a\0b", None])
def test_bad_branch_names(name: object) -> None:
    with pytest.raises(InvalidInput):
        check_branch(name)  # type: ignore[arg-type]


def test_hex_ids() -> None:
    full = "ab" * 32
    assert check_hex_id(full) == full
    assert check_hex_id("abcdef01", min_len=8) == "abcdef01"
    assert check_hex_id("abcdef012", min_len=8) == "abcdef012"
    for bad in ["", "ab" * 31, "ab" * 33, "AB" * 32, "zz" * 32, " " + full[1:], full[:-1] + "\n"]:
        with pytest.raises(InvalidInput):
            check_hex_id(bad)
    for bad in ["abcdef0", "ABCDEF01", "abcdefgh", "ab" * 33]:
        with pytest.raises(InvalidInput):
            check_hex_id(bad, min_len=8)


def test_cli_quotes_names_like_git_and_reads_them_back() -> None:
    from strata.cli.common import quote_path, unquote_path
    cases = {"plain.txt": "plain.txt", "ünï": "ünï", "caf\udce9.txt": '"caf\\351.txt"',
             "tab\tname": '"tab\\tname"', 'q"uote': '"q\\"uote"', "d\udcff/x": '"d\\377/x"'}
    for name, shown in cases.items():
        assert quote_path(name) == shown
        assert unquote_path(shown) == name
