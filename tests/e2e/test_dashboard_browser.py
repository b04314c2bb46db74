"""The dashboard in a real browser (Debian's chromium through Playwright) against `llmjobs serve`: sign in with a
token, a bad spec's field highlighted, a preprocess job submitted from the form reaching succeeded in the list, its
events / logs / artifacts, live charts fed by a real short train job's metrics over SSE, the view kept across a
reload, cancel, the hosts page, and min/max decimation keeping 100k-point series fast and exact at their extremes."""

from __future__ import annotations

import json
import math
import os
import re
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from test_service_e2e import Service, readme_example, service  # noqa: F401 - the module-scoped `llmjobs serve` fixture

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
SCREENSHOT = Path("/tmp/llmjobs-dashboard.png")
# Screenshots at a phone's and a laptop's width (the test prints where); LLMJOBS_TEST_ARTIFACTS moves them.
ARTIFACTS = Path(os.environ.get("LLMJOBS_TEST_ARTIFACTS", "/tmp/llmjobs-dashboard-artifacts"))
AXE = Path(__file__).parent / "vendor" / "axe.min.js"  # axe-core (MPL-2.0), test-only
JOB_TIMEOUT_MS = 150_000
# A real model shape with Qwen3's vocabulary (the demo data is tokenized with the real Qwen3 tokenizer), tiny widths.
TINY_TRAIN: dict[str, Any] = {
    "kind": "train",
    "split": "100,0,0",
    "train_iters": 6,
    "lr": 3e-3,
    "lr_warmup_iters": 2,
    "lr_decay_style": "cosine",
    "seq_length": 128,
    "micro_batch_size": 2,
    "global_batch_size": 4,
    "log_interval": 1,
    "is_instruction_dataset": True,
    "finetune": True,
    "stage": "sft",
    "num_layers": 2,
    "hidden_size": 64,
    "ffn_hidden_size": 128,
    "num_attention_heads": 4,
    "group_query_attention": True,
    "num_query_groups": 2,
    "kv_channels": 16,
    "qk_layernorm": True,
    "padded_vocab_size": 151936,
    "normalization": "RMSNorm",
    "position_embedding_type": "rope",
    "swiglu": True,
    "disable_bias_linear": True,
}


def _chromium_or_skip() -> None:
    if CHROMIUM.exists():
        return
    message = f"Debian's chromium is not at {CHROMIUM} (`make setup` installs it when run as root)"
    if os.environ.get("LLMJOBS_REQUIRE_SERVICES") == "1":
        pytest.fail(message + " (LLMJOBS_REQUIRE_SERVICES=1)")
    pytest.skip(message)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    _chromium_or_skip()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@contextmanager
def _page(browser: Any, bypass_csp: bool) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1400, "height": 1000}, bypass_csp=bypass_csp)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda err: errors.append(str(err)))
    # Expected 401/422 answers show as "Failed to load resource"; anything else logged as an error is a bug.
    page.on(
        "console",
        lambda msg: (
            errors.append(msg.text)
            if msg.type == "error" and not msg.text.startswith("Failed to load resource")
            else None
        ),
    )
    page.set_default_timeout(20_000)
    yield page
    context.close()
    assert not errors, f"browser errors: {errors}"


@pytest.fixture
def page(browser: Any, service: Service) -> Iterator[Any]:  # noqa: F811 - the imported fixture
    """A page whose Content-Security-Policy is bypassed: Playwright's polling wait_for_function evaluates strings,
    which the dashboard's CSP (rightly) forbids. strict_page keeps the CSP."""
    with _page(browser, bypass_csp=True) as page:
        yield page


@pytest.fixture
def strict_page(browser: Any, service: Service) -> Iterator[Any]:  # noqa: F811
    with _page(browser, bypass_csp=False) as page:
        yield page


def _job_id(page: Any) -> str:
    match = re.search(r"#/jobs/([0-9a-f-]{36})", page.url)
    assert match, page.url
    return match.group(1)


def _wait_state(page: Any, state: str) -> None:
    page.wait_for_selector(f'.job-head .badge[data-state="{state}"]', timeout=JOB_TIMEOUT_MS)


def _blue_pixels(page: Any, chart: str) -> int:
    """Pixels of the chart's first series colour (#2563eb) on its canvas: > 0 when a line was drawn."""
    return page.evaluate(
        """(title) => {
        const canvas = document.querySelector(`.chart[data-chart="${title}"] canvas`);
        const data = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height).data;
        let n = 0;
        for (let i = 0; i < data.length; i += 4)
            if (Math.abs(data[i] - 37) < 40 && Math.abs(data[i + 1] - 99) < 40 && data[i + 2] > 180) n++;
        return n;
    }""",
        chart,
    )


def _set_range(page: Any, selector: str, value: float) -> None:
    page.eval_on_selector(
        selector,
        """(el, v) => { el.value = String(v); el.dispatchEvent(new Event("input"));
        el.dispatchEvent(new Event("change")); }""",
        value,
    )


def _chart_controls(page: Any, train_id: str) -> None:
    """Smoothing adds a faint raw twin per line, log y and the x axis go into the URL, a zoom survives a redraw,
    a hidden series stays hidden, a chart's CSV export holds exactly its points, empty/constant charts are folded."""
    loss = '.chart[data-chart="Loss"]'
    series = int(page.get_attribute(loss, "data-lines"))
    _set_range(page, "#smooth", 0.6)
    page.wait_for_selector(f'{loss}[data-lines="{2 * series}"]')
    assert "smooth=0.6" in page.url
    page.check(f"{loss} input.log-y")
    page.wait_for_selector(f'{loss}[data-log-y="true"]')
    assert "logy=Loss" in page.url
    # Zoom by a drag on the step axis (on the time axis a slow step on a loaded machine can take half the width),
    # then redraw on another x axis and back, as a live update would: the zoom, kept in steps, stays.
    zoom = _drag_zoom(page, "Grad norm")
    page.select_option("#x-axis", "relative")
    page.wait_for_selector(f'{loss}[data-x-axis="relative"]')
    assert page.get_attribute('.chart[data-chart="Grad norm"]', "data-zoom") == zoom
    assert page.is_disabled('#x-axis option[value="tokens"]') is False  # the train job reports `tokens`
    page.select_option("#x-axis", "step")
    page.wait_for_selector(f'{loss}[data-x-axis="step"]')
    assert page.get_attribute('.chart[data-chart="Grad norm"]', "data-zoom") == zoom
    lo, hi = (float(v) for v in zoom.split(","))
    with page.expect_download() as download:
        page.click('.chart[data-chart="Grad norm"] button.export-csv')
    rows = Path(download.value.path()).read_text().splitlines()
    assert rows[0] == "series,run,step,x,value,smoothed"
    steps = [int(r.split(",")[2]) for r in rows[1:]]
    assert steps == [s for s in range(1, 7) if lo <= s <= hi] and steps, (zoom, rows)
    page.dblclick('.chart[data-chart="Grad norm"] .u-over')
    page.wait_for_function("document.querySelector('.chart[data-chart=\"Grad norm\"]').dataset.zoom === ''")
    # Hiding a line in the legend hides its raw twin too and survives a rebuild (smoothing off again).
    page.click(f"{loss} .u-legend tr.u-series:nth-child(2)")
    page.wait_for_selector(f'{loss}[data-hidden="lm_loss"]')
    with page.expect_download() as download:
        page.click(f"{loss} button.export-json")
    assert json.loads(Path(download.value.path()).read_text())["series"] == []
    _set_range(page, "#smooth", 0)
    page.wait_for_selector(f'{loss}[data-lines="{series}"]')
    assert page.locator(f"{loss} .u-legend tr.u-series.u-off").count() == 1
    page.click(f"{loss} .u-legend tr.u-series:nth-child(2)")
    # mfu has no value on CPU, global_batch_size is constant: folded into one line, not charted.
    page.click("details.more summary")
    folded = page.inner_text("#flat-charts")
    assert "mfu: no value" in folded and "global_batch_size: constant 4" in folded
    assert page.locator('.chart[data-chart="mfu"]').count() == 0
    page.uncheck(f"{loss} input.log-y")
    page.wait_for_selector(f'{loss}[data-log-y="false"]')


