"""MLflow's tracking REST API under /api/2.0/mlflow/, so a notebook's ``mlflow`` client (``MLFLOW_TRACKING_URI`` =
this service, ``MLFLOW_TRACKING_TOKEN`` = a team token) lists, filters and reads the team's jobs as runs and logs its
own runs beside them (``core.mlflow_store``).

Errors keep MLflow's shape ``{"error_code", "message"}`` (the client branches on the code): ``MlflowRoute`` answers
them itself, so the app's own error handlers never rewrite them. A missing or bad token is a 401
``UNAUTHENTICATED`` answered before the body is read (``app.auth_first``); writing to a job's run is a 403
``PERMISSION_DENIED`` (the service writes it), as MLflow's own codes for those two."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field

from app.api.deps import PrincipalDep, SessionDep
from core import mlflow_store as store
from core.errors import ApiError
from core.mlflow_errors import MlflowError

_API_CODES = {401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "RESOURCE_DOES_NOT_EXIST"}


class MlflowRoute(APIRoute):
    """A route whose errors (its own, the body's validation, the service's) come out in MLflow's shape."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def run(request: Request) -> Response:
            try:
                return await handler(request)
            except MlflowError as err:
                return JSONResponse(err.body(), status_code=err.status)
            except RequestValidationError as err:
                first = err.errors()[0] if err.errors() else {}
                where = ".".join(str(p) for p in first.get("loc", ()) if p not in ("body", "query"))
                bad = MlflowError(f"Invalid value for parameter '{where}': {first.get('msg', 'invalid')}")
                return JSONResponse(bad.body(), status_code=400)
            except ApiError as err:
                code = _API_CODES.get(err.status, "INVALID_PARAMETER_VALUE")
                return JSONResponse({"error_code": code, "message": err.message}, err.status, headers=err.headers)

        return run


# Left out of the OpenAPI document: MLflow's own REST reference documents these routes and their error shape, which
# is not the service's {code, message, field} (the API fuzzing checks every documented route for that one).
router = APIRouter(prefix="/api/2.0/mlflow", tags=["mlflow"], route_class=MlflowRoute, include_in_schema=False)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")  # newer clients send fields (model_id, dataset_name) this store ignores


class KeyValue(_Body):
    key: str = Field(max_length=store.MAX_KEY)
    value: str = ""


class CreateExperiment(_Body):
    name: str = Field(max_length=500)
    artifact_location: str | None = None
    tags: list[KeyValue] = Field(default_factory=list)


class RunRef(_Body):
    run_id: str | None = Field(None, max_length=64)
    run_uuid: str | None = Field(None, max_length=64)

    def ref(self) -> str:
        return _run_ref(self.run_id, self.run_uuid)


class CreateRun(_Body):
    experiment_id: str = store.DEFAULT_EXPERIMENT_ID
    user_id: str | None = None
    run_name: str | None = Field(None, max_length=250)
    start_time: int | None = Field(None, ge=0)
    tags: list[KeyValue] = Field(default_factory=list, max_length=store.MAX_TAGS)


class UpdateRun(RunRef):
    status: str | None = None
    end_time: int | None = Field(None, ge=0)
    run_name: str | None = Field(None, max_length=250)


class LogParam(RunRef):
    key: str
    value: str


class MetricIn(_Body):
    key: str
    value: float  # "NaN" / "Infinity" / "-Infinity" as strings, as the client sends them
    timestamp: int = Field(default_factory=store.now_ms)
    step: int = 0

    def point(self) -> store.Point:
        return store.Point(self.key, self.value, self.timestamp, self.step)


class LogMetric(RunRef, MetricIn):
    pass


class LogBatch(RunRef):
    metrics: list[MetricIn] = Field(default_factory=list)
    params: list[KeyValue] = Field(default_factory=list)
    tags: list[KeyValue] = Field(default_factory=list)


class SetTag(RunRef):
    key: str
    value: str


class SearchRuns(_Body):
    experiment_ids: list[str] = Field(default_factory=list)
    filter: str | None = Field(None, max_length=10000)
    run_view_type: str | None = None
    max_results: int = 1000
    order_by: list[str] = Field(default_factory=list)
    page_token: str | None = Field(None, max_length=1000)


class SearchExperiments(_Body):
    max_results: int = Field(1000, ge=1, le=50000)
    page_token: str | None = Field(None, max_length=1000)


def _run_ref(run_id: str | None, run_uuid: str | None) -> str:
    ref = run_id or run_uuid
    if not ref:
        raise MlflowError("Missing value for required parameter 'run_id'")
    return ref


@router.get("/experiments/get-by-name")
def get_experiment_by_name(
    session: SessionDep, principal: PrincipalDep, experiment_name: Annotated[str, Query(max_length=500)]
) -> dict[str, Any]:
    return {"experiment": store.experiment_json(store.experiment_by_name(session, principal.team, experiment_name))}


