"""The console in a real headless Chromium (Debian's `chromium` and `chromium-driver`, which
.ci/run installs), driven by Selenium.

One Sweeper per test module, on its own database cloned from the migrated template, with
workers calling the fake upstream over loopback; it runs in a thread of its own (its own
event loop), because WebDriver calls block. Screenshots go to SWEEPER_ARTIFACTS_DIR
(default .artifacts/console under the repository)."""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from selenium.common.exceptions import WebDriverException
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from service.config.policies import Policies
from service.protocols.egress import public_roots
from tests.conftest import (
    REPO_ROOT,
    TOKEN_A,
    LiveServer,
    _admin,
    _with_database,
    policies_from,
    test_settings,
)
from tests.fakes.upstream import FakeUpstream

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
ARTIFACTS = Path(os.environ.get("SWEEPER_ARTIFACTS_DIR", REPO_ROOT / ".artifacts")) / "console"
AXE = Path(__file__).with_name("vendor") / "axe-core" / "axe.min.js"


def console_policies(base_url: str) -> Policies:
    return policies_from({
        "upstreams": {"shop": {"base_url": base_url, "timeout_seconds": 2}},
        "policies": {"carts": {
            "version": 1, "upstream": "shop", "path": "/carts/{object_id}",
            "scope": "tenant:{tenant_id}", "rate": {"per_second": 200, "burst": 50},
            "lease_seconds": 30, "max_attempts": 3,
            "backoff": {"base_seconds": 0.01, "max_seconds": 0.05}}}})


@dataclass
class Console:
    """A running Sweeper with its console, the fake upstream it calls, and an API client."""

    base_url: str
    upstream: FakeUpstream
    database_url: str

    def api(self) -> httpx.Client:
        return httpx.Client(verify=public_roots(), base_url=self.base_url, timeout=10,
                            headers={"Authorization": f"Bearer {TOKEN_A}"})

    def register(self, items: list[dict[str, str]]) -> None:
        with self.api() as api:
            answer = api.post("/v1/items", json={"items": [
                {"policy": "carts", "due_at": "2026-01-01T00:00:00Z", **item}
                for item in items]})
            assert answer.status_code == 200, answer.text


class _ServerThread(threading.Thread):
    """A LiveServer in its own thread and event loop, until `stop`."""

    def __init__(self, database_url: str, policies: Policies) -> None:
        super().__init__(daemon=True, name="console-server")
        self.database_url = database_url
        self.policies = policies
        self.ready = threading.Event()
        self.base_url = ""
        self.error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None

    def run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        settings = test_settings(self.database_url, workers=8)
        try:
            async with LiveServer(settings, self.policies, self.database_url) as live:
                self.base_url = live.base_url
                self.ready.set()
                await self._stopping.wait()
        except BaseException as exc:
            self.error = exc
            self.ready.set()

    def stop(self) -> None:
        if self._loop is not None and self._stopping is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)
        self.join(timeout=30)


@pytest.fixture(scope="module")
def console(pg_server_url: str, template_db: str) -> Iterator[Console]:
    name = f"sweeper_b_{uuid.uuid4().hex[:12]}"
    _admin(pg_server_url, f'CREATE DATABASE "{name}" TEMPLATE "{template_db}"')
    database_url = _with_database(pg_server_url, name)
    upstream = FakeUpstream()
    upstream.start_in_thread()
    server = _ServerThread(database_url, console_policies(upstream.base_url))
    server.start()
    try:
        assert server.ready.wait(60), "the console's server did not start"
        if server.error is not None:
            raise server.error
        yield Console(server.base_url, upstream, database_url)
    finally:
        server.stop()
        upstream.stop_thread()
        _admin(pg_server_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
        if os.environ.get("SWEEPER_REQUIRE_TOOLS"):
            pytest.fail("chromium and chromium-driver are not installed (Debian packages)")
        pytest.skip("chromium and chromium-driver are not installed; .ci/run installs them")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                     "--window-size=1280,1000", "--disable-gpu", "--lang=en-US"):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.implicitly_wait(0)
    try:
        yield driver
    finally:
        driver.quit()


def screenshot(driver: Any, name: str) -> Path:
    """Save the whole page as a test artifact."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(1280, max(700, min(int(height) + 40, 4000)))
    driver.save_screenshot(str(path))
    driver.set_window_size(1280, 1000)
    return path


def axe_violations(driver: Any) -> list[dict[str, Any]]:
    """axe-core's serious and critical violations on the current page (WCAG 2.1 A/AA and
    best practices)."""
    driver.execute_script(AXE.read_text(encoding="utf-8"))
    result = driver.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "axe.run(document, {runOnly: {type: 'tag', values: "
        "['wcag2a', 'wcag2aa', 'wcag21a', 'wcag21aa', 'best-practice']}})"
        ".then(r => done(r.violations), e => done([{id: 'axe-error', impact: 'critical', "
        "help: String(e), nodes: []}]));")
    return [v for v in result if v.get("impact") in ("serious", "critical")]


def wait_for(check: Callable[[], Any], timeout: float = 20.0, what: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or check}")
        time.sleep(0.1)


def sign_in(driver: WebDriver, console: Console, token: str = TOKEN_A) -> None:
    driver.delete_all_cookies()
    driver.get(console.base_url + "/console/sign-in")
    driver.find_element(By.ID, "token").send_keys(token)
    submit(driver, By.CSS_SELECTOR, "form button[type=submit]")
    wait_for(lambda: driver.find_elements(By.CSS_SELECTOR, "nav[aria-label=Console]"),
             what="the signed-in layout")


def submit(driver: WebDriver, by: str, value: str) -> None:
    """Click a form's button and wait for the page it leads to."""
    before = driver.current_url
    for _ in range(3):
        button = driver.find_element(by, value)
        try:
            button.click()
            break
        except WebDriverException:  # the document was still settling: click again if the
            if driver.current_url != before:  # page did not move on
                return
            time.sleep(0.2)
    wait_for(lambda: _gone(button), what="the page the click leads to")


def _gone(element: Any) -> bool:
    """Whether the element's page was replaced: chromedriver says so as a stale reference,
    or, mid-navigation, as a node that no longer belongs to the document."""
    try:
        element.is_enabled()
    except WebDriverException:
        return True
    return False


@pytest.fixture
def driver(browser: WebDriver) -> Iterator[WebDriver]:
    yield browser
    browser.delete_all_cookies()