def _job_panels(page: Any, train_id: str) -> None:
    """Device telemetry charts, events filtered by type, server-side log search, first error, the checkpoints panel
    with an action that pre-fills the submit form, and the effective configuration."""
    for chart in ("Device utilisation (%)", "Device memory (MB)"):  # the worker's CPU sampler, every 5 s
        assert int(page.get_attribute(f'#device-charts .chart[data-chart="{chart}"]', "data-points")) >= 1, chart
    page.focus('button[data-tab="events"]')
    page.keyboard.press("Enter")  # tabs are buttons: the keyboard opens them
    page.wait_for_selector('#event-types label[data-type="checkpoint"]')
    assert not page.is_checked('#event-types label[data-type="progress"] input')  # progress folded by default
    assert page.locator('table.events tr[data-type="progress"]:not([hidden])').count() == 0
    assert page.locator('table.events tr[data-type="checkpoint"]:not([hidden])').count() == 2  # iterations 3 and 6
    page.check('#event-types label[data-type="progress"] input')
    assert page.locator('table.events tr[data-type="progress"]:not([hidden])').count() >= 6
    page.uncheck('#event-types label[data-type="checkpoint"] input')
    assert page.locator('table.events tr[data-type="checkpoint"]:not([hidden])').count() == 0

    page.click('button[data-tab="logs"]')
    page.wait_for_function("document.querySelector('pre.log').textContent.includes('iteration 6/')")
    page.fill("#log-search", "ITERATION 4/")  # any case, searched by the server
    page.press("#log-search", "Enter")
    page.wait_for_selector("#log-hits li")
    assert page.locator("#log-hits li").count() == 1 and "iteration 4/" in page.inner_text("#log-hits li")
    page.click("#log-hits li button")
    assert "iteration 4/" in page.inner_text("#log-mark")
    page.click("#log-first-error")
    page.wait_for_selector("#no-error")  # a clean run has none

    page.click('button[data-tab="checkpoints"]')
    page.wait_for_selector('#checkpoints tr[data-iteration="6"]')
    assert page.locator("#checkpoints tbody tr").evaluate_all("rows => rows.map((r) => r.dataset.iteration)") == [
        "3",
        "6",
    ]
    loss6 = page.inner_text('#checkpoints tr[data-iteration="6"] td:nth-child(2)')
    assert loss6 != "—"
    page.click('#checkpoints tr[data-iteration="3"] button[data-action="evaluate"]')
    page.wait_for_url(re.compile(r"#/submit"))
    draft = json.loads(page.input_value("#spec"))
    assert draft["kind"] == "eval" and draft["load"] == {"job": train_id, "iteration": 3}
    assert draft["metadata"]["from_iteration"] == "3"
    assert draft["hidden_size"] == TINY_TRAIN["hidden_size"]

    page.goto(page.url.split("#")[0] + f"#/jobs/{train_id}?tab=spec")
    page.wait_for_selector('#spec-effective tr[data-field="lr"]')
    assert page.get_attribute('#spec-effective tr[data-field="lr"]', "data-source") == "set"
    assert page.get_attribute('#spec-effective tr[data-field="rotary_base"]', "data-source") == "default"
    assert page.inner_text('#spec-effective tr[data-field="rotary_base"] td') == "10000"


def _compare_runs(page: Any, service: Service, train_id: str, train_b: str, name: str) -> None:  # noqa: F811
    """The list filtered by metadata with its progress / latest loss / metadata columns, sorted by loss; the two
    runs compared on one chart whose plotted series are read back against the API; the link reopens the same."""
    with service.client() as client:
        deadline = time.monotonic() + JOB_TIMEOUT_MS / 1000
        while client.get(f"/v1/jobs/{train_b}").json()["state"] != "succeeded":
            assert time.monotonic() < deadline, "the second run did not finish"
            time.sleep(1)
        losses = {
            job: [p["value"] for p in client.get(f"/v1/jobs/{job}/metrics", params={"names": "lm_loss"}).json()["data"]]
            for job in (train_id, train_b)
        }
    page.goto(f"{service.url}/#/jobs?meta=sweep={name}&cols=sweep")
    page.wait_for_selector(f'tr[data-job="{train_b}"] td[data-loss]')
    page.wait_for_selector(f'tr[data-job="{train_id}"] td[data-loss]')
    assert page.locator("tr[data-job]").count() == 2
    assert page.inner_text(f'tr[data-job="{train_id}"] td[data-col="meta:sweep"]') == name
    assert page.get_attribute(f'tr[data-job="{train_id}"] td[data-progress]', "data-progress") == "100"
    for job in (train_id, train_b):
        assert float(page.get_attribute(f'tr[data-job="{job}"] td[data-loss]', "data-loss")) == pytest.approx(
            losses[job][-1]
        )
    page.click('th[data-col="loss"] button')
    assert "sort=loss" in page.url
    order = page.locator("tr[data-job]").evaluate_all("rows => rows.map((r) => r.dataset.job)")
    assert order == sorted((train_id, train_b), key=lambda j: losses[j][-1])
    for job in (train_id, train_b):
        page.check(f'tr[data-job="{job}"] input.select-job')
    page.click("#compare-selected")
    page.wait_for_url(re.compile(r"#/compare\?ids="))
    for attempt in range(2):  # the page, then the same link reloaded
        page.wait_for_selector('.compare-chart .chart[data-chart="lm_loss"][data-lines="2"]')
        plotted = page.evaluate("""() => { const c = document.querySelector(".compare-chart .chart").chart;
            return {labels: c.u.series.map((s) => s.label), data: c.u.data.map((a) => Array.from(a))}; }""")
        assert plotted["data"][0] == [1, 2, 3, 4, 5, 6]
        by_label = dict(zip(plotted["labels"][1:], plotted["data"][1:]))
        for job, label_start in ((train_id, f"{name}-train "), (train_b, f"{name}-train-b ")):
            label = next(lbl for lbl in by_label if lbl.startswith(label_start))
            assert "lr=" in label  # the legend names the differing spec field
            assert by_label[label] == pytest.approx(losses[job])
        assert page.locator('#compare-diff tr[data-field="lr"]').count() == 1
        best = min((train_id, train_b), key=lambda j: min(losses[j]))
        assert page.locator("#compare-best tr.best").get_attribute("data-job") == best
        if attempt == 0:
            page.reload()
    page.goto(f"{service.url}/#/compare?meta=sweep={name}")
    page.wait_for_selector('.compare-chart .chart[data-lines="2"]')


