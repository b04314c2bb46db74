"""The dashboard's static files as the app serves them, without a browser: the page, every ES module it can reach
(import paths resolve to served files), the vendored uPlot with its license. The browser test is
tests/e2e/test_dashboard_browser.py."""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath

import pytest
from fastapi.testclient import TestClient

from app.main import UI_DIR
from core.settings import Settings
from core_support import isolated_settings

IMPORT = re.compile(r"""(?:\bfrom\s*|\bimport\s*\(?\s*)["']([^"']+\.js)["']""")


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return isolated_settings(tmp_path)


def _reachable_modules(client: TestClient, entry: str) -> dict[str, str]:
    """URL -> source of every module reachable from ``entry`` by static or dynamic imports, fetched over HTTP."""
    seen: dict[str, str] = {}
    todo = [entry]
    while todo:
        url = todo.pop()
        if url in seen:
            continue
        response = client.get(url)
        assert response.status_code == 200, f"{url}: {response.status_code}"
        assert "javascript" in response.headers["content-type"], url
        seen[url] = response.text
        base = PurePosixPath(url).parent
        for target in IMPORT.findall(response.text):
            resolved = PurePosixPath(target) if target.startswith("/") else base / target
            todo.append(str(PurePosixPath(*_normalise(resolved.parts))))
    return seen


def _normalise(parts: tuple[str, ...]) -> list[str]:
    out: list[str] = []
    for part in parts:
        if part == "..":
            out.pop()
        elif part != ".":
            out.append(part)
    return out


def test_index_loads_uplot_then_the_app_module(client: TestClient) -> None:
    page = client.get("/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    csp = re.search(r'http-equiv="Content-Security-Policy" content="([^"]+)"', page.text)
    assert csp and "default-src 'self'" in csp.group(1) and "unsafe" not in csp.group(1)  # no inline or foreign scripts
    scripts = re.findall(r'<script ([^>]*)src="([^"]+)"', page.text)
    assert scripts == [("", "/ui/vendor/uPlot.iife.min.js"), ('type="module" ', "/ui/js/app.js")]
    for href in re.findall(r'<link rel="stylesheet" href="([^"]+)"', page.text):
        assert client.get(href).status_code == 200, href


def test_every_module_import_resolves(client: TestClient) -> None:
    modules = _reachable_modules(client, "/ui/js/app.js")
    # Every view, the chart stack and the stream client are reachable from the entry point.
    for name in (
        "views/job.js",
        "views/completions.js",
        "views/jobs.js",
        "views/submit.js",
        "views/hosts.js",
        "views/login.js",
        "chart.js",
        "downsample.js",
        "series.js",
        "sse.js",
        "../vendor/uplot.js",
    ):
        assert str(PurePosixPath("/ui/js") / name).replace("/js/../", "/") in modules, name
    on_disk = {f"/ui/{p.relative_to(UI_DIR).as_posix()}" for p in (UI_DIR / "js").rglob("*.js")}
    assert on_disk <= set(modules), f"modules nothing imports: {on_disk - set(modules)}"


def test_vendored_uplot_is_small_and_licensed() -> None:
    vendor = UI_DIR / "vendor"
    assert (vendor / "uPlot.iife.min.js").stat().st_size < 60_000
    assert "MIT License" in (vendor / "uPlot.LICENSE").read_text()
    assert "(v1.6.32)" in (vendor / "uPlot.iife.min.js").read_text()[:100]
