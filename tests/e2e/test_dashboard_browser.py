"""The dashboard in a real browser (Debian's chromium through Playwright) against `llmjobs serve`: sign in with a
token, a bad spec's field highlighted, a preprocess job submitted from the form reaching succeeded in the list, its
events / logs / artifacts, live charts fed by a real short train job's metrics over SSE, the view kept across a
reload, cancel, the hosts page, and min/max decimation keeping 100k-point series fast and exact at their extremes."""

from __future__ import annotations

import json
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
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
SCREENSHOT = Path("/tmp/llmjobs-dashboard.png")
JOB_TIMEOUT_MS = 150_000
# A real model shape with Qwen3's vocabulary (the demo data is tokenized with the real Qwen3 tokenizer), tiny widths.
TINY_TRAIN: dict[str, Any] = {
    "kind": "train", "split": "100,0,0", "train_iters": 6, "lr": 3e-3, "lr_warmup_iters": 2, "lr_decay_style": "cosine",
    "seq_length": 128, "micro_batch_size": 2, "global_batch_size": 4, "log_interval": 1, "is_instruction_dataset": True,
    "finetune": True, "stage": "sft", "num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 4,
    "group_query_attention": True, "num_query_groups": 2, "kv_channels": 16, "qk_layernorm": True,
    "padded_vocab_size": 151936, "normalization": "RMSNorm", "position_embedding_type": "rope", "swiglu": True,
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
    page.on("console", lambda msg: errors.append(msg.text)
            if msg.type == "error" and not msg.text.startswith("Failed to load resource") else None)
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
    return page.evaluate("""(title) => {
        const canvas = document.querySelector(`.chart[data-chart="${title}"] canvas`);
        const data = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height).data;
        let n = 0;
        for (let i = 0; i < data.length; i += 4)
            if (Math.abs(data[i] - 37) < 40 && Math.abs(data[i + 1] - 99) < 40 && data[i + 2] > 180) n++;
        return n;
    }""", chart)


def _set_range(page: Any, selector: str, value: float) -> None:
    page.eval_on_selector(selector, """(el, v) => { el.value = String(v); el.dispatchEvent(new Event("input"));
        el.dispatchEvent(new Event("change")); }""", value)


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
    page.select_option("#x-axis", "relative")
    page.wait_for_selector(f'{loss}[data-x-axis="relative"]')
    assert page.is_disabled('#x-axis option[value="tokens"]') is False  # the train job reports `tokens`
    # Zoom to steps 2..5 (as a drag does), then a redraw as a live update would: the zoom stays.
    over = page.locator('.chart[data-chart="Grad norm"] .u-over')
    over.scroll_into_view_if_needed()
    box = over.bounding_box()
    page.mouse.move(box["x"] + box["width"] * 0.3, box["y"] + 20)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] * 0.7, box["y"] + 20, steps=5)
    page.mouse.up()
    page.wait_for_function("document.querySelector('.chart[data-chart=\"Grad norm\"]').dataset.zoom !== ''")
    zoom = page.get_attribute('.chart[data-chart="Grad norm"]', "data-zoom")
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
        created = client.post("/v1/jobs", json={**TINY_TRAIN, "name": f"{name}-train", "data_path": [data_path]})
        assert created.status_code == 201, created.text
        train_id = created.json()["id"]

    # Meanwhile: the list shows the preprocess job as succeeded, also under the state filter, and the hosts page.
    page.goto(f"{service.url}/#/jobs")
    page.wait_for_selector(f'tr[data-job="{pre_id}"][data-state="succeeded"]')
    page.select_option("#f-state", "succeeded")
    page.wait_for_selector(f'tr[data-job="{train_id}"]', state="detached")  # the filtered page has arrived
    assert page.locator("tr[data-job]").evaluate_all("rows => rows.map((r) => r.dataset.state)") == ["succeeded"]
    assert page.locator(f'tr[data-job="{pre_id}"]').count() == 1 and "state=succeeded" in page.url
    page.goto(f"{service.url}/#/hosts")
    page.wait_for_selector('tr[data-host="e2e-host"] .badge.health-up')

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
    page.screenshot(path=str(SCREENSHOT), full_page=True)

    # The page's stream client (fetch + Authorization header, no token in the URL) resumes after an id exactly, and
    # its parser gives the same messages whatever the chunking (here one character at a time).
    resume = page.evaluate("""async ([jobId, token]) => {
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
    }""", [train_id, service.token])
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
            route.fulfill(status=200, headers={"Content-Type": "text/event-stream"}, body="\r\n\r\n".join(half) + "\r\n\r\n")
        else:
            resumed_with.append(route.request.headers.get("last-event-id"))
            route.continue_()

    page.route(f"**/v1/jobs/{train_id}/stream", drop_first)
    dropped = page.evaluate("""async ([jobId, token]) => {
        const {JobStream} = await import("/ui/js/sse.js");
        const got = await new Promise((resolve) => {
            const all = [];
            new JobStream(`/v1/jobs/${jobId}/stream`, token, {onBatch: (m) => all.push(...m), onStatus: (s) => s === "ended" && resolve(all)}).start();
        });
        return got.filter((m) => m.event !== "end").map((m) => JSON.stringify([m.event, m.data]));
    }""", [train_id, service.token])
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
        cancel_id = client.post("/v1/jobs", json={**body, "name": f"{name}-cancel", "output_prefix": f"demo/out/{name}-c"}).json()["id"]
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
    page.wait_for_selector(f'tr[data-job="{pre_id}"]')
    assert page.is_disabled("#page-older")
    page.click("#page-newer")
    page.wait_for_selector(f'tr[data-job="{train_id}"]')
    assert time.monotonic() - started < 150


def test_decimation_keeps_100k_point_series_fast_and_exact(strict_page: Any, service: Service) -> None:  # noqa: F811
    # Under the page's own CSP: every view renders without a violation (the fixture fails on console errors).
    page = strict_page
    page.goto(service.url + "/")
    page.evaluate("t => localStorage.setItem('llmjobs.token', t)", service.token)
    with service.client() as client:
        body, _ = readme_example()
        job_id = client.post("/v1/jobs", json={**body, "name": "csp", "output_prefix": "demo/out/csp"}).json()["id"]
    for route, selector in ((f"#/jobs/{job_id}", ".job-head .badge"), ("#/jobs", f'tr[data-job="{job_id}"]'),
                            ("#/submit", ".reference dt"), ("#/hosts", "tr[data-host]")):
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
    print(f"decimation of 3 series, {result['points']} points, {result['columns']} columns: "
          f"{result['drawn']} drawn, median draw {result['medianMs']:.1f} ms")
    assert result["points"] == 100_000 * 2 + 66_667
    assert result["drawn"] <= 2 * (result["columns"] + 2)
    assert result["sorted"] and result["aligned"]
    # The extremes survive: the spike, the dip and the other rank's maximum.
    assert result["maxLoss"] > 50 and result["minLoss"] < 0
    assert result["maxMem1"] == 2499
    # Zoomed to 600 steps on an 800-pixel chart: every point, the spike included (plus one neighbour each side).
    assert result["zoomLen"] == 603 and result["zoomHasSpike"]
    assert result["medianMs"] < 250, result