def _axe_violations(page: Any) -> list[dict[str, Any]]:
    """axe-core's WCAG 2 A/AA violations on the page as it is now."""
    page.add_script_tag(path=str(AXE))
    return page.evaluate("""async () => (await axe.run(document, {runOnly: ["wcag2a", "wcag2aa"]})).violations
        .map((v) => ({id: v.id, impact: v.impact, nodes: v.nodes.slice(0, 3).map((n) => n.html.slice(0, 160))}))""")


def _screens_and_audit(page: Any, service: Service, train_id: str, train_b: str) -> None:  # noqa: F811
    """Every view audited by axe-core; the job list, the job page and the comparison shot at 420 and 1440 px, none
    scrolling sideways (wide tables and charts scroll inside their own boxes)."""
    views = [
        (f"#/jobs/{train_id}", '.chart[data-chart="Loss"]'),
        (f"#/jobs/{train_id}?tab=logs", "pre.log"),
        (f"#/jobs/{train_id}?tab=events", "#event-types label"),
        (f"#/jobs/{train_id}?tab=checkpoints", "#checkpoints"),
        (f"#/jobs/{train_id}?tab=spec", "#spec-effective"),
        (f"#/compare?ids={train_id},{train_b}", ".compare-chart .chart"),
        ("#/jobs?cols=sweep", "tr[data-job]"),
        ("#/hosts", "tr[data-host]"),
        ("#/submit", ".reference dt"),
    ]
    for route, ready in views:
        page.goto(f"{service.url}/{route}")
        page.wait_for_selector(ready)
        assert _axe_violations(page) == [], route
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shots = []
    for width in (420, 1440):
        page.set_viewport_size({"width": width, "height": 900})
        for label, route, ready in (
            ("jobs", "#/jobs?cols=sweep", "tr[data-job]"),
            ("job", f"#/jobs/{train_id}", '.chart[data-chart="Loss"]'),
            ("compare", f"#/compare?ids={train_id},{train_b}", ".compare-chart .chart"),
        ):
            page.goto(f"{service.url}/{route}")
            page.wait_for_selector(ready)
            page.wait_for_timeout(300)  # the charts' first frame
            assert page.evaluate("document.documentElement.scrollWidth") <= width, (label, width)
            path = ARTIFACTS / f"dashboard-{label}-{width}px.png"
            page.screenshot(path=str(path), full_page=True)
            shots.append(str(path))
    page.set_viewport_size({"width": 1400, "height": 1000})
    print("dashboard screenshots:", " ".join(shots))


