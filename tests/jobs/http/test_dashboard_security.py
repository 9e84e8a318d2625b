"""The dashboard against a hostile tenant and a hostile web page, in a real browser (Debian's headless
Chromium through Selenium) where it matters:

- a tenant's values are text: a job whose model is ``</script><script>alert(document.cookie)</script>``
  and a worker whose model is an ``<img onerror>`` run no script, on the tenant's own page and on
  ``--open`` (which shows every tenant, and the fleet), and show as the text they are; the pages carry
  a CSP that runs no inline script. (``dashboard_xss.png`` is what a person sees.)
- a tenant sees its own jobs and nothing of the fleet (workers, their load) or of another tenant;
  ``--open`` shows the operator, a browser without a key, everything;
- ``--open`` answers only its own names: a page that rebinds its name to 127.0.0.1 reads nothing;
- a state-changing request from another site (a form a page posts, with the visitor's browser) is
  refused, while the openai client and the dashboard's own forms go through;
- the sign-in cookie is HttpOnly, SameSite, Secure when told (served behind TLS), and logout drops it.
"""

from __future__ import annotations

import http.client
import json
import shutil
import time
import urllib.parse

import pytest
from selenium.webdriver.common.by import By
from sqlalchemy import update

from jobs.records.db import open_database
from jobs.records.models import Job, WorkerRow, WorkerSample, now
from tests.support.browser import chromium, until
from tests.support.jobs_env import write_requests
from tests.support.serving import client, embedded_settings, key_for, serving, upload

SCRIPT = "</script><script>alert(document.cookie)</script>"
IMG = "<img src=x onerror=alert('worker')>"
REBOUND = "rebound.test"  # a name the browser resolves to 127.0.0.1, as DNS rebinding makes it
# Every way a script can show it ran: the hooks are in place before any script of the page runs.
HOOK = ("window.__ran = []; for (const f of ['alert', 'confirm', 'prompt']) "
        "window[f] = (...a) => window.__ran.push(f + ':' + String(a[0]));")


@pytest.fixture
def browser():
    driver = chromium("--window-size=1400,900", f"--host-resolver-rules=MAP {REBOUND} 127.0.0.1")
    driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": HOOK})
    yield driver
    driver.quit()


def _hostile_job(settings, tmp_path) -> str:
    """A batch of alice's whose model and error are markup, and a worker whose model is."""
    c_key = key_for(settings, "alice")
    db = open_database(settings.database_url)
    with serving(settings, worker=False) as server:
        c = client(server, c_key)
        batch = c.batches.create(input_file_id=upload(c, write_requests(tmp_path / "r.jsonl", 2)).id,
                                 endpoint="/v1/completions", completion_window="24h")
    with db.session() as s, s.begin():
        s.execute(update(Job).where(Job.id == batch.id).values(model=SCRIPT, error=SCRIPT))
        s.add(WorkerRow(id=f"{IMG}:1", host="h", model=IMG, device="cpu", running=0, waiting=0, kv_blocks_used=0,
                        kv_blocks_free=8, output_tokens_per_second=0.0, started_at=now(), seen_at=now()))
    return batch.id


def _inert(browser, url: str, job_id: str, fleet: bool) -> None:
    """On the index and the job's page: no script ran, and the values show as the text they are
    (the workers' too where the page shows the ``fleet``)."""
    browser.get(url + "/")
    until("the page", lambda: browser.execute_script("return document.readyState") == "complete")
    time.sleep(2.5)  # one poll of data.json redraws the rows
    assert browser.execute_script("return window.__ran") == []
    state = json.loads(browser.find_element(By.ID, "state").get_attribute("textContent"))
    assert [j["model"] for j in state["jobs"] if j["id"] == job_id] == [SCRIPT]
    if fleet:
        assert IMG in browser.find_element(By.ID, "workers").text
    else:
        assert "workers" not in state and browser.find_elements(By.ID, "workers") == []
    assert browser.find_elements(By.CSS_SELECTOR, "#workers img") == []
    inline = browser.execute_script(
        "return [...document.scripts].filter(s => !s.src && s.type !== 'application/json').length")
    assert inline == 0
    browser.get(f"{url}/dashboard/jobs/{job_id}")
    assert browser.find_element(By.CSS_SELECTOR, ".model").text == SCRIPT
    assert browser.find_element(By.CSS_SELECTOR, ".job-error").text == SCRIPT
    assert browser.execute_script("return window.__ran") == []


