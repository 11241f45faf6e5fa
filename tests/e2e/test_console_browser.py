"""The Console in a real browser (Debian's Chromium through its chromedriver, Selenium; nothing downloads a
browser) against a real `qag serve`: sign in, create a connection, a query and a key, try the query, revoke the key
and see the refused call in the live tail; a forged CSRF token, a scoped key at the sign-in form, sign-out and
expiry are refused; `<script>` planted in every free-text field runs nowhere. Each page's screenshot is written to
docs/console/ (the committed ones are what this test took)."""
from __future__ import annotations

import os
import re
import shutil
import sqlite3
import time

import pytest
import requests

from tests.conftest import ROOT, start_server

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
DRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
SHOTS = os.path.join(ROOT, "docs", "console")
XSS = '<script>window.__xss = 1</script><img src=x onerror="window.__xss = 2">'

pytestmark = pytest.mark.skipif(not (os.path.exists(CHROMIUM) and os.path.exists(DRIVER)),
                                reason="Debian's chromium and chromium-driver are not installed (make test "
                                       "installs them)")


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    data = str(tmp_path_factory.mktemp("console") / "shop.db")
    db = sqlite3.connect(data)
    db.executescript("CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT, email TEXT);"
                     "INSERT INTO customers VALUES (1, 'Ada', 'ada@example.com'), (2, 'Bob', 'bob@example.com');")
    db.commit()
    db.close()
    s = start_server({"QAG_CONSOLE_SESSION_SECONDS": "600"}, args=("--workers", "1"))
    s.data = data
    yield s
    s.stop()


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,1000",
              "--disable-extensions", "--no-first-run"):
        opts.add_argument(a)
    d = webdriver.Chrome(service=Service(executable_path=DRIVER), options=opts)
    d.set_page_load_timeout(30)
    d.implicitly_wait(5)
    yield d
    d.quit()


def shot(d, name):
    os.makedirs(SHOTS, exist_ok=True)
    d.save_screenshot(os.path.join(SHOTS, f"{name}.png"))


def navigating(d, find) -> None:
    """Click the element find() returns, then wait until the page it leads to has replaced this one: an element
    looked up too early would be the old page's (its flash, its published version). An element that went stale
    before the click (Chromium: "does not belong to the document", seen on a cold first run) was not clicked:
    it is looked up again and clicked."""
    from selenium.common.exceptions import StaleElementReferenceException, WebDriverException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
    for attempt in range(5):
        old = d.find_element(By.TAG_NAME, "html")
        try:
            find().click()
            break
        except StaleElementReferenceException:
            pass
        except WebDriverException as exc:
            if "does not belong to the document" not in str(exc) or attempt == 4:
                raise
        time.sleep(0.3)
    WebDriverWait(d, 30).until(lambda drv: gone(old))
    WebDriverWait(d, 30).until(lambda drv: drv.execute_script("return document.readyState") == "complete")


def gone(el) -> bool:
    """Selenium's staleness_of, also reading Chromium's other word for a node of a replaced document: "does not
    belong to the document" comes as a plain WebDriverException, which staleness_of lets through (a CI run saw
    it there, while the page was being replaced)."""
    from selenium.common.exceptions import StaleElementReferenceException, WebDriverException
    try:
        el.is_enabled()
        return False
    except StaleElementReferenceException:
        return True
    except WebDriverException as exc:
        if "does not belong to the document" in str(exc):
            return True
        raise


def fill(d, form_id, values: dict, submit=True):
    from selenium.webdriver.common.by import By
    form = d.find_element(By.ID, form_id)
    for name, value in values.items():
        el = form.find_element(By.NAME, name)
        if el.tag_name == "select":
            from selenium.webdriver.support.ui import Select
            Select(el).select_by_visible_text(value)
        elif el.get_attribute("type") == "checkbox":
            if bool(value) != el.is_selected():
                el.click()
        else:
            el.clear()
            el.send_keys(value)
    if submit:
        navigating(d, lambda: d.find_element(By.ID, form_id).find_element(
            By.CSS_SELECTOR, "button[type=submit], button:not([type])"))


def wait_url(d, part: str, seconds: float = 10) -> None:
    from selenium.webdriver.support.ui import WebDriverWait
    WebDriverWait(d, seconds).until(lambda drv: part in drv.current_url)


def no_xss(d):
    assert d.execute_script("return window.__xss === undefined"), f"a planted script ran on {d.current_url}"


def sign_in(d, srv, token):
    from selenium.webdriver.common.by import By
    d.get(srv.base + "/console")
    assert "/console/login" in d.current_url
    d.find_element(By.ID, "token").send_keys(token)
    navigating(d, lambda: d.find_element(By.CSS_SELECTOR, "#login button"))


