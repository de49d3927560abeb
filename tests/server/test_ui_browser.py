"""The web view in a real browser: Debian's chromium, headless, driven by selenium.

One `strata serve` (unix socket and loopback TCP) and one browser per module.
The browser logs in with the URL `strata ui` prints, as a person would, and
only ever holds that read-only token for volume `proj`; volume `secret` is
the one it must not see. A step in another process publishes while the
history view is open. Screenshots of the main views go to
`test-artifacts/ui/` (or $STRATA_TEST_ARTIFACTS) and are checked not blank.

Nothing is downloaded: chromedriver is Debian's (/usr/bin/chromedriver),
named explicitly so selenium-manager never runs.
"""

from __future__ import annotations

import io
import json
import os
import sqlite3
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import blake3
import pytest
from PIL import Image, ImageDraw, ImageStat
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from serverutil import Server, cli, free_port
from strata.engine.local import init_store
from strata.engine.txn import Transaction
from strata.server.client import RemoteStore
from strata_harness import STRATA

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
ARTIFACTS = Path(os.environ.get("STRATA_TEST_ARTIFACTS")
                 or Path(__file__).resolve().parents[2] / "test-artifacts" / "ui")
ODD_NAME = "caf\udce9 & 100%.txt"  # a Latin-1 byte that is not UTF-8, and URL specials
HTML = (b"<html><head><title>pwned</title></head><body>"
        b"<script>document.title='pwned';window.pwned=1;</script>"
        b"<img src=x onerror=\"window.pwned=2\"></body></html>")


def _png() -> bytes:
    img = Image.new("RGB", (120, 80), "white")
    draw = ImageDraw.Draw(img)
    draw.rectangle((10, 10, 60, 70), fill="red")
    draw.ellipse((60, 20, 110, 70), fill="blue")
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def _sqlite(tmp: Path) -> bytes:
    path = tmp / "made.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE runs (id INTEGER PRIMARY KEY, name TEXT, score REAL)")
    conn.executemany("INSERT INTO runs (name, score) VALUES (?, ?)",
                     [(f"run-{i}", i / 4) for i in range(250)])
    conn.commit()
    conn.close()
    return path.read_bytes()


class Env:
    def __init__(self, root: Path) -> None:
        self.store_dir = root / "store"
        init_store(str(self.store_dir))
        self.server = Server(self.store_dir, tcp_port=free_port()).start()
        self.base = self.server.tcp_url
        self.owner: RemoteStore = self.server.remote(retry_for=5.0)
        self.owner.create_volume("proj")
        self.owner.create_volume("secret")
        t = Transaction(self.owner, "proj")
        t.write("readme.txt", b"line one\nline two\nline three\n")
        t.write("pic.png", _png())
        t.write("data.db", _sqlite(root))
        self.blob = bytes(range(256)) * 64
        t.write("blob.bin", self.blob)
        t.write("page.html", HTML)
        t.write(ODD_NAME, b"odd name, plain text\n")
        t.write("gaps.txt", b"one\n\n\nfour\n\nsix\n")
        t.mkdir("many")
        for i in range(300):
            t.write(f"many/f{i:04d}", b"x")
        self.first = t.commit("first import")
        t.write("readme.txt", b"line one\nline 2\nline three\nline four\n")
        self.second = t.commit("edit readme")
        # A refused change set as `strata run` keeps one: on rejected/<run>, from the
        # snapshot the run started from.
        self.owner.fork("proj", "rejected/r1", at=self.first)
        r = Transaction(self.owner, "proj", "rejected/r1")
        r.write("readme.txt", b"a rival edit\n")
        r.write("other.txt", b"untouched elsewhere\n")
        self.rejected = r.commit("rejected: run r1")
        s = Transaction(self.owner, "secret")
        s.write("hidden.txt", b"not for proj's token\n")
        self.secret_head = s.commit("secret")
        p = cli("ui", "proj", "--ttl", "600", store=self.store_dir)
        assert p.returncode == 0, p.stderr
        self.login_url = p.stdout.decode().strip()

    def close(self) -> None:
        self.owner.close()
        self.server.stop()


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    e = Env(tmp_path_factory.mktemp("ui"))
    yield e
    e.close()


