"""Smoke test: the strata package imports and reports a version."""

import re

import strata


def test_version_is_semver_string() -> None:
    assert isinstance(strata.__version__, str)
    assert re.fullmatch(r"\d+\.\d+\.\d+", strata.__version__)
