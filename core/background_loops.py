"""The API process's singleton loops: the reconciler, the webhook sender, the retention pass, the MLflow mirror
and the sweeps' driver.

Every API replica starts them; only the replica holding the leadership (``core.leadership``) runs a pass, so N
replicas never reconcile or send twice. The web layer only starts and stops them (``app.main``'s lifespan).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from core import mlflow_report, sweeps
from core.leadership import Leadership, run_when_leader
from core.reconciler import reconcile_once, service_watch, watch_hosts
from core.retention import collect
from core.settings import Settings
from core.webhooks import send_forever


@dataclass
class BackgroundLoops:
    leader: Leadership
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def stop(self) -> None:
        """Cancel the loops and give up the leadership (another replica takes over at once)."""
        for task in self.tasks:
            task.cancel()
        await asyncio.to_thread(self.leader.release)


def start_loops(settings: Settings, *, run: bool = True) -> BackgroundLoops:
    """The loops as tasks on the running event loop (none when ``run`` is False: the leadership only)."""
    leader = Leadership(settings.database_url)
    loops = BackgroundLoops(leader)
    if not run:
        return loops

    def reconcile() -> None:  # hosts are judged by the host pass below, which watches its own lag
        reconcile_once(settings, judge_hosts=False)

    watch = service_watch(settings)

    loops.tasks = [
        asyncio.create_task(  # absent workers in seconds, silent hosts only while this process keeps up
            run_when_leader(
                leader,
                settings.presence_interval_s,
                lambda: watch_hosts(settings, watch, leader.led_for()),
                "host pass",
            )
        ),
        asyncio.create_task(run_when_leader(leader, settings.reconcile_interval_s, reconcile, "reconcile")),
        asyncio.create_task(send_forever(settings, leader)),
        asyncio.create_task(
            run_when_leader(leader, settings.retention_interval_s, lambda: collect(settings), "retention pass")
        ),
        asyncio.create_task(  # report_to mlflow: jobs mirrored to their MLflow servers (core.mlflow_report)
            run_when_leader(
                leader, mlflow_report.INTERVAL_S, lambda: mlflow_report.report_once(settings), "mlflow report"
            )
        ),
        asyncio.create_task(  # sweeps: prune, start new trials, name the best (core.sweeps)
            run_when_leader(leader, sweeps.INTERVAL_S, lambda: sweeps.drive_all(settings), "sweeps")
        ),
    ]
    return loops
