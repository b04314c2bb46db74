"""What a notebook does with the official ``mlflow`` client, run by ``test_mlflow_api.py`` in an interpreter that has
it (MLFLOW_TRACKING_URI / MLFLOW_TRACKING_TOKEN in the environment). Prints what it saw as one JSON object.

usage: python mlflow_notebook.py log EXPERIMENT | read EXPERIMENT JOB_EXPERIMENT JOB_ID | outsider EXPERIMENT RUN_ID
       | stranger EXPERIMENT"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from typing import Any

import mlflow
from mlflow import MlflowClient
from mlflow.entities import Metric, Param
from mlflow.exceptions import MlflowException


def error_code(call: Any) -> str | None:
    try:
        call()
    except MlflowException as err:
        return str(err.error_code)
    return None


def log(experiment: str) -> dict[str, Any]:
    mlflow.set_experiment(experiment)  # get-by-name answers 404: the client creates it
    seen: dict[str, Any] = {"runs": {}}
    for name, lr, losses in (("a", 0.1, [3.0, 1.5]), ("b", 0.01, [2.8, 2.5]), ("c", 0.3, [2.0, 0.5])):
        with mlflow.start_run(run_name=name) as run:
            mlflow.log_param("lr", lr)
            mlflow.log_params({"rank": 8, "optimizer": "adamw"})
            mlflow.log_metric("loss", losses[0], step=0)
            mlflow.log_metrics({"loss": losses[1], "grad_norm": math.nan}, step=1)
            mlflow.set_tag("note", "first")
            mlflow.set_tag("note", "last")
            mlflow.log_param("lr", lr)  # the same value again is fine
            seen["changed_param"] = error_code(lambda: mlflow.log_param("lr", 99))
            seen["runs"][name] = run.info.run_id
    client = MlflowClient()
    run_id = seen["runs"]["a"]
    # the client splits these into the server's batch limits (1000 metrics, 100 params)
    client.log_batch(run_id, metrics=[Metric("m", float(i), 0, i) for i in range(1001)])
    client.log_batch(run_id, params=[Param(f"p{i}", "v") for i in range(101)])
    return seen


def read(experiment: str, job_experiment: str, job_id: str) -> dict[str, Any]:
    client = MlflowClient()
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None
    ids = [exp.experiment_id]
    low = client.search_runs(ids, "metrics.loss < 2 AND params.optimizer = 'adamw'", order_by=["metrics.loss ASC"])
    first = client.search_runs(ids, order_by=["params.lr DESC"], max_results=2)
    rest = client.search_runs(ids, order_by=["params.lr DESC"], max_results=2, page_token=first.token)
    run_a = client.search_runs(ids, "attributes.run_name = 'a' AND tags.note = 'last'")[0]
    job_exp = client.get_experiment_by_name(job_experiment)
    assert job_exp is not None
    job_runs = client.search_runs([job_exp.experiment_id], "attributes.status = 'FINISHED'")
    return {
        "low_loss": [(r.info.run_name, r.data.metrics["loss"]) for r in low],
        "pages": [[r.info.run_name for r in first], [r.info.run_name for r in rest], rest.token],
        "run_a": {
            "params": run_a.data.params,
            "note": run_a.data.tags["note"],
            "status": run_a.info.status,
            "grad_norm_is_nan": math.isnan(run_a.data.metrics["grad_norm"]),
            "loss_history": [(m.step, m.value) for m in client.get_metric_history(run_a.info.run_id, "loss")],
            "m_points": len(client.get_metric_history(run_a.info.run_id, "m")),
        },
        "bad_filter": error_code(lambda: client.search_runs(ids, "metrics.loss <")),
        "job_runs": [
            {
                "run_id": r.info.run_id,
                "name": r.info.run_name,
                "params": r.data.params,
                "tags": r.data.tags,
                "metrics": r.data.metrics,
                "history": [(m.step, m.value) for m in client.get_metric_history(r.info.run_id, "lm_loss")],
            }
            for r in job_runs
        ],
        "job_run_read_only": error_code(lambda: client.log_param(job_id, "x", "1")),
    }


def outsider(experiment: str, run_id: str) -> dict[str, Any]:
    client = MlflowClient()
    return {
        "experiment": client.get_experiment_by_name(experiment) is not None,
        "get_run": error_code(lambda: client.get_run(run_id)),
        "search": [r.info.run_id for r in client.search_runs(["0"])],
        "log": error_code(lambda: client.log_metric(run_id, "loss", 1.0)),
    }


def stranger(experiment: str) -> dict[str, Any]:
    """With a token the service does not know (MLFLOW_TRACKING_TOKEN set by the caller)."""
    client = MlflowClient()
    try:
        client.search_runs(["0"])
    except MlflowException as err:
        search = {"code": str(err.error_code), "message": err.message}
    return {"search": search, "set_experiment": error_code(lambda: mlflow.set_experiment(experiment))}


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    calls: dict[str, Callable[..., dict[str, Any]]] = {
        "log": log,
        "read": read,
        "outsider": outsider,
        "stranger": stranger,
    }
    print(json.dumps(calls[mode](*args)))
