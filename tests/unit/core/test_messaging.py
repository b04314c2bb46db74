"""Task names are defined once (core.messaging); the worker registers every one, old names included."""

from __future__ import annotations

from core.messaging import LEGACY_TASK_NAMES, RUN_NODE_TASK, SCHEDULE_TASK, host_queue


def test_the_worker_runs_every_task_name_and_the_old_ones() -> None:
    from worker import tasks

    tasks.celery_app.finalize()
    registered = set(tasks.celery_app.tasks)
    assert {SCHEDULE_TASK, RUN_NODE_TASK, *LEGACY_TASK_NAMES} <= registered
    assert tasks.celery_app.tasks["llmjobs.run_job"].run is tasks.schedule_for  # queued before the upgrade
    assert tasks.celery_app.tasks[SCHEDULE_TASK].run is tasks.schedule_for
    assert tasks.celery_app.tasks[RUN_NODE_TASK].run is tasks.run_node


def test_names_say_what_the_tasks_do() -> None:
    assert SCHEDULE_TASK == "llmjobs.schedule" and RUN_NODE_TASK == "llmjobs.run_node"
    assert host_queue("h1") == "host.h1"  # the queue names the workers already consume
