"""The pages in a real browser: Debian's Chromium, headless, driven through its chromedriver,
against the real server. ``/docs`` lists the operations; a model's page calls the model from
"Try it out" and shows its prediction; ``/status`` shows the models that got traffic with their
counts; no page asks another host for anything (the browser's network log); each renders at
1280x800 and at a phone's width. Screenshots are written to the test's folder, and to
``docs/images/`` when ``MMSERVER_UPDATE_SCREENSHOTS=1`` (docs/operations.md shows them)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pytest

from tests.e2e.server_process import ServerProcess, predict_ok
from tests.models import make_linear_model
from tests.tabular_models import make_pipeline_model

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
#: Seconds a page may take to show what a test waits for.
WAIT_S = 30.0


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if CHROMIUM is None or DRIVER is None:
        message = "Chromium and chromedriver are not installed (Debian: chromium chromium-driver)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(flag)
    options.add_argument("--window-size=1280,800")
    options.add_argument("--no-first-run")
    options.set_capability("goog:loggingPrefs", {"performance": "ALL"})
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    driver.set_page_load_timeout(WAIT_S)
    try:
        yield driver
    finally:
        driver.quit()


def _wait(driver: Any, condition: Callable[[Any], Any], what: str) -> Any:
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, WAIT_S, poll_frequency=0.05).until(condition, what)


def _hosts(driver: Any) -> set[str]:
    """The hosts of every request the browser made since the last call (its network log)."""
    hosts = set()
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message.get("method") == "Network.requestWillBeSent":
            url = message["params"]["request"]["url"]
            if not url.startswith(("data:", "blob:")):
                hosts.add(urlsplit(url).netloc)
    return hosts


def _shoot(driver: Any, folder: Path, name: str) -> None:
    path = folder / f"{name}.png"
    assert driver.save_screenshot(str(path)), f"no screenshot of {name}"
    if os.environ.get("MMSERVER_UPDATE_SCREENSHOTS") == "1":
        images = ROOT / "docs" / "images"
        images.mkdir(exist_ok=True)
        shutil.copyfile(path, images / f"{name}.png")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pages") / "store"
    make_pipeline_model(root / "churn")
    for name in ("sklearn-0", "sklearn-1", "sklearn-2"):
        make_linear_model(root / name)
    return root


async def _traffic(url: str, counts: dict[str, int]) -> None:
    async with aiohttp.ClientSession() as session:
        for model, count in counts.items():
            for _ in range(count):
                await predict_ok(session, url, model)


async def test_the_pages_in_chromium(browser: Any, store: Path, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    async with ServerProcess(store, tmp_path / "server.log") as server:
        local = urlsplit(server.url).netloc

        def docs() -> list[str]:
            browser.set_window_size(1280, 800)
            browser.get(f"{server.url}/docs")
            _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, ".opblock"), "operations")
            paths = [
                e.get_attribute("data-path")
                for e in browser.find_elements(By.CSS_SELECTOR, ".opblock-summary-path")
            ]
            _shoot(browser, tmp_path, "docs")
            return [p for p in paths if p]

        paths = await asyncio.to_thread(docs)
        assert {"/predictions/{model}", "/v2/models/{model}/infer", "/status.json"} <= set(paths)
        assert await asyncio.to_thread(_hosts, browser) == {local}

        def try_it() -> str:
            browser.get(f"{server.url}/v2/models/churn/docs")
            summary = _wait(
                browser,
                lambda d: d.find_element(
                    By.CSS_SELECTOR, "#operations-churn-predict .opblock-summary"
                ),
                "the model's predict operation",
            )
            summary.click()
            execute = _wait(
                browser,
                lambda d: d.find_element(By.CSS_SELECTOR, "#operations-churn-predict .execute"),
                "its Execute button",
            )
            execute.click()
            status = _wait(
                browser,
                lambda d: d.find_element(
                    By.CSS_SELECTOR,
                    "#operations-churn-predict .live-responses-table tr.response "
                    ".response-col_status",
                ),
                "the live answer",
            )
            body = browser.find_element(
                By.CSS_SELECTOR, "#operations-churn-predict .live-responses-table .microlight"
            ).text
            _shoot(browser, tmp_path, "model-docs")
            return f"{status.text.split()[0]} {body}"

        answered = await asyncio.to_thread(try_it)
        status, _, body = answered.partition(" ")
        assert status == "200", answered
        predictions = json.loads(body)["predictions"]
        assert len(predictions) == 1 and predictions[0] in (0, 1)
        assert await asyncio.to_thread(_hosts, browser) == {local}

        await _traffic(server.url, {"sklearn-0": 5, "sklearn-1": 2})

        def status_page(width: int, height: int, shot: str) -> dict[str, str]:
            browser.set_window_size(width, height)
            browser.get(f"{server.url}/status")

            def counted(driver: Any) -> dict[str, str] | bool:
                rows = driver.find_elements(By.CSS_SELECTOR, "#models tbody tr")
                seen = {}
                for row in rows:
                    cells = {
                        c.get_attribute("data-key"): c.text
                        for c in row.find_elements(By.TAG_NAME, "td")
                    }
                    seen[cells.get("name", "")] = cells.get("requests", "")
                return seen if {"sklearn-0", "sklearn-1"} <= set(seen) else False

            seen = _wait(browser, counted, "the models with traffic")
            _shoot(browser, tmp_path, shot)
            # Only the tables scroll sideways (in their boxes), never the page.
            assert browser.execute_script(
                "return document.documentElement.scrollWidth <= window.innerWidth + 1"
            )
            return dict(seen)

        seen = await asyncio.to_thread(status_page, 1280, 800, "status")
        assert (seen["sklearn-0"], seen["sklearn-1"]) == ("5", "2")
        phone = await asyncio.to_thread(status_page, 390, 844, "status-phone")
        assert phone["sklearn-0"] == "5"
        assert await asyncio.to_thread(_hosts, browser) == {local}
