"""The dashboard's sweep page and grouped runs list in chromium (issue 48), against the module's real `llmjobs serve`.

The runs list reads real jobs and a real notebook run logged through the MLflow API. The sweep page reads a sweep
answered by a Playwright route (a real sweep's trials would be training jobs; the sweep API itself is tested by
tests/unit/core/test_sweeps.py and tests/integration/test_sweep_worker.py)."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from test_dashboard_browser import browser, page, strict_page  # noqa: F401 - chromium, pages with error checks
from test_service_e2e import Service, readme_example, service  # noqa: F401 - the module-scoped `llmjobs serve`

SWEEP_ID = "00000000-0000-4000-8000-000000000048"
TRIALS = [  # number, state, lr, lora_r, value
    (0, "succeeded", 0.01, 8, 1.2),
    (1, "pruned", 0.0001, 4, 3.9),
    (2, "succeeded", 0.003, 16, 0.8),
    (3, "pruned", 0.0002, 8, 3.1),
    (4, "running", 0.02, 4, None),
]


def fake_sweep() -> dict[str, Any]:
    trials = [
        {
            "number": n,
            "job_id": f"job-{n}",
            "name": f"s/{n}",
            "state": state,
            "params": {"lr": lr, "lora_r": r},
            "value": value,
            "step": 10 if value is not None else None,
        }
        for n, state, lr, r, value in TRIALS
    ]
    space = {"lr": {"low": 1e-4, "high": 3e-2, "log": True}, "lora_r": {"choices": [4, 8, 16]}}
    spec = {"space": space, "sampler": "tpe", "pruner": "median", "metric": "lm_loss", "direction": "minimize"}
    result = {"best_job": "job-2", "best_value": 0.8, "best_params": {"lr": 0.003, "lora_r": 16}}
    return {
        "id": SWEEP_ID,
        "name": "demo-lora",
        "state": "succeeded",
        "metric": "lm_loss",
        "direction": "minimize",
        "spec": spec,
        "trials": trials,
        "result": result,
        "created_at": "",
        "finished_at": "",
    }


def _rows(page: Any) -> list[str]:  # noqa: F811
    return page.eval_on_selector_all("table.trials tbody tr", "rows => rows.map(r => r.dataset.job)")


def test_sweep_page_sorts_greys_pruned_and_marks_the_best(page: Any, service: Service) -> None:  # noqa: F811
    body = json.dumps(fake_sweep())
    page.route(
        re.compile(rf".*/v1/sweeps/{SWEEP_ID}$"),
        lambda r: r.fulfill(status=200, content_type="application/json", body=body),
    )
    page.goto(service.url + "/")
    page.evaluate("t => localStorage.setItem('llmjobs.token', t)", service.token)
    page.goto(f"{service.url}/#/sweeps/{SWEEP_ID}")
    page.wait_for_selector("table.trials tbody tr")
    assert _rows(page) == ["job-2", "job-0", "job-3", "job-1", "job-4"]  # by the metric, lowest first; no value last
    assert page.eval_on_selector_all("tr.pruned", "rows => rows.map(r => r.dataset.job)") == ["job-3", "job-1"]
    assert page.eval_on_selector_all("tr.best", "rows => rows.map(r => r.dataset.job)") == ["job-2"]
    grey = page.eval_on_selector("tr.pruned td", "td => getComputedStyle(td).color")
    assert grey == "rgb(156, 163, 175)"
    page.click("th[data-sort='value']")
    assert _rows(page) == ["job-1", "job-3", "job-0", "job-2", "job-4"] and "sort=-value" in page.url
    page.click("th[data-sort='number']")
    assert _rows(page) == ["job-0", "job-1", "job-2", "job-3", "job-4"]
    for param in ("lr", "lora_r"):  # one scatter per searched field: the four trials with a value
        dots = f"svg.scatter[data-param='{param}'] circle"
        assert page.locator(dots).count() == 4
        assert page.locator(f"{dots}.pruned").count() == 2 and page.locator(f"{dots}.best").count() == 1
    assert "Best: job-2" in page.locator(".best-line").inner_text()


def test_runs_list_groups_jobs_and_notebook_runs(page: Any, service: Service) -> None:  # noqa: F811
    tag = uuid.uuid4().hex[:8]
    with service.client() as client:
        body, _ = readme_example()
        for i, group in enumerate(("a", "a", "b")):
            spec = {
                **body,
                "name": f"grp-{tag}-{i}",
                "output_prefix": f"demo/out/grp-{i}",
                "metadata": {"experiment": f"exp-{tag}", "arm": f"{group}-{tag}"},
            }
            assert client.post("/v1/jobs", json=spec).status_code == 201
        mlflow = "/api/2.0/mlflow"
        exp = client.post(f"{mlflow}/experiments/create", json={"name": f"nb-{tag}"}).json()["experiment_id"]
        run = client.post(f"{mlflow}/runs/create", json={"experiment_id": exp, "run_name": f"notebook-{tag}"}).json()
        client.post(
            f"{mlflow}/runs/set-tag", json={"run_id": run["run"]["info"]["run_id"], "key": "arm", "value": f"a-{tag}"}
        )
    page.goto(service.url + "/")
    page.evaluate("t => localStorage.setItem('llmjobs.token', t)", service.token)
    page.goto(f"{service.url}/#/runs?group=experiment")
    jobs_group = page.locator(f"section.run-group[data-group='exp-{tag}']")
    jobs_group.wait_for()
    assert jobs_group.locator("tbody tr").count() == 3
    notebook = page.locator(f"section.run-group[data-group='nb-{tag}'] tr.notebook")
    assert notebook.count() == 1 and f"notebook-{tag}" in notebook.inner_text()
    page.goto(f"{service.url}/#/runs?group=label&label=arm")
    page.locator(f"section.run-group[data-group='a-{tag}']").wait_for()
    by_label = page.locator(f"section.run-group[data-group='a-{tag}'] tbody tr")
    assert by_label.count() == 3  # two jobs and the notebook run tagged arm=a-<tag>
    assert page.locator(f"section.run-group[data-group='b-{tag}'] tbody tr").count() == 1


def test_both_pages_render_under_the_dashboards_csp(strict_page: Any, service: Service) -> None:  # noqa: F811
    """With the page's own Content-Security-Policy (the fixture fails on any console error): the scatter's SVG and
    the grouped tables are built with DOM calls only. A notebook run of its own, so the runs list has a group in any
    order of the module (alone, the shared service may hold no run yet)."""
    with service.client() as client:
        mlflow, tag = "/api/2.0/mlflow", uuid.uuid4().hex[:8]
        exp = client.post(f"{mlflow}/experiments/create", json={"name": f"csp-{tag}"}).json()["experiment_id"]
        assert client.post(f"{mlflow}/runs/create", json={"experiment_id": exp, "run_name": f"csp-{tag}"}).is_success
    body = json.dumps(fake_sweep())
    strict_page.route(
        re.compile(rf".*/v1/sweeps/{SWEEP_ID}$"),
        lambda r: r.fulfill(status=200, content_type="application/json", body=body),
    )
    strict_page.goto(service.url + "/")
    strict_page.evaluate("t => localStorage.setItem('llmjobs.token', t)", service.token)
    for route, selector in ((f"#/sweeps/{SWEEP_ID}", "svg.scatter circle.best"), ("#/runs", "section.run-group")):
        strict_page.goto(f"{service.url}/{route}")
        strict_page.wait_for_selector(selector)