def test_an_operator_round_trip_in_a_real_browser(srv, browser):
    from selenium.webdriver.common.by import By
    d = browser
    sign_in(d, srv, srv.env["QAG_ADMIN_KEY"])
    wait_url(d, "/console")
    from selenium.webdriver.support.ui import WebDriverWait
    WebDriverWait(d, 10).until(lambda drv: drv.current_url.rstrip("/").endswith("/console"))
    assert d.find_element(By.TAG_NAME, "h1").text == "Overview"
    cookie = d.get_cookie("qag_console")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/console"
    shot(d, "overview")

    d.get(srv.base + "/console/connections")
    fill(d, "new-connection", {"name": "shop", "db": "sqlite", "database": srv.data})
    assert "Connection created." in d.find_element(By.ID, "flash").text
    navigating(d, lambda: d.find_element(By.CSS_SELECTOR, "tr[data-name=shop] button[value=test]"))
    assert "reachable" in d.find_element(By.ID, "flash").text
    shot(d, "connections")

    d.get(srv.base + "/console/queries")
    fill(d, "new-query", {"name": "customer", "connection_name": "shop",
                          "sql": "SELECT id, name, email FROM customers WHERE id = :id",
                          "parameters": '{"id": {"type": "int", "min": 1}}', "description": "One customer " + XSS})
    wait_url(d, "/console/queries/customer")
    no_xss(d)
    fill(d, "try", {"p_id": "1"})
    assert d.find_element(By.ID, "result").get_attribute("data-status") == "200"
    cells = [td.text for td in d.find_elements(By.CSS_SELECTOR, "#rows td")]
    assert cells == ["1", "Ada", "ada@example.com"]
    assert "execute;dur=" in d.find_element(By.ID, "server-timing").text
    shot(d, "query-try")
    fill(d, "new-version", {"sql": "SELECT id, name, email FROM customers WHERE id = :id -- v2 " + XSS,
                            "publish": True})
    assert d.find_element(By.ID, "published").text == "2"
    no_xss(d)
    d.get(srv.base + "/console/queries/customer?a=1&b=2")
    assert "v2" in d.find_element(By.ID, "diff").text
    shot(d, "query-versions")

    d.get(srv.base + "/console/keys")
    fill(d, "new-key", {"name": "reader", "queries": "customer", "connections": "shop",
                        "mask": "customers.email=mask", "description": XSS})
    secret = d.find_element(By.ID, "secret").text
    assert secret.startswith("sk_")
    no_xss(d)
    shot(d, "keys")
    r = requests.get(srv.base + "/q/customer", params={"id": 1}, headers={"X-API-Key": secret}, timeout=10)
    assert r.status_code == 200 and r.json()[0]["email"] == "a***@example.com"
    # the secret is shown once: reloading the page does not show it again
    d.get(srv.base + "/console/keys")
    assert secret not in d.page_source
    navigating(d, lambda: d.find_element(By.CSS_SELECTOR, "tr[data-name=reader] button[value=revoke]"))
    assert "revoked" in d.find_element(By.ID, "flash").text
    r = requests.get(srv.base + "/q/customer", params={"id": 1}, headers={"X-API-Key": secret,
                                                                             "X-Request-Id": "after-revoke"},
                     timeout=10)
    assert r.status_code == 401

    d.get(srv.base + "/console/runs")
    deadline = time.time() + 60
    while time.time() < deadline:
        rows = [tr.text for tr in d.find_elements(By.CSS_SELECTOR, "#tail tbody tr")]
        if any("after-revoke" in t and "401" in t for t in rows):
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"the refused call never reached the live tail: {rows}")
    shot(d, "runs")
    # the overview's latency per minute, from the calls just made
    d.get(srv.base + "/console")
    cells = [td.text for td in d.find_elements(By.CSS_SELECTOR, "#latency-minutes tbody tr:last-child td")]
    assert len(cells) == 4 and re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d", cells[0]) and int(cells[1]) > 0, cells
    assert float(cells[2]) <= float(cells[3]), cells
    assert d.find_element(By.ID, "p99-chart").get_attribute("src").startswith("data:image/svg+xml")
    # the workers with their CPUs (pinned: one each)
    worker_cpus = [tr.find_element(By.CSS_SELECTOR, "td.cpus").text
                   for tr in d.find_elements(By.CSS_SELECTOR, "#slots tbody tr") if "worker" in tr.text]
    assert worker_cpus and all(re.fullmatch(r"[0-9][0-9,\-]*", c) for c in worker_cpus), worker_cpus
    shot(d, "overview")
    for page in ("usage", "audit"):
        d.get(srv.base + f"/console/{page}")
        assert d.find_element(By.TAG_NAME, "h1").text.lower().startswith(page[:4])
        no_xss(d)
        shot(d, page)
    assert "reader" in d.find_element(By.ID, "audit").text

    navigating(d, lambda: d.find_element(By.ID, "signout"))
    wait_url(d, "/console/login")
    d.get(srv.base + "/console/keys")
    assert "/console/login" in d.current_url, "signed out, the Console must ask to sign in again"
    # the old cookie is dead on the server too, not just forgotten by the browser
    r = requests.get(srv.base + "/console/keys", cookies={"qag_console": cookie["value"]}, allow_redirects=False,
                     timeout=10)
    assert r.status_code == 303 and "/console/login" in r.headers["location"]


