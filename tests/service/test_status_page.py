"""The status page (``GET /status``) on a real server: who sees what, sign-in, escaping, and
a running job's progress, read over HTTP and in a real headless browser (Chromium driven by
Playwright: the ``browser`` marker; skipped, saying why, without them).

One server for the module: alice and bob are users, carol is an admin, and a user whose name
is markup checks the escaping. alice's job runs its first op, then an endless one (until
the server stops), so the page must show it running at 1 of 3 ops.
"""

from __future__ import annotations

import calendar
import os
import re
import shutil
import time

import httpx
import pytest

from .conftest import setup_session, start_server

MARKUP_USER = '<img src=x onerror="document.title=1">&amp;'


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("status"),
                       users=("alice", "bob", "carol", MARKUP_USER), admins="carol,nobody",
                       kernel_time_limit_s=300, shutdown_grace_s=2)
    yield srv
    srv.stop()


def _client(server, user: str | None) -> httpx.Client:
    return server.client(user) if user else httpx.Client(base_url=server.url, timeout=60)


@pytest.fixture(scope="module")
def busy(server, kernels):
    """alice's session with a running job (1 of 3 ops done, the second endless: the server's
    stop ends it), bob's and the markup user's sessions; (alice's sid, job id, bob's sid)."""
    sids = {}
    for user in ("alice", "bob", MARKUP_USER):
        with _client(server, user) as c:
            r = c.post("/v1/sessions", json={})
            assert r.status_code == 201, r.text
            sids[user] = r.json()["session_id"]
    with _client(server, "alice") as alice:
        ids = setup_session(alice, sids["alice"], kernels, "spin", "endless")
        short = {"op": "launch", "kernel_id": ids["spin"], "args": [1000]}
        long = {"op": "launch", "kernel_id": ids["endless"], "args": [2**31 - 1]}
        r = alice.post(f"/v1/sessions/{sids['alice']}/jobs",
                       json={"ops": [short, long, short], "job_id": "train-1"})
        assert r.status_code == 202, r.text
        job_id = r.json()["job_id"]
        deadline = time.monotonic() + 60
        while True:
            info = alice.get(f"/v1/jobs/{job_id}").json()
            if info["state"] == "running" and info["done"] == 1:
                break
            assert info["state"] in ("queued", "running") and time.monotonic() < deadline, info
            time.sleep(0.02)
    return sids["alice"], job_id, sids["bob"]


def test_refused_without_a_valid_token(server):
    with _client(server, None) as anon:
        r = anon.get("/status")
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.headers["content-type"].startswith("text/html")
        assert 'action="/status/login"' in r.text and "signin-error" not in r.text
        r = anon.get("/status", headers={"Authorization": "Bearer dt_not-a-token"})
        assert r.status_code == 401 and "signin-error" in r.text
        r = anon.post("/status/login", data={"token": "dt_not-a-token"})
        assert r.status_code == 401 and "signin-error" in r.text and "set-cookie" not in r.headers
        # The front page sends browsers to the status page.
        r = anon.get("/", follow_redirects=False)
        assert r.status_code == 307 and r.headers["location"] == "/status"


