"""The fleet page in a real browser: Debian's chromium, headless, driven by selenium.

Two members on loopback. The browser logs in with the URL `strata fleet ui`
prints, as a person would, and sees members and stores as `strata fleet
status` shows them; a planned move shows up without a reload. The page's
data needs the ticket: a browser without the cookie, a forged ticket, and a
scoped token are refused. A screenshot goes to `test-artifacts/fleet-ui/`
(or $STRATA_TEST_ARTIFACTS) and is checked not blank.

Nothing is downloaded: chromedriver is Debian's, named explicitly.
"""

from __future__ import annotations

import json
import os
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fleetutil import Fleet, make_volume
from PIL import Image, ImageStat
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from bucketutil import Moto
from strata.fleet.client import FleetStore
from strata_harness import STRATA

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
ARTIFACTS = Path(os.environ.get("STRATA_TEST_ARTIFACTS")
                 or Path(__file__).resolve().parents[2] / "test-artifacts" / "fleet-ui")


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[WebDriver]:
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,900", "--no-first-run",
                f"--user-data-dir={tmp_path / 'chromium'}"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=opts)
    try:
        yield driver
    finally:
        driver.quit()


def _wait(driver: WebDriver, cond: Any, timeout: float = 30) -> Any:
    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(cond)


def _cell(driver: WebDriver, store: str, cls: str) -> str:
    """The cell's text; read again if the live page replaced the row meanwhile."""
    for _ in range(20):
        found = driver.find_elements(By.CSS_SELECTOR,
                                     f'table.stores tr[data-store="{store}"] td.{cls}')
        try:
            return str(found[0].text) if found else ""
        except StaleElementReferenceException:
            continue
    raise AssertionError(f"the row of {store} kept changing under the reader")


def _status(addr: str, headers: dict[str, str]) -> int:
    req = urllib.request.Request(addr + "/fleet/ui/api/status", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:  # noqa: S310 - loopback
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def test_the_fleet_page_shows_members_and_stores_live(moto: Moto, fleet_url: str,
                                                      tmp_path: Path,
                                                      browser: WebDriver) -> None:
    fleet = Fleet(fleet_url, tmp_path, moto.env())
    try:
        fleet.records.add_store("s1", "bucket")
        fleet.records.add_store("s2")
        for name in ("a", "b"):
            fleet.add(name)
        owner = fleet.owner("s1")
        fleet.owner("s2")
        make_volume(fleet, "s1")
        p = subprocess.run([*STRATA, "fleet", "ui", fleet.url, "--member", "a", "--ttl", "600"],
                           capture_output=True, timeout=60)
        assert p.returncode == 0, p.stderr
        login = p.stdout.decode().strip()
        addr = fleet.members["a"].addr
        assert login.startswith(addr + "/fleet/ui/login?ticket=")
        browser.get(login)
        _wait(browser, lambda d: _cell(d, "s1", "owner") == owner)
        assert "ticket" not in browser.current_url
        (cookie,) = [c for c in browser.get_cookies() if c["name"] == "strata_fleet_ui"]
        assert cookie["httpOnly"] is True and cookie["sameSite"] == "Strict"
        assert browser.execute_script("return document.cookie") == ""
        members = browser.find_elements(By.CSS_SELECTOR, "table.members tbody tr")
        assert sorted(str(r.get_attribute("data-member")) for r in members) == ["a", "b"]
        row = browser.find_element(By.CSS_SELECTOR, 'table.stores tr[data-store="s1"]').text
        assert "serving" in row and "bucket" in row and "none (acknowledged" in row
        assert _cell(browser, "s2", "state") == "serving"
        _wait(browser, lambda d: "on" in str(d.find_element(By.ID, "live").get_attribute("class")))
        # A planned move appears without a reload, in the table and the change list.
        epoch = _cell(browser, "s1", "epoch")
        browser.execute_script("window.__same_page = 42;")
        to = next(n for n in fleet.members if n != owner)
        moved = subprocess.run([*STRATA, "fleet", "move", fleet.url, "s1", "--to", to],
                               capture_output=True, timeout=120)
        assert moved.returncode == 0, moved.stderr.decode() + fleet.logs()
        _wait(browser, lambda d: _cell(d, "s1", "owner") == to
              and _cell(d, "s1", "state") == "serving")
        assert _cell(browser, "s1", "epoch") != epoch
        assert browser.execute_script("return window.__same_page") == 42
        _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, '#feed li[data-store="s1"]'))
        _screenshot(browser, "fleet")
        # The data needs the ticket: no cookie, a forged ticket, a scoped token: 403.
        browser.delete_all_cookies()
        browser.get(addr + "/fleet/ui/")
        _wait(browser, lambda d: d.find_elements(By.ID, "refused"))
        assert "strata fleet ui" in browser.find_element(By.ID, "refused").text
        ticket = login.rsplit("=", 1)[1]
        forged = str(int(ticket.split(".")[0]) + 3600) + "." + ticket.split(".")[1]
        assert _status(addr, {"Cookie": f"strata_fleet_ui={forged}"}) == 403
        assert _status(addr, {"Cookie": f"strata_fleet_ui={ticket}"}) == 200
        admin = FleetStore(fleet.addrs(), "s1", retry_for=30.0)
        try:
            token = admin.admin("POST", "tokens", {"volume": "v", "writable": False})["token"]
        finally:
            admin.close()
        assert _status(addr, {"Authorization": f"Bearer {token}"}) == 403
        assert _status(addr, {"X-Strata-Fleet-Token": os.environ["STRATA_FLEET_TOKEN"]}) == 200
        # The ticket opens nothing else: not a store's API, not a member endpoint.
        for path in ("/v1/volumes", "/fleet/v1/status"):
            req = urllib.request.Request(addr + path, headers={
                "Cookie": f"strata_fleet_ui={ticket}", "X-Strata-Store": "s1"})
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(req, timeout=30)  # noqa: S310 - loopback
            assert err.value.code == 403
            assert json.loads(err.value.read())["error"] == "Forbidden"
    finally:
        fleet.close()


def _screenshot(driver: WebDriver, name: str) -> Path:
    """Save a screenshot and check it is not blank (several colours, real contrast)."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    driver.save_screenshot(str(path))
    img = Image.open(path).convert("RGB")
    colours = img.getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 20, f"{name}: too few colours"
    stddev = ImageStat.Stat(img.convert("L")).stddev[0]
    assert stddev > 10, f"{name}: nearly uniform screenshot (stddev {stddev:.1f})"
    return path
