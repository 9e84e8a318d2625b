"""The dashboard in a real browser (Debian's headless Chromium through Selenium): while a job runs,
its progress bar advances between two reads for its tenant, who sees no fleet, and the worker's
charts have points for the operator (``--open``, no key). The test saves a screenshot
(``dashboard.png``) of what the operator sees. The ETA on the page is what ``berth status`` says at
that moment, and the job's page charts its requests done over time (``job-page.png``)."""

from __future__ import annotations

import json
import shutil

import pytest
from selenium.webdriver.common.by import By

import worker.consumer.loop as consumer
from jobs import api
from tests.support.browser import chromium, until
from tests.support.jobs_env import TINY_NAME
from tests.support.serving import client, embedded_settings, key_for, serving, upload, wait_for


@pytest.fixture
def browser():
    driver = chromium("--window-size=1400,1000")
    yield driver
    driver.quit()


def test_the_dashboard_shows_a_running_job_advance_and_the_operator_the_workers_charts(tmp_path, tiny_llama_dir,
                                                                                        browser, monkeypatch):
    monkeypatch.setattr(consumer, "HEARTBEAT_INTERVAL", 1.0)  # points on the charts within seconds
    settings = embedded_settings(tiny_llama_dir, tmp_path, max_num_seqs=4)
    lines = [{"custom_id": f"story-{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": TINY_NAME, "prompt": f"Story {i}:", "max_tokens": 300, "ignore_eos": True}}
             for i in range(60)]
    path = tmp_path / "stories.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    key = key_for(settings, "alice")
    with serving(settings, open_access=True) as server:
        c = client(server, key)
        batch = c.batches.create(input_file_id=upload(c, path).id, endpoint="/v1/completions",
                                 completion_window="24h")
        browser.get(f"{server.url}/dashboard/login")  # the tenant
        browser.find_element(By.NAME, "key").send_keys(key)
        browser.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
        until("the job's row", lambda: browser.find_elements(By.ID, f"job-{batch.id}"))

        def progress() -> float:
            bar = browser.find_element(By.CSS_SELECTOR, f"#job-{batch.id} .bar")
            return float(bar.get_attribute("data-done") or 0)

        first = until("the first finished requests", progress)
        second = until("the bar moving on", lambda: (p := progress()) > first and p)
        assert first < second < 60
        # a third done: early on, a second between the worker's heartbeats moves an estimate from work done
        # by (expected / made) seconds, six at a sixth; the page shows what it fetched up to 2 s before
        until("a third done", lambda: progress() >= 20)
        before = api.status(batch.id, settings).eta_seconds  # what `berth status` says around that moment
        shown = _seconds(browser.find_element(By.CSS_SELECTOR, f"#job-{batch.id} .eta").text)
        after = api.status(batch.id, settings).eta_seconds
        assert before is not None and after is not None, (before, after)
        slack = max(5.0, 0.25 * before)
        assert min(before, after) - slack <= shown <= max(before, after) + slack, (shown, before, after)
        assert browser.find_elements(By.ID, "workers") == [] and browser.find_elements(By.ID, "charts") == []
        browser.find_element(By.CSS_SELECTOR, "header button[type=submit]").click()  # Sign out
        until("the sign-in page", lambda: browser.current_url.endswith("/dashboard/login"))
        browser.get(f"{server.url}/")  # the operator: no key on the open server
        until("the job's row", lambda: browser.find_elements(By.ID, f"job-{batch.id}"))

        def chart_points() -> list[int]:
            charts = browser.find_elements(By.CSS_SELECTOR, "#charts svg")
            return [int(svg.get_attribute("data-points")) for svg in charts]

        points = until("two points on each chart", lambda: (n := chart_points()) and min(n) >= 2 and n)
        assert len(points) == 2  # one worker: tokens/s and KV use
        worker_row = browser.find_element(By.CSS_SELECTOR, "#workers tbody tr").text
        assert TINY_NAME in worker_row and "cpu" in worker_row
        browser.save_screenshot(str(tmp_path / "dashboard.png"))
        shutil.copy(tmp_path / "dashboard.png", tmp_path.parent / "dashboard.png")  # easy to find after the run

        browser.get(f"{server.url}/dashboard/jobs/{batch.id}")
        assert batch.id in browser.find_element(By.TAG_NAME, "h1").text
        chart = browser.find_element(By.CSS_SELECTOR, "svg.progress")  # requests done over time, with axes
        assert int(chart.get_attribute("data-points")) >= 2, chart.get_attribute("outerHTML")
        labels = [t.text for t in chart.find_elements(By.CSS_SELECTOR, "text.tick")]
        assert labels[:3] == ["0", "30", "60"] and labels[3].startswith("0 "), labels
        assert _seconds(browser.find_element(By.CSS_SELECTOR, "td.eta").text) > 0
        browser.save_screenshot(str(tmp_path.parent / "job-page.png"))
        c.batches.cancel(batch.id)
        wait_for(c, batch.id)


def _seconds(shown: str) -> float:
    """The dashboard's duration ("3m07s", "1h02m") in seconds."""
    big, small = shown.replace("h", "m").rstrip("ms").split("m")
    return int(big) * (3600 if "h" in shown else 60) + int(small) * (60 if "h" in shown else 1)