def test_sign_in_cookie_is_for_the_page_only(server):
    with _client(server, None) as anon:
        r = anon.post("/status/login", data={"token": server.tokens["alice"]},
                      follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == "/status"
        cookie = r.headers["set-cookie"]
        for attr in ("httponly", "path=/status", "samesite=strict"):
            assert attr in cookie.lower(), cookie
        r = anon.get("/status?refresh=0")
        assert r.status_code == 200 and re.search(r'id="viewer">alice<', r.text)
        # The API never takes the cookie: a page elsewhere cannot act with it.
        token = server.tokens["alice"]
        r = anon.get("/v1/sessions", headers={"Cookie": f"difftape_token={token}"})
        assert r.status_code == 401
        # A sign-in from a foreign page is refused (CSRF).
        r = anon.post("/status/login", data={"token": token},
                      headers={"Origin": "http://evil.example"})
        assert r.status_code == 403
        r = anon.post("/status/logout", follow_redirects=False)
        assert r.status_code == 303 and 'difftape_token=""' in r.headers["set-cookie"]


def test_a_user_sees_their_own_and_totals_of_the_rest(server, busy):
    sid, job_id, bob_sid = busy
    with _client(server, "alice") as alice:
        page = alice.get("/status?refresh=0")
    assert page.status_code == 200
    assert page.headers["cache-control"] == "no-store"
    assert "script-src" not in page.headers["content-security-policy"]  # default-src 'none'
    html = page.text
    assert sid in html and job_id in html
    # Nothing of another user: not their session id, not their name.
    assert bob_sid not in html and ">bob<" not in html and "onerror" not in html
    assert re.search(r'id="others">Other users: 2 sessions of 2 users', html), html
    row = re.search(r'<tr class="job" data-job="' + re.escape(job_id) + r'">(.*?)</tr>', html,
                    re.S)
    assert row is not None, html
    assert "state-running" in row[1] and '<progress max="3" value="1">' in row[1]
    assert "1 / 3 ops" in row[1] and "(33%)" in row[1]
    assert re.search(r'id="running-jobs">1 running<', html)
    # Quotas: alice's own row only.
    quotas = re.search(r'<table id="quotas">(.*?)</table>', html, re.S)[1]
    assert quotas.count('class="user"') == 1 and ">alice<" in quotas
    assert "1 of 16" in quotas


def test_an_admin_sees_everyone_escaped(server, busy):
    sid, job_id, bob_sid = busy
    with _client(server, "carol") as carol:
        html = carol.get("/status?refresh=0").text
    assert sid in html and bob_sid in html and job_id in html
    assert "(admin:" in html and 'id="others"' not in html
    # The markup user's name is text, not markup (Jinja2 autoescaping).
    assert "<img" not in html
    assert "&lt;img src=x onerror=&#34;document.title=1&#34;&gt;&amp;amp;" in html
    users = re.findall(r'<td class="user">(.*?)</td>',
                       re.search(r'<table id="sessions">(.*?)</table>', html, re.S)[1])
    assert sorted(users) == sorted(["alice", "bob",
                                    "&lt;img src=x onerror=&#34;document.title=1&#34;&gt;"
                                    "&amp;amp;"])


def test_times_are_shown_as_dates_in_utc(server, busy):
    """The page says when it was generated, when each job was submitted and each session was
    last active as a UTC date and time (a person cannot read a Unix time)."""
    sid, job_id, _ = busy
    before = time.time()
    with _client(server, "alice") as alice:
        html = alice.get("/status?refresh=0").text
    after = time.time()
    assert "Unix time" not in html
    generated = re.search(r'id="generated">Generated <time datetime="([^"]+)">'
                          r'(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d) UTC</time>', html)
    assert generated is not None, html
    shown = calendar.timegm(time.strptime(generated[2], "%Y-%m-%d %H:%M:%S"))
    assert int(before) <= shown <= after
    assert generated[1] == time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(shown))
    row = re.search(r'<tr class="job" data-job="' + re.escape(job_id) + r'">(.*?)</tr>', html,
                    re.S)[1]
    submitted = re.search(r'<time datetime="[^"]+" title="([^"]+) UTC">[^<]* ago</time>', row)
    assert submitted is not None, row
    assert shown - 600 < calendar.timegm(time.strptime(submitted[1], "%Y-%m-%d %H:%M:%S")) \
        <= shown
    sessions = re.search(r'<table id="sessions">(.*?)</table>', html, re.S)[1]
    assert re.search(r'title="\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC">[^<]* ago</time>',
                     sessions), sessions


def _chromium() -> str | None:
    """Debian's Chromium (``apt-get install chromium``), or a browser Playwright installed."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


@pytest.mark.browser
def test_status_page_in_a_headless_browser(server, busy, tmp_path):
    """Chromium loads the page: refused without a token, signs in through the form, shows
    alice's running job at 1 of 3 ops; the admin's view renders the markup user's name as
    text (no element injected)."""
    sync_api = pytest.importorskip("playwright.sync_api",
                                   reason="pip install playwright (the test extra)")
    executable = _chromium()
    sid, job_id, _ = busy
    with sync_api.sync_playwright() as p:
        if executable is None and not os.path.exists(p.chromium.executable_path):
            pytest.skip("no Chromium: apt-get install chromium (Debian's; README's test set-up)")
        browser = p.chromium.launch(executable_path=executable, headless=True)
        try:
            page = browser.new_page()
            response = page.goto(server.url + "/")  # redirected to /status
            assert response.status == 401 and page.url.endswith("/status")
            assert "needs a token" in page.inner_text("body")
            page.fill("input[name=token]", "dt_wrong")
            with page.expect_navigation():
                page.click("button[type=submit]")
            assert page.locator("#signin-error").is_visible(), page.content()
            page.fill("input[name=token]", server.tokens["alice"])
            with page.expect_navigation():
                page.click("button[type=submit]")
            assert page.inner_text("#viewer") == "alice"
            page.goto(server.url + "/status?refresh=0")
            row = page.locator(f'tr.job[data-job="{job_id}"]')
            state = row.locator("td.state").inner_text()
            value = row.locator("progress").get_attribute("value")
            ops = row.locator(".ops").inner_text()
            assert (state, value, ops) == ("running", "1", "1 / 3 ops")
            assert sid in page.inner_text("#sessions")
            page.screenshot(path=str(tmp_path / "status.png"), full_page=True)

            admin = browser.new_page()
            admin.set_extra_http_headers({"Authorization": f"Bearer {server.tokens['carol']}"})
            admin.goto(server.url + "/status?refresh=0")
            assert admin.title() == "difftape server: status"  # no injected script ran
            users = admin.locator("#sessions td.user").all_inner_texts()
            assert sorted(users) == sorted(["alice", "bob", MARKUP_USER])
            assert admin.locator("#sessions img").count() == 0
        finally:
            browser.close()