def test_refusals_csrf_scoped_keys_and_the_cookie_outside_the_console(srv, browser):
    from selenium.webdriver.common.by import By
    admin = srv.env["QAG_ADMIN_KEY"]
    s = requests.Session()
    r = s.post(srv.base + "/console/login", data={"token": admin}, allow_redirects=False, timeout=10)
    assert r.status_code == 303 and "qag_console" in s.cookies
    page = s.get(srv.base + "/console/keys", timeout=10)
    assert page.headers["content-security-policy"].startswith("default-src 'none'")
    token = re.search(r'name="csrf" value="([^"]+)"', page.text).group(1)
    for bad in ("", "forged", token[:-1] + ("A" if token[-1] != "A" else "B")):
        r = s.post(srv.base + "/console/keys", data={"csrf": bad, "action": "create", "name": "evil"},
                   allow_redirects=False, timeout=10)
        assert r.status_code == 403 and r.json()["code"] == "csrf_failed"
    r = s.post(srv.base + "/console/keys", data={"csrf": token, "action": "create", "name": "evil"},
               headers={"Origin": "http://attacker.example"}, allow_redirects=False, timeout=10)
    assert r.status_code == 403
    listed = requests.get(srv.base + "/api/v1/api-keys", headers={"X-API-Key": admin}, timeout=10).json()["items"]
    assert "evil" not in [k["name"] for k in listed], "a refused form changed nothing"
    # the cookie authorises nothing but the Console
    for path in ("/api/v1/api-keys", "/api/v1/connections", "/q/customer?id=1", "/catalog"):
        r = requests.get(srv.base + path, cookies=s.cookies.get_dict(), timeout=10)
        assert r.status_code == 401, path
    # a scoped key's secret at the sign-in form is refused like a wrong one
    key = requests.post(srv.base + "/api/v1/api-keys", json={"name": "scoped", "queries": ["*"]},
                        headers={"X-API-Key": admin}, timeout=10).json()["secret"]
    d = browser
    d.delete_all_cookies()
    sign_in(d, srv, key)
    assert "/console/login" in d.current_url and "not an administrator" in d.find_element(By.ID, "login-error").text
    assert d.get_cookie("qag_console") is None
    shot(d, "sign-in")
    r = requests.post(srv.base + "/console/login", data={"token": key}, allow_redirects=False, timeout=10)
    assert r.status_code == 401 and "set-cookie" not in r.headers


def test_a_session_expires(server_factory):
    srv = server_factory({"QAG_CONSOLE_SESSION_SECONDS": "2"}, args=("--workers", "1"))
    s = requests.Session()
    assert s.post(srv.base + "/console/login", data={"token": srv.env["QAG_ADMIN_KEY"]}, allow_redirects=False,
                  timeout=10).status_code == 303
    assert s.get(srv.base + "/console/audit", allow_redirects=False, timeout=10).status_code == 200
    sid = s.cookies.get("qag_console")
    time.sleep(2.5)
    # sent by hand: the server, not the browser's Max-Age, must end the session
    r = requests.get(srv.base + "/console/audit", cookies={"qag_console": sid}, allow_redirects=False, timeout=10)
    assert r.status_code == 303 and "/console/login" in r.headers["location"]


def test_a_revoked_administrator_token_signs_the_browser_out(srv, browser):
    """A session opened with a named administrator token ends when the token is revoked: the next page the browser
    asks for is the sign-in form, and the cookie it still holds opens nothing."""
    import subprocess
    import sys

    from selenium.webdriver.common.by import By
    made = subprocess.run([sys.executable, "-m", "qag.cli", "admins", "create", "browser-ops"], env=srv.env, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    token = made.stdout.split()[0]
    d = browser
    d.delete_all_cookies()
    sign_in(d, srv, token)
    d.get(srv.base + "/console/keys")
    assert "/console/keys" in d.current_url and d.find_elements(By.NAME, "csrf")
    cookie = d.get_cookie("qag_console")["value"]
    gone = subprocess.run([sys.executable, "-m", "qag.cli", "admins", "revoke", "browser-ops"], env=srv.env,
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert gone.returncode == 0, gone.stderr
    d.get(srv.base + "/console/keys")
    assert "/console/login" in d.current_url, d.current_url
    r = requests.get(srv.base + "/console/keys", cookies={"qag_console": cookie}, allow_redirects=False, timeout=10)
    assert r.status_code == 303 and "/console/login" in r.headers["location"]