def _csp(url: str, path: str) -> str:
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    conn.request("GET", path)
    response = conn.getresponse()
    response.read()
    conn.close()
    return response.getheader("Content-Security-Policy") or ""


def test_a_tenants_markup_is_inert_text_on_its_own_page_and_on_open(tmp_path, tiny_llama_dir, browser):
    """The finding: json.dumps in a script block left ``</script>`` as it is, and the script after it ran
    for the tenant and for everyone on --open."""
    settings = embedded_settings(tiny_llama_dir, tmp_path)
    job_id = _hostile_job(settings, tmp_path)
    key = key_for(settings, "alice")
    with serving(settings, worker=False) as server:
        browser.get(f"{server.url}/")
        browser.find_element(By.NAME, "key").send_keys(key)
        browser.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
        until("the index", lambda: browser.find_elements(By.ID, f"job-{job_id}"))
        _inert(browser, server.url, job_id, fleet=False)
        browser.get(f"{server.url}/")
        until("the index", lambda: browser.find_elements(By.ID, f"job-{job_id}"))
        browser.save_screenshot(str(tmp_path / "dashboard_xss.png"))
        browser.get(f"{server.url}/dashboard/jobs/{job_id}")
        browser.save_screenshot(str(tmp_path / "dashboard_xss_job.png"))
        for name in ("dashboard_xss.png", "dashboard_xss_job.png"):
            shutil.copy(tmp_path / name, tmp_path.parent / name)  # easy to find after the run
        for path in ("/", "/dashboard/login", f"/dashboard/jobs/{job_id}"):  # and had it got through: no script
            csp = _csp(server.url, path)
            assert "script-src 'self'" in csp and "unsafe-inline" not in csp and "frame-ancestors 'none'" in csp, path
    browser.delete_all_cookies()
    with serving(settings, worker=False, open_access=True) as server:  # every tenant's jobs, no key
        _inert(browser, server.url, job_id, fleet=True)


FLEET = "gpu-node-7.fleet.internal"


def test_a_tenant_sees_its_own_jobs_and_no_fleet_and_open_shows_the_operator_everything(tmp_path, tiny_llama_dir):
    """The finding: every tenant's dashboard showed the whole fleet's workers and their load. Now a
    tenant's pages and data.json hold its own jobs only; a browser without a key on ``--open`` (the
    operator, on the local server) sees every job and the fleet."""
    settings = embedded_settings(tiny_llama_dir, tmp_path)
    keys = {name: key_for(settings, name) for name in ("alice", "bob")}
    jobs = {}
    with serving(settings, worker=False) as server:
        for name, key in keys.items():
            c = client(server, key)
            jobs[name] = c.batches.create(input_file_id=upload(c, write_requests(tmp_path / f"{name}.jsonl", 2)).id,
                                          endpoint="/v1/completions", completion_window="24h").id
    with open_database(settings.database_url).session() as s, s.begin():
        s.add(WorkerRow(id=f"{FLEET}:4242", host=FLEET, model="fleet-model-x", device="cuda:0", running=3, waiting=9,
                        kv_blocks_used=77, kv_blocks_free=1, output_tokens_per_second=123.0, started_at=now(),
                        seen_at=now()))
        s.add(WorkerSample(worker_id=f"{FLEET}:4242", at=now(), output_tokens_per_second=123.0, kv_blocks_used=77,
                           kv_blocks_free=1))

    def pages(server, key: str | None) -> tuple[str, dict]:
        auth = {"Authorization": f"Bearer {key}"} if key else {}
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        conn.request("GET", "/", headers=auth)
        index = conn.getresponse()
        html = index.read().decode()
        conn.close()
        status, data, _ = _request(server, "GET", "/dashboard/data.json", auth)
        assert index.status == status == 200
        return html, data

    for open_access in (False, True):  # a key names its tenant on --open too
        with serving(settings, worker=False, open_access=open_access) as server:
            html, data = pages(server, keys["alice"])
            everything = html + json.dumps(data)
            assert jobs["alice"] in everything and [j["id"] for j in data["jobs"]] == [jobs["alice"]]
            for other in (jobs["bob"], "bob", FLEET, "fleet-model-x", "cuda:0"):
                assert other not in everything, other
            assert "workers" not in data and "series" not in data and 'id="workers"' not in html
            bobs_page = f"/dashboard/jobs/{jobs['bob']}"
            assert _request(server, "GET", bobs_page, {"Authorization": f"Bearer {keys['alice']}"})[0] == 404
    with serving(settings, worker=False, open_access=True) as server:
        html, data = pages(server, None)
        assert {j["id"] for j in data["jobs"]} == set(jobs.values())
        assert [w["id"] for w in data["workers"]] == [f"{FLEET}:4242"] and list(data["series"]) == [f"{FLEET}:4242"]
        assert 'id="workers"' in html


