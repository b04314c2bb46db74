"""Sweeps: Optuna searches a train spec's fields with trials that are ordinary train jobs.

Each pass (the API's leader loop, and once at submission) rebuilds the study from the database: one trial per job
labelled ``sweep`` = the sweep's id, with its params, its metric series (the job-wide points of ``metric``, by step)
as intermediate values, and the samplers' and pruners' own notes (``sweeps.trial_attrs``). So a restarted API
resumes the study where it was; nothing of it lives in memory between passes. A pass prunes the running trials the
pruner stops (their jobs are cancelled and listed in ``sweeps.pruned``), asks the sampler for new trials up to
``max_parallel`` running and ``max_trials`` in all, and ends the sweep when every trial has ended, naming the best.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from core import jobs as service
from core import tracking
from core.admission import apply_team_defaults
from core.db import each_row, session_scope
from core.dispatch import dispatch
from core.models import Job, MetricPoint, Sweep, utcnow
from core.paths import team_areas
from core.records import redone
from core.settings import Settings
from core.states import TERMINAL, JobState
from core.sweep_spec import SweepSpec
from engine.contract.spec import first_error, parse_spec

# optuna is imported where a sweep is driven: every API process imports this module (its routes, the leader's loop)
# and optuna's import (redis, its storages) cost ~0.2 s of CPU at each start, sweeps or none
if TYPE_CHECKING:
    import optuna
    from optuna.distributions import BaseDistribution
    from optuna.trial import TrialState

log = logging.getLogger(__name__)
SWEEP_LABEL, TRIAL_LABEL = "sweep", "trial"
INTERVAL_S = 3.0  # between the leader's passes


def distributions(spec: SweepSpec) -> dict[str, BaseDistribution]:
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    out: dict[str, BaseDistribution] = {}
    for name, dim in spec.space.items():
        if dim.choices is not None:
            out[name] = CategoricalDistribution(dim.choices)
        elif dim.integer:
            out[name] = IntDistribution(int(dim.low or 0), int(dim.high or 0), log=dim.log)
        else:
            out[name] = FloatDistribution(float(dim.low or 0), float(dim.high or 0), log=dim.log)
    return out


def _sampler(spec: SweepSpec, asked: int) -> optuna.samplers.BaseSampler:
    import optuna

    seed = spec.seed + asked  # rebuilt every pass: a seed that moves on, so a new pass draws new points
    if spec.sampler == "grid":
        return optuna.samplers.GridSampler({k: list(d.choices or ()) for k, d in spec.space.items()}, seed=seed)
    if spec.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=max(2, min(10, spec.max_trials // 4)))


def _pruner(spec: SweepSpec) -> optuna.pruners.BasePruner:
    import optuna

    if spec.pruner == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=spec.n_startup_trials, n_warmup_steps=spec.n_warmup_steps)
    if spec.pruner == "asha":
        return optuna.pruners.SuccessiveHalvingPruner(
            min_resource=spec.min_resource, reduction_factor=spec.reduction_factor
        )
    if spec.pruner == "hyperband":
        return optuna.pruners.HyperbandPruner(
            min_resource=spec.min_resource,
            max_resource=spec.max_resource or "auto",
            reduction_factor=spec.reduction_factor,
        )
    return optuna.pruners.NopPruner()


def trial_jobs(session: Session, sweep: Sweep) -> list[Job]:
    rows = session.scalars(select(Job).where(Job.team == sweep.team, Job.meta[SWEEP_LABEL].as_string() == sweep.id))
    return sorted(rows, key=lambda job: int((job.meta or {}).get(TRIAL_LABEL, 0)))


def series(session: Session, job_id: str, metric: str) -> dict[int, float]:
    """The job-wide points of one metric by step, as the dashboard shows them (a redone step once, NaN left out)."""
    rows = session.execute(
        select(MetricPoint.step, MetricPoint.value)
        .where(MetricPoint.job_id == job_id, MetricPoint.name == metric, MetricPoint.rank.is_(None))
        .where(~redone(MetricPoint))
        .order_by(MetricPoint.step, MetricPoint.id)
    ).all()
    return {step: value for step, value in rows if value is not None}


def _state(job: Job, values: dict[int, float], pruned: set[str]) -> tuple[TrialState, float | None]:
    from optuna.trial import TrialState

    if job.id in pruned:
        return TrialState.PRUNED, None
    if job.state == JobState.succeeded.value:
        return (TrialState.COMPLETE, values[max(values)]) if values else (TrialState.FAIL, None)
    if JobState(job.state) in TERMINAL:
        return TrialState.FAIL, None
    return TrialState.RUNNING, None


def rebuild(session: Session, sweep: Sweep, spec: SweepSpec, jobs: list[Job]) -> optuna.Study:
    """The study as the database has it: one trial per job, in trial order."""
    import optuna
    from optuna.trial import create_trial

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(
        study_name=sweep.id, direction=spec.direction, sampler=_sampler(spec, len(jobs)), pruner=_pruner(spec)
    )
    dists, pruned = distributions(spec), set(sweep.pruned or [])
    for job in jobs:
        attrs = (sweep.trial_attrs or {}).get(job.id, {})
        values = series(session, job.id, spec.metric)
        state, value = _state(job, values, pruned)
        study.add_trial(
            create_trial(
                state=state,
                value=value,
                params=attrs.get("params", {}),
                distributions=dists,
                intermediate_values=values,
                system_attrs=attrs.get("system", {}),
                user_attrs={"job_id": job.id},
            )
        )
    return study


def _create_trial_job(
    settings: Settings, session: Session, sweep: Sweep, spec: SweepSpec, number: int, params: dict[str, Any]
) -> Job:
    base = spec.base
    body = {**base, "kind": "train", **params, "name": f"{sweep.name}/{number}"[:200]}
    body["metadata"] = {**(base.get("metadata") or {}), "experiment": sweep.name}
    body["metadata"] |= {SWEEP_LABEL: sweep.id, TRIAL_LABEL: str(number)}
    child = parse_spec(body, **team_areas(settings, sweep.team).context())
    apply_team_defaults(child, settings, sweep.team)  # each trial is bounded as the same job alone would be
    tracking.fill(session, sweep.team, child)  # the team's report_to default, as the same job alone would get
    job, _ = service.create_job(
        session, settings=settings, team=sweep.team, spec=child, raw=body, idempotency_key=f"sweep:{sweep.id}:{number}"
    )
    return job


def _finish(session: Session, sweep: Sweep, study: optuna.Study, jobs: list[Job]) -> None:
    from optuna.trial import TrialState

    done = [t for t in study.trials if t.state == TrialState.COMPLETE]
    summary = {
        "trials": len(jobs),
        "completed": len(done),
        "pruned": sum(t.state == TrialState.PRUNED for t in study.trials),
        "failed": sum(t.state == TrialState.FAIL for t in study.trials),
    }
    if not done:
        sweep.state, sweep.result = "failed", {**summary, "error": "no trial finished with a value of the metric"}
    else:
        best = study.best_trial
        job = session.get(Job, best.user_attrs["job_id"])
        outputs = ((job.result if job is not None else None) or {}).get("outputs") or {}
        sweep.state = "succeeded"
        sweep.result = {
            **summary,
            "best_job": best.user_attrs["job_id"],
            "best_trial": best.number,
            "best_value": best.value,
            "best_params": best.params,
            "best_outputs": outputs,  # its checkpoint / hf export, ready for eval or serve by reference
        }
    sweep.finished_at = utcnow()


def drive(settings: Settings, sweep_id: str, dispatch_now: bool = True) -> str:
    """One pass for one sweep: prune, ask for new trials, or finish. Returns its state afterwards."""
    from optuna.trial import TrialState

    created: list[Job] = []
    with session_scope(settings.database_url) as session:
        sweep = session.get(Sweep, sweep_id)
        if sweep is None or sweep.state != "running":
            return sweep.state if sweep is not None else "missing"
        spec = SweepSpec.model_validate(sweep.spec)
        jobs = trial_jobs(session, sweep)
        study = rebuild(session, sweep, spec, jobs)
        attrs, pruned = dict(sweep.trial_attrs or {}), list(sweep.pruned or [])
        for frozen in study.trials:
            if frozen.state != TrialState.RUNNING or not frozen.intermediate_values:
                continue
            job_id = frozen.user_attrs["job_id"]
            stop = study.pruner.prune(study, frozen)
            fresh = study.trials[frozen.number]  # the pruner's notes (rungs) as it left them
            attrs[job_id] = {**attrs.get(job_id, {}), "system": fresh.system_attrs}
            if stop:
                job = session.get(Job, job_id)
                if job is not None and JobState(job.state) not in TERMINAL:
                    why = f"pruned by sweep {sweep.name} at step {frozen.last_step}"
                    service.add_event(session, job_id, "pruned", why)
                    service.request_cancel(session, job)
                    # its own terminal reason: the job ends cancelled with error_code pruned (the cancel keeps it)
                    session.execute(update(Job).where(Job.id == job_id).values(error_code="pruned", error_message=why))
                pruned.append(job_id)
        if len(pruned) > len(sweep.pruned or []):  # the trials pruned just now count as pruned from here on
            sweep.trial_attrs, sweep.pruned = dict(attrs), list(pruned)
            study = rebuild(session, sweep, spec, jobs)
        running = [t for t in study.trials if t.state == TrialState.RUNNING]
        total, active = len(jobs), len(running)
        while active < spec.max_parallel and total < spec.max_trials:
            trial = study.ask(distributions(spec))
            try:
                job = _create_trial_job(settings, session, sweep, spec, total, trial.params)
            except ValidationError as err:  # a sampled point the spec refuses (the corners passed at submission)
                sweep.state, sweep.finished_at = "failed", utcnow()
                sweep.result = {"error": first_error(err, f"trial {total}")}
                break
            system = study._storage.get_trial_system_attrs(trial._trial_id)  # the sampler's notes (grid point)
            attrs[job.id] = {"params": trial.params, "system": system}
            created.append(job)
            total, active = total + 1, active + 1
        sweep.trial_attrs, sweep.pruned = dict(attrs), list(pruned)  # new objects: JSON columns track assignment only
        if sweep.state == "running" and total >= spec.max_trials and active == 0:
            _finish(session, sweep, study, jobs)
        session.commit()
        state = sweep.state
    if dispatch_now:
        for job in created:
            dispatch(settings, job.id, job.queue)
    return state


def drive_all(settings: Settings) -> int:
    """One pass over every running sweep (the leader's loop). Returns how many it looked at."""
    running = select(Sweep.id).where(Sweep.state == "running")
    return each_row(settings.database_url, running, lambda sweep_id: drive(settings, sweep_id), "driving sweep")


def team_sweeps(session: Session, team: str) -> list[Sweep]:
    """A team's sweeps, newest first."""
    return list(session.scalars(select(Sweep).where(Sweep.team == team).order_by(Sweep.created_at.desc())))


def cancel(session: Session, sweep: Sweep) -> None:
    """Stop the sweep: its unfinished trials are cancelled, the finished ones kept."""
    if sweep.state != "running":
        return
    for job in trial_jobs(session, sweep):
        if JobState(job.state) not in TERMINAL:
            service.request_cancel(session, job)
    sweep.state, sweep.finished_at = "cancelled", utcnow()
    session.commit()


def view(session: Session, sweep: Sweep) -> dict[str, Any]:
    """The sweep with its trials: params, state, last value of the metric, whether pruned."""
    spec = SweepSpec.model_validate(sweep.spec)
    pruned = set(sweep.pruned or [])
    trials = []
    for job in trial_jobs(session, sweep):
        values = series(session, job.id, spec.metric)
        last = values[max(values)] if values else None
        trials.append(
            {
                "number": int((job.meta or {}).get(TRIAL_LABEL, 0)),
                "job_id": job.id,
                "name": job.name,
                "state": "pruned" if job.id in pruned else job.state,
                "params": (sweep.trial_attrs or {}).get(job.id, {}).get("params", {}),
                "value": last,
                "step": max(values) if values else None,
            }
        )
    return {
        "id": sweep.id,
        "name": sweep.name,
        "state": sweep.state,
        "metric": spec.metric,
        "direction": spec.direction,
        "spec": sweep.spec,
        "trials": trials,
        "result": sweep.result,
        "created_at": sweep.created_at.isoformat(),
        "finished_at": sweep.finished_at.isoformat() if sweep.finished_at else None,
    }