@pytest.fixture(scope="module")
def browser(env: Env, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebDriver]:
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1000", "--no-first-run",
                f"--user-data-dir={tmp_path_factory.mktemp('chromium')}"):
        opts.add_argument(arg)
    opts.add_experimental_option("prefs", {
        "download.default_directory": str(tmp_path_factory.mktemp("downloads")),
        "download.prompt_for_download": False})
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=opts)
    try:
        driver.get(env.login_url)
        yield driver
    finally:
        driver.quit()


def _wait(driver: WebDriver, cond: Any, timeout: float = 15) -> Any:
    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(cond)


def _text(driver: WebDriver, css: str) -> str:
    return str(driver.find_element(By.CSS_SELECTOR, css).text)


def _open(driver: WebDriver, env: Env, query: str, ready_css: str) -> None:
    driver.get(f"{env.base}/ui/?{query}")
    _wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, ready_css))


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


def _fetch_in_page(driver: WebDriver, path: str) -> dict[str, Any]:
    """A request from the page's own origin, with its cookie: {status, body}."""
    out: dict[str, Any] = driver.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "fetch(arguments[0], {credentials: 'same-origin'})"
        ".then(r => r.text().then(t => done({status: r.status, body: t})))"
        ".catch(e => done({status: -1, body: String(e)}));", path)
    return out


def test_login_sets_a_cookie_and_drops_the_token_from_the_url(env: Env,
                                                              browser: WebDriver) -> None:
    _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "table.branches"))
    assert "token" not in browser.current_url
    assert browser.current_url.startswith(f"{env.base}/ui/")
    (cookie,) = [c for c in browser.get_cookies() if c["name"] == "strata_ui"]
    assert cookie["httpOnly"] is True and cookie["sameSite"] == "Strict"
    assert browser.execute_script("return document.cookie") == ""  # script cannot read it
    rows = browser.find_elements(By.CSS_SELECTOR, "table.branches tbody tr")
    assert [r.get_attribute("data-branch") for r in rows] == ["live", "rejected/r1"]
    assert "edit readme" in _text(browser, "table.branches")
    _wait(browser, lambda d: "on" in d.find_element(By.ID, "live").get_attribute("class"))
    _screenshot(browser, "home")


def test_a_step_in_another_process_appears_without_reload(env: Env,
                                                          browser: WebDriver) -> None:
    _open(browser, env, "view=log&v=proj&b=live", "#timeline li")
    assert len(browser.find_elements(By.CSS_SELECTOR, "#timeline li")) == 3
    _wait(browser, lambda d: "on" in d.find_element(By.ID, "live").get_attribute("class"))
    browser.execute_script("window.__same_page = 42;")
    scratch = env.store_dir.parent / "scratch"
    envv = {**os.environ, "STRATA_STORE": str(env.store_dir), "STRATA_SCRATCH": str(scratch)}
    step = subprocess.run(
        [*STRATA, "run", "--json", "--sandbox", "none", "-v", "proj", "-m", "step from outside",
         "--", "sh", "-c", 'echo new > "$STRATA_STORAGE/proj/new.txt"'],
        env=envv, capture_output=True, text=True, timeout=120)
    assert step.returncode == 0, step.stderr
    published = json.loads(step.stdout[step.stdout.find("{"):])["published"]["proj"]
    item = _wait(browser, lambda d: d.find_elements(
        By.CSS_SELECTOR, f'#timeline li.new[data-id="{published}"]'))[0]
    assert "step from outside" in item.text and "+1" in item.text
    assert browser.execute_script("return window.__same_page") == 42  # no reload
    assert len(browser.find_elements(By.CSS_SELECTOR, "#timeline li")) == 4
    feed = _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#feed li.ev-publish"))
    assert "proj@live" in feed[0].text
    _screenshot(browser, "history-live")
    # A step that fails publishes nothing, and the history says so, live.
    failed = subprocess.run(
        [*STRATA, "run", "--json", "--sandbox", "none", "-v", "proj", "--", "sh", "-c",
         "exit 9"], env=envv, capture_output=True, text=True, timeout=120)
    assert failed.returncode == 9, failed.stderr
    run = json.loads(failed.stdout[failed.stdout.find("{"):])["run"]
    item = _wait(browser, lambda d: d.find_elements(
        By.CSS_SELECTOR, f'#timeline li.failed[data-run="{run}"]'))[0]
    assert "failed: exit 9" in item.text and "nothing published" in item.text