def _request(server, method: str, path: str, headers: dict | None = None, body: bytes | None = None,
             host: str | None = None) -> tuple[int, dict | None, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.putrequest(method, path, skip_host=True)
    conn.putheader("Host", f"127.0.0.1:{server.port}" if host is None else host)
    for k, v in {**(headers or {}), "Content-Length": str(len(body or b""))}.items():
        conn.putheader(k, v)
    conn.endheaders(body)
    response = conn.getresponse()
    data = response.read()
    conn.close()
    try:
        return response.status, json.loads(data), response
    except ValueError:
        return response.status, None, response


def test_open_answers_only_its_own_names(tmp_path, tiny_llama_dir, browser):
    """The finding: --open checked no Host, so a page that rebinds its own name to 127.0.0.1 read
    data.json (every tenant's jobs) through the visitor's browser."""
    settings = embedded_settings(tiny_llama_dir, tmp_path)
    with serving(settings, worker=False, open_access=True) as server:
        for host in (f"127.0.0.1:{server.port}", f"localhost:{server.port}", f"LOCALHOST:{server.port}"):
            assert _request(server, "GET", "/dashboard/data.json", host=host)[0] == 200, host
        for host in (f"{REBOUND}:{server.port}", "evil.example", f"127.0.0.1.evil.example:{server.port}", ""):
            status, body, _ = _request(server, "GET", "/dashboard/data.json", host=host)
            assert status == 400 and body["error"]["code"] == "invalid_host", host
            assert _request(server, "GET", "/v1/files", host=host)[0] == 400
        browser.get(f"http://{REBOUND}:{server.port}/dashboard/data.json")  # the rebound page, in a browser
        shown = browser.find_element(By.TAG_NAME, "body").text
        assert "invalid_host" in shown and '"jobs"' not in shown
    from jobs.http.origin import allowed_hosts

    assert allowed_hosts("::1", []) == {"::1", "localhost"}
    assert allowed_hosts("localhost", []) == {"127.0.0.1", "::1", "localhost"}  # it may be either
    allowed = embedded_settings(tiny_llama_dir, tmp_path, http_allowed_hosts="berth.lan, other.lan")
    with serving(allowed, worker=False, open_access=True) as server:
        assert _request(server, "GET", "/dashboard/data.json", host=f"berth.lan:{server.port}")[0] == 200
        assert _request(server, "GET", "/dashboard/data.json", host=f"{REBOUND}:{server.port}")[0] == 400


def _form(boundary: str = "b0undary") -> tuple[dict, bytes]:
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"x.jsonl\"\r\n\r\n"
            '{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}\n\r\n'
            f"--{boundary}--\r\n").encode()
    return {"Content-Type": f"multipart/form-data; boundary={boundary}"}, body