@router.post("/experiments/create")
def create_experiment(body: CreateExperiment, session: SessionDep, principal: PrincipalDep) -> dict[str, Any]:
    tags = {t.key: t.value for t in body.tags}
    return {"experiment_id": str(store.create_experiment(session, principal.team, body.name, tags).id)}


@router.get("/experiments/get")
def get_experiment(
    session: SessionDep, principal: PrincipalDep, experiment_id: Annotated[str, Query(max_length=32)]
) -> dict[str, Any]:
    return {"experiment": store.experiment_json(store.experiment_by_id(session, principal.team, experiment_id))}


@router.post("/experiments/search")
def search_experiments(body: SearchExperiments, session: SessionDep, principal: PrincipalDep) -> dict[str, Any]:
    found, token = store.search_experiments(session, principal.team, body.max_results, body.page_token)
    return {"experiments": found, **({"next_page_token": token} if token else {})}


@router.post("/runs/create")
def create_run(body: CreateRun, session: SessionDep, principal: PrincipalDep) -> dict[str, Any]:
    tags = {t.key: t.value for t in body.tags}
    run_id = store.create_run(
        session, principal.team, body.experiment_id, body.run_name, body.user_id, body.start_time, tags
    )
    return {"run": store.get_run(session, principal.team, run_id)}


@router.get("/runs/get")
def get_run(
    session: SessionDep,
    principal: PrincipalDep,
    run_id: Annotated[str | None, Query(max_length=64)] = None,
    run_uuid: Annotated[str | None, Query(max_length=64)] = None,
) -> dict[str, Any]:
    return {"run": store.get_run(session, principal.team, _run_ref(run_id, run_uuid))}


@router.post("/runs/update")
def update_run(body: UpdateRun, session: SessionDep, principal: PrincipalDep) -> dict[str, Any]:
    info = store.update_run(session, principal.team, body.ref(), body.status, body.end_time, body.run_name)
    return {"run_info": info}


@router.post("/runs/log-parameter")
def log_parameter(body: LogParam, session: SessionDep, principal: PrincipalDep) -> dict[str, Any]:
    store.log_batch(session, principal.team, body.ref(), [], [(body.key, body.value)], [])
    return {}


@router.post("/runs/log-metric")
def log_metric(body: LogMetric, session: SessionDep, principal: PrincipalDep) -> dict[str, Any]:
    store.log_batch(session, principal.team, body.ref(), [body.point()], [], [])
    return {}


@router.post("/runs/log-batch")
def log_batch(body: LogBatch, session: SessionDep, principal: PrincipalDep) -> dict[str, Any]:
    params = [(p.key, p.value) for p in body.params]
    tags = [(t.key, t.value) for t in body.tags]
    store.log_batch(session, principal.team, body.ref(), [m.point() for m in body.metrics], params, tags)
    return {}


@router.post("/runs/set-tag")
def set_tag(body: SetTag, session: SessionDep, principal: PrincipalDep) -> dict[str, Any]:
    store.log_batch(session, principal.team, body.ref(), [], [], [(body.key, body.value)])
    return {}


@router.post("/runs/search")
def search_runs(body: SearchRuns, session: SessionDep, principal: PrincipalDep) -> dict[str, Any]:
    runs, token = store.search_runs(
        session,
        principal.team,
        body.experiment_ids,
        body.filter,
        body.order_by,
        body.max_results,
        body.page_token,
        body.run_view_type,
    )
    return {"runs": runs, **({"next_page_token": token} if token else {})}


@router.get("/metrics/get-history")
def get_metric_history(
    session: SessionDep,
    principal: PrincipalDep,
    metric_key: Annotated[str, Query(max_length=store.MAX_KEY)],
    run_id: Annotated[str | None, Query(max_length=64)] = None,
    run_uuid: Annotated[str | None, Query(max_length=64)] = None,
    max_results: Annotated[int, Query(ge=1, le=store.MAX_HISTORY_RESULTS)] = store.MAX_HISTORY_RESULTS,
    page_token: Annotated[str | None, Query(max_length=1000)] = None,
) -> dict[str, Any]:
    points, token = store.metric_history(
        session, principal.team, _run_ref(run_id, run_uuid), metric_key, max_results, page_token
    )
    return {"metrics": points, **({"next_page_token": token} if token else {})}


class DeleteTag(RunRef):
    key: str


@router.post("/runs/delete-tag")
def delete_tag(body: DeleteTag, session: SessionDep, principal: PrincipalDep) -> dict[str, Any]:
    store.delete_tag(session, principal.team, body.ref(), body.key)
    return {}


# Last: every other MLflow call (artifacts, models, traces, deleting runs or experiments) answers in MLflow's shape,
# so the client reports "not supported" rather than an unparsed 404.
@router.api_route("/{rest:path}", methods=["GET", "POST", "PATCH", "DELETE"])
def not_supported(rest: str, principal: PrincipalDep) -> dict[str, Any]:
    raise MlflowError(f"/api/2.0/mlflow/{rest} is not supported by this server", code="ENDPOINT_NOT_FOUND")
