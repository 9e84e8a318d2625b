"""Debian's headless Chromium through Selenium, as the browser tests drive it, and waiting on a page."""

from __future__ import annotations

import shutil
import time

from selenium import webdriver
from selenium.webdriver.chrome.service import Service

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--no-first-run")


def chromium(*flags: str) -> webdriver.Chrome:
    """A headless Chromium with berth's flags and ``flags``; the caller quits it."""
    assert CHROMIUM and CHROMEDRIVER, ("install Debian's browser: apt-get install -y chromium chromium-driver "
                                       "(the README's test command does)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*FLAGS, *flags):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


def until(what: str, check, timeout: float = 90.0, every: float = 0.25):
    """``check()``'s first true value, polled; fails naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, f"not seen in {timeout:.0f}s: {what}"
        time.sleep(every)
    return value