def test_state_changing_requests_from_another_site_are_refused(tmp_path, tiny_llama_dir, browser):
    """The finding: --open took uploads from any page the visitor opened. Now a request a browser says
    comes from elsewhere (Sec-Fetch-Site, else Origin) is a 403; the openai client (neither header)
    and a same-origin request go through."""
    settings = embedded_settings(tiny_llama_dir, tmp_path)
    with serving(settings, worker=False, open_access=True) as server:
        c = client(server, "anything")
        headers, body = _form()
        own = f"http://127.0.0.1:{server.port}"
        for refused in ({"Origin": "http://evil.example"}, {"Origin": "null"},
                        {"Origin": f"http://localhost:{server.port + 1}"},
                        {"Sec-Fetch-Site": "cross-site", "Origin": "http://evil.example"},
                        {"Sec-Fetch-Site": "same-site", "Origin": f"http://localhost:{server.port + 1}"}):
            status, answer, _ = _request(server, "POST", "/v1/files", {**headers, **refused}, body)
            assert status == 403 and answer["error"]["code"] == "cross_site_request", refused
        assert c.files.list().data == []
        for allowed in ({}, {"Origin": own}, {"Sec-Fetch-Site": "same-origin", "Origin": own}):
            status, answer, _ = _request(server, "POST", "/v1/files", {**headers, **allowed}, body)
            assert status == 200, (allowed, answer)
        made = c.files.list().data
        assert len(made) == 3
        status, _, _ = _request(server, "DELETE", f"/v1/files/{made[0].id}", {"Sec-Fetch-Site": "cross-site"})
        assert status == 403 and len(c.files.list().data) == 3
        status, _, _ = _request(server, "POST", "/dashboard/login", {"Origin": "http://evil.example",
                                "Content-Type": "application/x-www-form-urlencoded"}, b"key=berth-x")
        assert status == 403

        # A page elsewhere (a data: URL, an opaque origin) posts a form to the server through the browser.
        page = (f"<form id=f method=post enctype=multipart/form-data action='{server.url}/v1/files'>"
                "<input name=purpose value=batch><textarea name=file>{&quot;custom_id&quot;: &quot;x&quot;}"
                "</textarea></form><script>document.getElementById('f').submit()</script>")
        browser.get("data:text/html," + urllib.parse.quote(page))
        until("the server's answer", lambda: browser.current_url.startswith(server.url))
        assert "cross_site_request" in browser.find_element(By.TAG_NAME, "body").text
        assert len(c.files.list().data) == 3


def test_the_sign_in_cookie_is_httponly_secure_when_told_and_logout_drops_it(tmp_path, tiny_llama_dir, browser):
    settings = embedded_settings(tiny_llama_dir, tmp_path)
    key = key_for(settings, "alice")
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    with serving(settings, worker=False) as server:
        status, _, response = _request(server, "POST", "/dashboard/login", form, f"key={key}".encode())
        cookie = response.getheader("Set-Cookie")
        assert status == 303 and "HttpOnly" in cookie and "SameSite=strict" in cookie and "Secure" not in cookie
        browser.get(f"{server.url}/dashboard/login")
        browser.find_element(By.NAME, "key").send_keys(key)
        browser.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
        until("the index", lambda: browser.find_elements(By.ID, "jobs"))
        browser.find_element(By.CSS_SELECTOR, "form[action='/dashboard/logout'] button").click()
        until("the sign-in page", lambda: browser.current_url.endswith("/dashboard/login"))
        assert browser.get_cookies() == []
        browser.get(f"{server.url}/")
        assert browser.current_url.endswith("/dashboard/login")
    secure = embedded_settings(tiny_llama_dir, tmp_path, http_secure_cookies=True)
    with serving(secure, worker=False) as server:
        _, _, response = _request(server, "POST", "/dashboard/login", form, f"key={key}".encode())
        assert "Secure" in response.getheader("Set-Cookie")
        _, _, response = _request(server, "POST", "/dashboard/logout", {"Origin": server.url})
        assert response.status == 303 and "Max-Age=0" in response.getheader("Set-Cookie")