def test_dashboard_end_to_end(page: Any, service: Service) -> None:  # noqa: F811
    started = time.monotonic()
    # Sign in: an unknown token is refused, the admin token is kept in localStorage.
    page.goto(service.url + "/")
    page.wait_for_url(re.compile(r"#/login"))
    page.fill("#token", "llmj_not-a-token")
    page.click("button[type=submit]")
    page.wait_for_selector("text=Invalid or revoked token")
    page.fill("#token", service.token)
    page.click("button[type=submit]")
    page.wait_for_selector("table.jobs")
    assert page.evaluate("localStorage.getItem('llmjobs.token')") == service.token

    # Submit from the form: first a bad spec, whose field is named and highlighted in the editor.
    page.click("text=Submit a job")
    body, _ = readme_example()
    page.fill("#spec", json.dumps({**body, "workers": 0}, indent=2))
    page.click("#submit")
    page.wait_for_selector("#submit-errors li")
    assert page.inner_text('#submit-errors li[data-field="workers"]').startswith("workers")
    assert '"workers": 0' in page.inner_text(".editor mark")
    assert page.get_attribute("#spec", "class") == "has-error"

    name = f"browser-{uuid.uuid4().hex[:6]}"
    page.fill("#spec", json.dumps({**body, "name": name, "output_prefix": f"demo/out/{name}"}, indent=2))
    page.click("#submit")
    page.wait_for_url(re.compile(r"#/jobs/[0-9a-f-]{36}"))
    pre_id = _job_id(page)
    _wait_state(page, "succeeded")
    result = page.inner_text("#result")
    assert "samples_written" in result and "200" in result
    page.click('button[data-tab="events"]')
    page.wait_for_selector('table.events tr[data-type="finished"]')
    page.click('button[data-tab="logs"]')
    page.wait_for_function("document.querySelector('pre.log').textContent.includes('preprocess summary')")
    page.click('button[data-tab="artifacts"]')
    page.wait_for_selector("table.artifacts >> text=data_path")

    # A real short train job on the form job's output (over HTTP), watched live on its page.
    with service.client() as client:
        data_path = client.get(f"/v1/jobs/{pre_id}").json()["result"]["outputs"]["data_path"]
        # A second run of the same sweep (another lr) to compare with; it runs first on the one CPU slot.
        sweep = {"data_path": [data_path], "metadata": {"sweep": name}}
        other = client.post("/v1/jobs", json={**TINY_TRAIN, **sweep, "name": f"{name}-train-b", "lr": 1e-3})
        assert other.status_code == 201, other.text
        train_b = other.json()["id"]
        created = client.post(
            "/v1/jobs",
            json={**TINY_TRAIN, **sweep, "name": f"{name}-train", "save": f"demo/out/{name}-ckpt", "save_interval": 3},
        )
        assert created.status_code == 201, created.text
        train_id = created.json()["id"]

    # Meanwhile: the list shows the preprocess job as succeeded, also under the state filter, and the hosts page.
    page.goto(f"{service.url}/#/jobs")
    page.wait_for_selector(f'tr[data-job="{pre_id}"][data-state="succeeded"]')
    page.select_option("#f-state", "succeeded")
    page.wait_for_selector(f'tr[data-job="{train_id}"]', state="detached")  # the filtered page has arrived
    # other tests of this module share the service and may have finished jobs before this one (random order)
    assert set(page.locator("tr[data-job]").evaluate_all("rows => rows.map((r) => r.dataset.state)")) == {"succeeded"}
    assert page.locator(f'tr[data-job="{pre_id}"]').count() == 1 and "state=succeeded" in page.url
    page.goto(f"{service.url}/#/hosts")
    page.wait_for_selector('tr[data-host="e2e-host"] .badge.health-up')
    # While the two train jobs run one after the other, the held device shows its newest telemetry (5 s samples).
    stats = page.wait_for_selector('tr[data-host="e2e-host"] .device-stats', timeout=JOB_TIMEOUT_MS).inner_text()
    assert re.fullmatch(r"\d+% · \d+\.\d/\d+ GB", stats), stats

    page.goto(f"{service.url}/#/jobs/{train_id}")
    _wait_state(page, "succeeded")
    page.wait_for_selector('#stream-status[data-status="ended"]')
    loss = page.locator('.chart[data-chart="Loss"]')
    page.wait_for_function("document.querySelector('.chart[data-chart=\"Loss\"]').dataset.points === '6'")
    assert loss.get_attribute("data-drawn") == "6"
    for chart in ("Grad norm", "Learning rate", "Tokens/s", "Memory (MB)"):
        assert int(page.get_attribute(f'.chart[data-chart="{chart}"]', "data-points")) >= 6, chart
    assert _blue_pixels(page, "Loss") > 50
    assert "6 / 6 iterations" in page.inner_text("#progress")
    _chart_controls(page, train_id)
    _job_panels(page, train_id)
    _compare_runs(page, service, train_id, train_b, name)
    _screens_and_audit(page, service, train_id, train_b)
    page.goto(f"{service.url}/#/jobs/{train_id}")
    page.wait_for_selector('.chart[data-chart="Loss"]')
    page.screenshot(path=str(SCREENSHOT), full_page=True)

    # The page's stream client (fetch + Authorization header, no token in the URL) resumes after an id exactly, and
    # its parser gives the same messages whatever the chunking (here one character at a time).
    resume = page.evaluate(
        """async ([jobId, token]) => {
        const {JobStream, SseParser} = await import("/ui/js/sse.js");
        const url = `/v1/jobs/${jobId}/stream`;
        const collect = (last) => new Promise((resolve) => {
            const got = [];
            new JobStream(url, token, {onBatch: (m) => got.push(...m), onStatus: (s) => s === "ended" && resolve(got)}, last).start();
        });
        const key = (m) => JSON.stringify([m.event, m.data]);
        const all = (await collect(null)).filter((m) => m.event !== "end");
        const middle = Math.floor(all.length / 2);
        const rest = (await collect(all[middle].id)).filter((m) => m.event !== "end");
        const raw = await (await fetch(url, {headers: {Authorization: `Bearer ${token}`}})).text();
        const parser = new SseParser(), split = [];
        for (const ch of raw) split.push(...parser.push(ch));
        return {
            total: all.length, metrics: all.filter((m) => m.event === "metric").length,
            resumedExactly: JSON.stringify(rest.map(key).sort()) === JSON.stringify(all.slice(middle + 1).map(key).sort()),
            parsedAlike: JSON.stringify(split.filter((m) => m.event !== "end").map(key)) === JSON.stringify(all.map(key)),
        };
    }""",
        [train_id, service.token],
    )
    assert resume["metrics"] >= 6 and resume["resumedExactly"] and resume["parsedAlike"], resume

    # A connection that drops mid-stream (here: the first answer cut after half its messages, no "end"): the client
    # reconnects with Last-Event-ID = the last id it got and ends with every message exactly once.
    with service.client() as client:
        raw = client.get(f"/v1/jobs/{train_id}/stream", timeout=60).text
    blocks = [b for b in re.split(r"\r?\n\r?\n", raw) if "data:" in b and "event: end" not in b]
    half = blocks[: len(blocks) // 2]
    cut_id = re.search(r"^id: ?(\S+)", half[-1], re.MULTILINE).group(1)
    resumed_with: list[str | None] = []

    def drop_first(route: Any) -> None:
        if not resumed_with and route.request.headers.get("last-event-id") is None:
            resumed_with.append(None)
            route.fulfill(
                status=200, headers={"Content-Type": "text/event-stream"}, body="\r\n\r\n".join(half) + "\r\n\r\n"
            )
        else:
            resumed_with.append(route.request.headers.get("last-event-id"))
            route.continue_()

    page.route(f"**/v1/jobs/{train_id}/stream", drop_first)
    dropped = page.evaluate(
        """async ([jobId, token]) => {
        const {JobStream} = await import("/ui/js/sse.js");
        const got = await new Promise((resolve) => {
            const all = [];
            new JobStream(`/v1/jobs/${jobId}/stream`, token, {onBatch: (m) => all.push(...m), onStatus: (s) => s === "ended" && resolve(all)}).start();
        });
        return got.filter((m) => m.event !== "end").map((m) => JSON.stringify([m.event, m.data]));
    }""",
        [train_id, service.token],
    )
    page.unroute(f"**/v1/jobs/{train_id}/stream")
    assert resumed_with == [None, cut_id]
    assert len(dropped) == len(blocks) == len(set(dropped)) == resume["total"]

    # The view survives a reload: the tab is in the URL and the stream replays the logs.
    page.click('button[data-tab="logs"]')
    assert "tab=logs" in page.url
    page.reload()
    page.wait_for_selector('button[data-tab="logs"].active')
    page.wait_for_function("document.querySelector('pre.log').textContent.includes('iteration 6/')")
    page.select_option("#log-stream", "rank0")  # one rank's own log
    page.wait_for_function("document.querySelector('pre.log').textContent.includes('[rank0]')")
    assert "stream=rank0" in page.url

    # Cancel from the page (two clicks).
    with service.client() as client:
        cancel_id = client.post(
            "/v1/jobs", json={**body, "name": f"{name}-cancel", "output_prefix": f"demo/out/{name}-c"}
        ).json()["id"]
    page.goto(f"{service.url}/#/jobs/{cancel_id}")
    page.click("#cancel")
    page.click("#cancel")
    _wait_state(page, "cancelled")

    # Cursor paging, one job a page: newest first, and back.
    page.goto(f"{service.url}/#/jobs?limit=1")
    page.wait_for_selector(f'tr[data-job="{cancel_id}"]')
    page.click("#page-older")
    page.wait_for_selector(f'tr[data-job="{train_id}"]')
    page.click("#page-older")
    page.wait_for_selector(f'tr[data-job="{train_b}"]')
    page.click("#page-older")
    page.wait_for_selector(f'tr[data-job="{pre_id}"]')
    with service.client() as client:  # other tests of this module may have made older jobs (random order)
        older = client.get("/v1/jobs", params={"limit": 1, "after": pre_id}).json()["data"]
    assert page.is_disabled("#page-older") == (not older)
    page.click("#page-newer")
    page.wait_for_selector(f'tr[data-job="{train_b}"]')
    assert time.monotonic() - started < 450


def _drag_zoom(page: Any, chart: str) -> str:
    """Drag across the middle of ``chart`` (as a user zooms) and return its ``data-zoom``. On a loaded machine the
    chart may still be laid out while the mouse moves, so the selection can miss every whole step; the drag is then
    undone and made again (three tries), so the export below always has steps to check."""
    selector = f'.chart[data-chart="{chart}"]'
    for _ in range(3):
        over = page.locator(f"{selector} .u-over")
        over.scroll_into_view_if_needed()
        box = over.bounding_box()
        page.mouse.move(box["x"] + box["width"] * 0.25, box["y"] + 20)
        page.mouse.down()
        page.mouse.move(box["x"] + box["width"] * 0.75, box["y"] + 20, steps=5)
        page.mouse.up()
        page.wait_for_function(f"document.querySelector('{selector}').dataset.zoom !== ''")
        zoom = str(page.get_attribute(selector, "data-zoom"))
        lo, hi = (float(v) for v in zoom.split(","))
        if math.floor(hi) >= math.ceil(lo):
            return zoom
        page.dblclick(f"{selector} .u-over")
        page.wait_for_function(f"document.querySelector('{selector}').dataset.zoom === ''")
    raise AssertionError(f"three drags over {chart} selected no whole step (last {zoom})")


def test_decimation_keeps_100k_point_series_fast_and_exact(strict_page: Any, service: Service) -> None:  # noqa: F811
    # Under the page's own CSP: every view renders without a violation (the fixture fails on console errors).
    page = strict_page
    page.goto(service.url + "/")
    page.evaluate("t => localStorage.setItem('llmjobs.token', t)", service.token)
    with service.client() as client:
        body, _ = readme_example()
        job_id = client.post("/v1/jobs", json={**body, "name": "csp", "output_prefix": "demo/out/csp"}).json()["id"]
    for route, selector in (
        (f"#/jobs/{job_id}", ".job-head .badge"),
        ("#/jobs", f'tr[data-job="{job_id}"]'),
        ("#/submit", ".reference dt"),
        ("#/hosts", "tr[data-host]"),
    ):
        page.goto(f"{service.url}/{route}")
        page.wait_for_selector(selector)
    result = page.evaluate("""async () => {
        const {Series} = await import("/ui/js/series.js");
        const {decimate} = await import("/ui/js/downsample.js");
        const {LiveChart} = await import("/ui/js/chart.js");
        const n = 100000, loss = new Series("lm_loss", null), mem0 = new Series("mem", 0), mem1 = new Series("mem", 1);
        for (let i = 1; i <= n; i++) {
            loss.push(i, 10 * Math.exp(-i / 20000) + 0.1 * Math.sin(i) + (i === 54321 ? 50 : 0) - (i === 77777 ? 9 : 0));
            mem0.push(i, 1000 + (i % 1000));
            if (i % 3) mem1.push(i, i === 33334 ? NaN : 2000 + (i % 500));  // another rank, fewer steps, one NaN
        }
        const host = document.createElement("div");
        host.style.width = "820px";
        document.body.append(host);
        const chart = new LiveChart(host, "bench", [loss, mem0, mem1]);
        const times = [];
        for (let k = 0; k < 7; k++) { const t = performance.now(); chart.draw(); times.push(performance.now() - t); }
        times.sort((a, b) => a - b);
        const columns = Math.round(chart.u.bbox.width / devicePixelRatio);
        const full = decimate([loss, mem0, mem1], 1, n, columns);
        const zoom = decimate([loss], 54000, 54600, columns);
        const finite = (a) => a.filter((v) => v !== null);
        return {
            drawn: Number(chart.el.dataset.drawn), points: Number(chart.el.dataset.points), columns,
            medianMs: times[3], maxLoss: Math.max(...finite(full[1])), minLoss: Math.min(...finite(full[1])),
            maxMem1: Math.max(...finite(full[3])), zoomLen: zoom[0].length, zoomHasSpike: zoom[1].includes(loss.y[54320]),
            sorted: full[0].every((x, i) => i === 0 || x > full[0][i - 1]),
            aligned: full.every((a) => a.length === full[0].length),
        };
    }""")
    print(
        f"decimation of 3 series, {result['points']} points, {result['columns']} columns: "
        f"{result['drawn']} drawn, median draw {result['medianMs']:.1f} ms"
    )
    assert result["points"] == 100_000 * 2 + 66_667
    assert result["drawn"] <= 2 * (result["columns"] + 2)
    assert result["sorted"] and result["aligned"]
    # The extremes survive: the spike, the dip and the other rank's maximum.
    assert result["maxLoss"] > 50 and result["minLoss"] < 0
    assert result["maxMem1"] == 2499
    # Zoomed to 600 steps on an 800-pixel chart: every point, the spike included (plus one neighbour each side).
    assert result["zoomLen"] == 603 and result["zoomHasSpike"]
    assert result["medianMs"] < 250, result

    # The compare chart's worst case: 5 runs x 100,000 points, raw and smoothed (TensorBoard's EMA, raw line kept),
    # a full redraw and a live one (one new point per run, so the EMA is extended). Each time runs from draw() to
    # uPlot's paint (a microtask after setData). Printed, not asserted as a timing.
    redraw = page.evaluate("""async () => {
        const {Series} = await import("/ui/js/series.js");
        const {LiveChart, plainView} = await import("/ui/js/chart.js");
        const runs = [];
        for (let r = 0; r < 5; r++) {
            const s = new Series("lm_loss", null);
            s.display = `run ${r}`;
            for (let i = 1; i <= 100000; i++) s.push(i, (10 + r) * Math.exp(-i / 30000) + 0.3 * Math.sin(i * (r + 1)));
            runs.push(s);
        }
        const host = document.createElement("div");
        host.style.width = "1200px";
        document.body.append(host);
        const median = async (fn) => {
            const t = [];
            for (let k = 0; k < 15; k++) { const a = performance.now(); fn(); await Promise.resolve(); t.push(performance.now() - a); }
            t.sort((a, b) => a - b);
            return [t[7], t[0]];  // median, and the fastest (the least disturbed by other processes)
        };
        const view = plainView();
        const chart = new LiveChart(host, "compare bench", runs, {view, height: 320});
        await Promise.resolve();
        const paints = chart.paints;
        const raw = await median(() => chart.draw());
        view.smooth = 0.6;
        chart.build();
        const smooth = await median(() => chart.draw());
        let step = 100000;
        const live = await median(() => { step += 1; runs.forEach((s) => s.push(step, 1)); chart.draw(); });
        return {raw, smooth, live, painted: chart.paints - paints, drawn: Number(chart.el.dataset.drawn),
                lines: Number(chart.el.dataset.lines), columns: Math.round(chart.u.bbox.width / devicePixelRatio)};
    }""")
    print(
        f"redraw of 5 runs x 100,000 points ({redraw['columns']} px, draw() to paint; median / fastest of 15): "
        f"{redraw['raw'][0]:.1f} / {redraw['raw'][1]:.1f} ms raw, {redraw['smooth'][0]:.1f} / {redraw['smooth'][1]:.1f} ms "
        f"smoothed ({redraw['lines']} lines, {redraw['drawn']} x positions drawn), {redraw['live'][0]:.1f} / "
        f"{redraw['live'][1]:.1f} ms per live update with smoothing"
    )
    assert redraw["lines"] == 10 and redraw["drawn"] <= 2 * (redraw["columns"] + 2)
    assert redraw["painted"] >= 45  # every timed draw was painted inside its measurement (15 + 1 build + 15 + 15)


def _fake_runs(page: Any) -> tuple[str, str, dict[str, Any]]:
    """Two runs served by the browser's router (no real job: seconds, not minutes): run A is still running, 10 s a
    step from 12:00:00, run B finished, 20 s a step an hour later; both report lm_loss and tokens (1000 a step).
    Returns their ids and the live state the test changes (A's points and state)."""
    run_a, run_b = str(uuid.uuid4()), str(uuid.uuid4())
    state: dict[str, Any] = {
        run_a: {"state": "running", "steps": 3, "t0": 0, "dt": 10, "lr": 1e-3},
        run_b: {"state": "succeeded", "steps": 4, "t0": 3600, "dt": 20, "lr": 3e-3},
    }

    def points(job: str) -> list[dict[str, Any]]:
        run, rows = state[job], []
        for step in range(1, run["steps"] + 1):
            seconds = run["t0"] + run["dt"] * (step - 1)
            time_ = f"2026-01-01T12:{seconds // 60 % 60:02d}:{seconds % 60:02d}+00:00".replace(
                "T12", f"T{12 + seconds // 3600}"
            )
            for k, (name, value) in enumerate((("lm_loss", 10.0 / step + run["lr"]), ("tokens", 1000.0))):
                rows.append(
                    {"id": step * 10 + k, "step": step, "rank": None, "name": name, "value": value, "time": time_}
                )
        return rows

    def handle(route: Any) -> None:
        url = route.request.url
        job = next(j for j in state if j in url)
        if "/metrics" not in url:
            run = state[job]
            body = {
                "id": job,
                "name": f"run-{job[:4]}",
                "state": run["state"],
                "kind": "train",
                "spec": {"kind": "train", "lr": run["lr"]},
                "metadata": {},
            }
            route.fulfill(status=200, content_type="application/json", body=json.dumps(body))
            return
        after = re.search(r"after=(\d+)%3A(\d+)", url)
        cursor = (int(after.group(1)), int(after.group(2))) if after else (-1, -1)
        rows = [p for p in points(job) if (p["step"], p["id"]) > cursor]
        last = f"{rows[-1]['step']}:{rows[-1]['id']}" if rows else (after and f"{after.group(1)}:{after.group(2)}")
        body = {
            "data": rows,
            "has_more": False,
            "next_since_step": rows[-1]["step"] if rows else None,
            "next_cursor": last,
        }
        route.fulfill(status=200, content_type="application/json", body=json.dumps(body))

    for job in state:
        page.route(re.compile(rf".*/v1/jobs/{job}(/metrics.*)?$"), handle)
    return run_a, run_b, state


def _plotted(page: Any) -> dict[str, Any]:
    return page.evaluate("""() => { const c = document.querySelector(".compare-chart .chart").chart;
        return {axis: c.el.dataset.xAxis, labels: c.u.series.map((s) => s.label), data: c.u.data.map((a) => Array.from(a))}; }""")


def test_compare_follows_running_runs_on_every_x_axis(page: Any, service: Service) -> None:  # noqa: F811
    """The compare page polls a run that is still running (its new points join the chart, its state badge follows,
    polling stops when it ends) and plots each run on its own relative time, wall time or consumed tokens."""
    run_a, run_b, state = _fake_runs(page)
    page.goto(service.url + "/")
    page.evaluate("t => localStorage.setItem('llmjobs.token', t)", service.token)
    page.goto(f"{service.url}/#/compare?ids={run_a},{run_b}&x=relative")
    page.wait_for_selector('.compare-chart .chart[data-chart="lm_loss"][data-x-axis="relative"]')
    assert page.locator("#compare-status [data-live]").get_attribute("data-live") == "1"
    plotted = _plotted(page)
    # Each run from its own start: A every 10 s, B every 20 s; one aligned x array, gaps where a run has no point.
    assert plotted["data"][0] == [0, 10, 20, 40, 60]
    assert plotted["data"][1] == pytest.approx([10.001, 5.001, 10 / 3 + 0.001, None, None])
    assert plotted["data"][2] == pytest.approx([10.003, None, 5.003, 10 / 3 + 0.003, 2.503])

    # A reports two more steps and finishes: the next poll (3 s) brings them, the same chart redraws.
    state[run_a].update(steps=5, state="succeeded")
    page.wait_for_function(
        """() => document.querySelector(".compare-chart .chart").chart.u.data[0].includes(30)""", timeout=15_000
    )
    page.wait_for_selector('#compare-status [data-live="0"]')
    assert page.locator(f'#compare-best tr[data-job="{run_a}"] .badge').get_attribute("data-state") == "succeeded"
    plotted = _plotted(page)
    assert plotted["data"][0] == [0, 10, 20, 30, 40, 60]
    assert plotted["data"][1][3:5] == pytest.approx([2.501, 2.001])

    # Consumed tokens (each run's own cumulative sum) and wall time; the choice goes into the URL.
    page.select_option("#x-axis", "tokens")
    page.wait_for_selector('.compare-chart .chart[data-x-axis="tokens"]')
    assert "x=tokens" in page.url
    assert _plotted(page)["data"][0] == [1000, 2000, 3000, 4000, 5000]
    page.select_option("#x-axis", "wall")
    page.wait_for_selector('.compare-chart .chart[data-x-axis="wall"]')
    xs = _plotted(page)["data"][0]
    start = 1767268800  # 2026-01-01T12:00:00Z
    assert xs[0] == start and xs[-1] == start + 3600 + 60 and len(xs) == 9


def test_job_list_sorts_on_the_server_across_pages(page: Any, service: Service) -> None:  # noqa: F811
    """A click on a column the API sorts by (name) orders every page, not just the one shown: one job a page, the
    pager walks a, b, c; the order is in the URL; a second click reverses it."""
    tag = f"sort-{uuid.uuid4().hex[:6]}"
    body, _ = readme_example()
    with service.client() as client:
        for suffix in ("c", "a", "b"):  # created in another order than their names'
            created = client.post(
                "/v1/jobs",
                json={
                    **body,
                    "name": f"{tag}-{suffix}",
                    "metadata": {"sortcheck": tag},
                    "output_prefix": f"demo/out/{tag}-{suffix}",
                },
            )
            assert created.status_code == 201, created.text
            client.post(f"/v1/jobs/{created.json()['id']}/cancel")  # they need not run
    page.goto(service.url + "/")
    page.evaluate("t => localStorage.setItem('llmjobs.token', t)", service.token)
    page.goto(f"{service.url}/#/jobs?meta=sortcheck={tag}&limit=1&refresh=off")
    page.wait_for_selector(f'tr[data-job] >> text="{tag}-b"')  # newest first by default
    page.click('th[data-col="name"] button')
    page.wait_for_selector(f'tr[data-job] >> text="{tag}-a"')
    assert "sort=name" in page.url and page.inner_text("#page-older") == "Next ›"
    for suffix in ("b", "c"):
        page.click("#page-older")
        page.wait_for_selector(f'tr[data-job] >> text="{tag}-{suffix}"')
    assert page.is_disabled("#page-older") and "after=" in page.url
    page.click('th[data-col="name"] button')  # descending, from the first page again
    page.wait_for_selector('th[data-col="name"][aria-sort="descending"]')
    page.wait_for_selector("#page-older:not([disabled])")
    assert page.inner_text("tr[data-job] td a") == f"{tag}-c"
    assert "sort=-name" in page.url and "after=" not in page.url


def test_spec_tab_marks_values_read_from_the_checkpoint(page: Any, service: Service) -> None:  # noqa: F811
    """The Spec tab of a job that loads a checkpoint: the values the engine recorded from it (its `config` event)
    are marked "from the checkpoint" with their value, distinct from what the user set and from schema defaults
    (rotary_base: the checkpoint's 1000000, not the default 10000); before the run read them, they say so."""
    job_id = str(uuid.uuid4())
    values = {"num_layers": 28, "hidden_size": 1024, "rotary_base": 1e6, "padded_vocab_size": 151936}
    recorded: list[dict[str, Any]] = [
        {
            "id": 7,
            "attempt": 1,
            "time": "2026-01-01T12:00:00Z",
            "type": "config",
            "level": "info",
            "message": "model shape from the checkpoint",
            "data": {"source": "checkpoint", "load": "/data/qwen3-0.6b", "format": "hf", "values": values},
        }
    ]
    page.route(
        re.compile(rf".*/v1/jobs/{job_id}/events\?.*type=config.*"),
        lambda route: route.fulfill(
            status=200, content_type="application/json", body=json.dumps({"data": recorded, "has_more": False})
        ),
    )
    page.goto(service.url + "/")
    page.evaluate("t => localStorage.setItem('llmjobs.token', t)", service.token)
    render = """async ([jobId]) => {
        const {renderSpec} = await import("/ui/js/views/spec_panel.js");
        const el = document.createElement("div");
        document.body.append(el);
        await renderSpec(el, {id: jobId, kind: "train", spec: {kind: "train", load: "/data/qwen3-0.6b", lr: 1e-4, num_layers: 28}}, null);
        const rows = {};
        for (const tr of el.querySelectorAll("#spec-effective tr[data-field]"))
            rows[tr.dataset.field] = {source: tr.dataset.source, value: tr.querySelector("td").textContent,
                                      title: tr.querySelectorAll("td")[1].title};
        el.remove();
        return {rows, note: el.querySelector(".toolbar").textContent};
    }"""
    got = page.evaluate(render, [job_id])
    rows = got["rows"]
    assert rows["lr"]["source"] == "set" and rows["num_layers"]["source"] == "set"  # set by the user, even if equal
    assert rows["hidden_size"] == {"source": "checkpoint", "value": "1024", "title": "/data/qwen3-0.6b (hf)"}
    assert rows["rotary_base"]["source"] == "checkpoint" and rows["rotary_base"]["value"] == "1000000"
    assert rows["norm_epsilon"]["source"] == "default"  # not recorded: the schema's default
    assert "read from the checkpoint /data/qwen3-0.6b (hf)" in got["note"]
    recorded.clear()  # the job has not started: nothing recorded yet
    rows = page.evaluate(render, [job_id])["rows"]
    assert rows["hidden_size"]["source"] == "checkpoint-unread" and rows["hidden_size"]["value"] == "—"
    assert rows["rotary_base"]["source"] == "default"


def _sse(*chunks: dict[str, Any]) -> str:
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


def test_chat_page_streams_answers_and_compares_two_models(page: Any, service: Service) -> None:  # noqa: F811
    """The chat page (issue 24): the team's models in the picker (an adapter named as such), a streamed answer with
    its thought apart, the system prompt, thinking switch and sampling in the request, the conversation carried to the
    next turn, two models side by side on one message, and the API's OpenAI-shaped 429 shown in the panel. The API's
    answers are Playwright routes: the real route and engine are tested by tests/e2e/test_serve_e2e.py."""
    models = [
        {"id": "ckpt-a", "object": "model", "created": 0, "owned_by": "default", "root": "/m/a", "parent": None},
        {"id": "ckpt-b", "object": "model", "created": 0, "owned_by": "default", "root": "/m/b", "parent": None},
        {"id": "tuned", "object": "model", "created": 0, "owned_by": "default", "root": "/m/l", "parent": "ckpt-a"},
    ]
    answers = {
        "ckpt-a": [
            {"choices": [{"index": 0, "delta": {"reasoning_content": "They want jazz."}}]},
            {"choices": [{"index": 0, "delta": {"content": "Playing jazz."}, "finish_reason": "stop"}]},
            {"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17}},
        ],
        "ckpt-b": [{"choices": [{"index": 0, "delta": {"content": "Jazz it is."}, "finish_reason": "stop"}]}],
    }
    asked: list[dict[str, Any]] = []

    def chat(route: Any) -> None:
        body = route.request.post_data_json
        asked.append(body)
        if body["model"] == "tuned":
            error = {"error": {"message": "the queue is full; retry after 1 s", "type": "rate_limit_error"}}
            route.fulfill(status=429, content_type="application/json", body=json.dumps(error))
        else:
            route.fulfill(status=200, content_type="text/event-stream", body=_sse(*answers[body["model"]]))

    page.route(
        re.compile(r".*/v1/models$"),
        lambda route: route.fulfill(
            status=200, content_type="application/json", body=json.dumps({"object": "list", "data": models})
        ),
    )
    page.route(re.compile(r".*/v1/chat/completions$"), chat)
    page.goto(service.url + "/")
    page.evaluate("t => localStorage.setItem('llmjobs.token', t)", service.token)
    page.goto(service.url + "/#/chat")
    page.wait_for_selector("select.chat-model option[value='tuned']", state="attached")
    assert page.locator("select.chat-model option[value='tuned']").inner_text() == "tuned (adapter of ckpt-a)"
    page.fill("#chat-system", "You control a smart home.")
    page.uncheck("#chat-thinking")
    page.fill("#chat-temperature", "0")
    page.fill("#chat-message", "play jazz")
    page.click("#chat-send")
    first = page.locator(".chat-log[data-panel='0'] .chat-msg.assistant").last
    first.locator(".chat-content", has_text="Playing jazz.").wait_for()
    assert first.locator(".chat-thought").text_content() == "They want jazz."  # folded under "Thought"
    assert first.locator("details.chat-thinking summary").is_visible()
    assert "5 tokens" in page.locator(".chat-panel .chat-note").first.inner_text()
    sent = asked[-1]
    assert sent["model"] == "ckpt-a" and sent["stream"] is True and sent["temperature"] == 0
    assert sent["chat_template_kwargs"] == {"enable_thinking": False}
    assert sent["messages"] == [
        {"role": "system", "content": "You control a smart home."},
        {"role": "user", "content": "play jazz"},
    ]

    page.check("#chat-compare")
    page.select_option("select.chat-model[data-panel='1']", "ckpt-b")
    page.fill("#chat-message", "louder")
    page.click("#chat-send")
    page.locator(".chat-log[data-panel='1'] .chat-content", has_text="Jazz it is.").wait_for()
    page.wait_for_function(
        "() => document.querySelectorAll(\".chat-log[data-panel='0'] .chat-msg.assistant\").length === 2"
    )
    by_model = {body["model"]: body["messages"] for body in asked[-2:]}
    assert [m["content"] for m in by_model["ckpt-a"]] == [
        "You control a smart home.",
        "play jazz",
        "Playing jazz.",
        "louder",
    ]
    assert [m["content"] for m in by_model["ckpt-b"]] == ["You control a smart home.", "louder"]  # its own conversation
    assert "models=ckpt-a%2Cckpt-b" in page.url or "models=ckpt-a,ckpt-b" in page.url
    assert _axe_violations(page) == []

    page.select_option("select.chat-model[data-panel='1']", "tuned")
    page.fill("#chat-message", "again")
    page.click("#chat-send")
    page.locator(".chat-log[data-panel='1'] .chat-msg.assistant.error", has_text="429: the queue is full").wait_for()


def test_completions_tab_pages_a_grpo_run_s_completions(page: Any, service: Service) -> None:  # noqa: F811
    """The job page's completions tab reads GET /v1/jobs/{id}/completions from the real API: each row's prompt,
    completion (cut ones marked), reward, per-function scores ("—" for an http reward's failed batch) and
    advantage, 50 a page with Next / Previous, or one rollout by iteration. The rows are written where a stage grpo
    run writes them (its run directory's completions.jsonl); the tab button shows for stage grpo jobs only."""
    body, _ = readme_example()
    name = f"completions-{uuid.uuid4().hex[:6]}"
    with service.client() as client:
        job = client.post("/v1/jobs", json={**body, "name": name, "output_prefix": f"demo/out/{name}"}).json()
    rows = [
        {
            "iteration": it, "prompt_id": i // 4, "prompt_ids": [1, 2, 3], "prompt": f"<|im_start|>user\nq{i // 4}",
            "completion_ids": [4, i], "completion": ("long " * 40 if i == 1 else f"answer {i}"),
            "reward": float(i % 2), "rewards": {"exact_match": float(i % 2), "http": None if i == 2 else 0.5},
            "advantage": 0.5 - i % 2, "truncated": i == 3,
        }
        for it in (1, 2) for i in range(40)
    ]  # fmt: skip
    run = Path(job["run_dir"])
    run.mkdir(parents=True, exist_ok=True)
    (run / "completions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    page.goto(f"{service.url}/")
    page.evaluate("t => localStorage.setItem('llmjobs.token', t)", service.token)
    page.goto(f"{service.url}/#/jobs/{job['id']}?tab=completions")
    page.wait_for_selector("#completions-table tbody tr")
    page.wait_for_selector(".job-head h2")  # the job itself has loaded, so its tab bar is final
    assert page.locator('button[data-tab="completions"]').is_hidden()  # a preprocess job: no tab of its own
    table = page.locator("#completions-table")
    assert table.locator("tbody tr").count() == 50 and page.inner_text("#completions-note") == "completions 1–50"
    headers = table.locator("thead th").all_text_contents()  # (inner text is upper-cased by the style)
    assert headers == ["Iteration", "Prompt", "Completion", "Reward", "exact_match", "http", "Advantage"]
    third = table.locator("tbody tr").nth(2).locator("td").all_text_contents()
    assert third[0] == "1" and "q0" in third[1] and third[2] == "answer 2" and third[4:] == ["0", "—", "0.5"]
    assert "truncated" in table.locator("tbody tr").nth(3).inner_text()
    assert table.locator("tbody tr").nth(1).locator("details").count() == 1  # a long completion opens on demand
    page.click("#completions-next")
    page.wait_for_selector("#completions-note:has-text('completions 51–80')")
    assert table.locator("tbody tr").count() == 30 and page.locator("#completions-next").is_disabled()
    page.fill("#completions-step", "2")
    page.click(".completions-panel button[type=submit]")
    page.wait_for_selector("#completions-note:has-text('completions 1–40')")
    assert set(table.locator("tbody tr").evaluate_all("rows => rows.map((r) => r.dataset.iteration)")) == {"2"}

    def as_grpo(route: Any) -> None:  # the same job as the API gives it, seen as a stage grpo run
        real = route.fetch().json()
        route.fulfill(json={**real, "kind": "train", "spec": {**real["spec"], "stage": "grpo"}})

    page.route(re.compile(rf".*/v1/jobs/{job['id']}$"), as_grpo)
    page.reload()
    page.wait_for_selector(".job-head h2")
    assert page.locator('button[data-tab="completions"]').is_visible()