def test_diff_with_a_unified_text_diff(env: Env, browser: WebDriver) -> None:
    _open(browser, env, f"view=diff&v=proj&a={env.first}&b={env.second}", "#diff tr")
    _wait(browser, lambda d: "paths changed" in _text(d, "main"))
    rows = browser.find_elements(By.CSS_SELECTOR, "#diff tr")
    assert [r.text.split()[:2] for r in rows] == [["M", "readme.txt"]]
    rows[0].find_element(By.TAG_NAME, "a").click()
    _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#unified span.add"))
    added = [e.text for e in browser.find_elements(By.CSS_SELECTOR, "#unified span.add")]
    removed = [e.text for e in browser.find_elements(By.CSS_SELECTOR, "#unified span.del")]
    assert added == ["+line 2", "+line four"] and removed == ["-line two"]
    _screenshot(browser, "diff")


def test_text_file_with_line_numbers(env: Env, browser: WebDriver) -> None:
    _open(browser, env, f"view=file&v=proj&s={env.second}&p=readme.txt", "#text")
    lines = browser.find_elements(By.CSS_SELECTOR, "#text span.l")
    assert [e.text for e in lines] == ["line one", "line 2", "line three", "line four"]
    numbers = browser.execute_script(
        "return [...document.querySelectorAll('#text span.l')].map("
        "e => getComputedStyle(e, '::before').content)")
    assert numbers and all("counter" in n or n.strip('"').isdigit() for n in numbers)
    _screenshot(browser, "file-text")
    # Blank lines keep their height: each line's number sits on its own line.
    _open(browser, env, f"view=file&v=proj&s={env.second}&p=gaps.txt", "#text")
    tops = browser.execute_script(
        "return [...document.querySelectorAll('#text span.l')].map("
        "e => e.getBoundingClientRect().top)")
    assert len(tops) == 6 and all(b - a > 5 for a, b in zip(tops, tops[1:], strict=False)), \
        tops


def test_image_sqlite_and_binary_files(env: Env, browser: WebDriver) -> None:
    _open(browser, env, f"view=file&v=proj&s={env.second}&p=pic.png", "#image")
    _wait(browser, lambda d: d.execute_script(
        "const i = document.getElementById('image'); return i.complete && i.naturalWidth"))
    assert browser.execute_script("return document.getElementById('image').naturalWidth") == 120
    _screenshot(browser, "file-image")

    _open(browser, env, f"view=file&v=proj&s={env.second}&p=data.db", "#sqlite table")
    assert "runs (250 rows)" in _text(browser, "#sqlite h2")
    cells = browser.find_elements(By.CSS_SELECTOR, "#sqlite tbody tr")
    assert len(cells) == 100  # the row limit
    assert cells[3].text.split() == ["4", "run-3", "0.75"]
    _screenshot(browser, "file-sqlite")

    _open(browser, env, f"view=file&v=proj&s={env.second}&p=blob.bin", "#binary")
    text = _text(browser, "#binary")
    assert str(len(env.blob)) in text and blake3.blake3(env.blob).hexdigest() in text


def test_rejected_change_set_beside_what_it_conflicted_with(env: Env,
                                                           browser: WebDriver) -> None:
    _open(browser, env, "view=rejected&v=proj&b=rejected/r1", ".grid2")
    mine, theirs = browser.find_elements(By.CSS_SELECTOR, ".grid2 > div")
    assert [r.text.split() for r in mine.find_elements(By.CSS_SELECTOR, "tr")] == [
        ["A", "other.txt"], ["M", "readme.txt"]]
    assert "live" in theirs.text and "edit readme" in theirs.text
    assert [e.text for e in theirs.find_elements(By.CSS_SELECTOR, "li")] == ["readme.txt"]
    _screenshot(browser, "rejected")


def test_names_that_are_not_utf8_round_trip(env: Env, browser: WebDriver) -> None:
    _open(browser, env, f"view=tree&v=proj&s={env.second}", "#listing tbody tr")
    link = browser.find_element(By.PARTIAL_LINK_TEXT, "caf\\xe9")
    assert link.text == "caf\\xe9 & 100%.txt"
    link.click()
    _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#text"))
    assert "%E9%20%26%20100%25" in browser.current_url  # the raw byte, percent-encoded
    assert _text(browser, "#text") == "odd name, plain text"


def test_directory_listing_is_paged(env: Env, browser: WebDriver) -> None:
    _open(browser, env, f"view=tree&v=proj&s={env.second}&p=many", "#listing tbody tr")
    assert "300 entries" in _text(browser, "main")
    assert len(browser.find_elements(By.CSS_SELECTOR, "#listing tbody tr")) == 200
    browser.find_element(By.ID, "more").click()
    _wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#listing tbody tr")) == 300)
    names = [r.text.split()[0] for r in browser.find_elements(By.CSS_SELECTOR,
                                                               "#listing tbody tr")]
    assert names == [f"f{i:04d}" for i in range(300)]  # in order, none twice
    assert not browser.find_element(By.ID, "more").is_displayed()
    _screenshot(browser, "tree")


def test_read_only_token_cannot_see_another_volume(env: Env, browser: WebDriver) -> None:
    got = _fetch_in_page(browser, "/ui/api/volumes")
    assert [v["name"] for v in json.loads(got["body"])["volumes"]] == ["proj"]
    # Another volume, by name or by its snapshot: refused in the same words as a
    # volume that does not exist, and its snapshot is as unknown as a made-up one.
    answers = [_fetch_in_page(browser, f"/ui/api/tree?v={v}&s={env.secret_head}")
               for v in ("secret", "nope")]
    assert [a["status"] for a in answers] == [403, 403]
    assert [json.loads(a["body"])["message"].replace("nope", "secret")
            for a in answers] == [json.loads(answers[0]["body"])["message"]] * 2
    leak = _fetch_in_page(browser, f"/ui/api/tree?v=proj&s={env.secret_head}")
    made_up = _fetch_in_page(browser, f"/ui/api/tree?v=proj&s={'ab' * 32}")
    assert leak["status"] == made_up["status"] == 404
    assert (json.loads(leak["body"])["message"].replace(env.secret_head, "X")
            == json.loads(made_up["body"])["message"].replace("ab" * 32, "X"))
    assert _fetch_in_page(browser, "/ui/events?ref=secret")["status"] == 403
    _open(browser, env, f"view=tree&v=secret&s={env.secret_head}", ".error")
    assert "not valid for volume" in _text(browser, ".error")
    assert "hidden.txt" not in browser.page_source
    # Without the cookie nothing answers; GETs change nothing, and there is no other verb.
    req = urllib.request.Request(f"{env.base}/ui/api/volumes")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    assert err.value.code == 401
    assert set(env.owner.list_branches("secret")) == {"live"}


def test_html_from_a_volume_never_runs_in_the_ui_origin(env: Env, browser: WebDriver) -> None:
    _open(browser, env, f"view=file&v=proj&s={env.second}&p=page.html", "#text")
    time.sleep(0.3)  # time for a script or an onerror handler to run, if one could
    assert browser.title == "strata"
    assert browser.execute_script("return window.pwned") is None
    assert "<script>document.title='pwned'" in _text(browser, "#text")
    # The raw bytes: a download, sandboxed, never sniffed into HTML.
    cookie = next(c["value"] for c in browser.get_cookies() if c["name"] == "strata_ui")
    req = urllib.request.Request(f"{env.base}/ui/raw?v=proj&s={env.second}&p=page.html",
                                 headers={"Cookie": f"strata_ui={cookie}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.read() == HTML
        assert resp.headers["Content-Type"] == "application/octet-stream"
        assert resp.headers["Content-Disposition"].startswith("attachment")
        assert resp.headers["X-Content-Type-Options"] == "nosniff"
        assert "sandbox" in resp.headers["Content-Security-Policy"]
    browser.get(f"{env.base}/ui/raw?v=proj&s={env.second}&p=page.html")
    time.sleep(0.5)
    assert browser.title != "pwned"
    assert browser.execute_script("return window.pwned") is None
    # The page itself forbids inline script: its CSP allows scripts from 'self' only.
    with urllib.request.urlopen(urllib.request.Request(
            f"{env.base}/ui/", headers={"Cookie": f"strata_ui={cookie}"}), timeout=10) as r:
        csp = r.headers["Content-Security-Policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp
