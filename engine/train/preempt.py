"""Slurm's warning before a time limit or a preemption (``--signal=USR2@90``, ``core.slurm.script``): the ranks
save a checkpoint at the next step boundary and exit ``EXIT_RETRYABLE``; the batch script asks Slurm to requeue the
job, and the next run resumes from that checkpoint (the train engine's resume rules). USR1 is left to NCCL.

Only under Slurm (``SLURM_JOB_ID`` set): the ranks agree on the step with one tiny all-reduce per step, since the
signal reaches each rank at a different moment and a save is collective."""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_ASKED = threading.Event()
# Left in the run directory by the stopping ranks: the batch script requeues the job when it finds it (torchrun
# reports any failed rank as exit 1, so EXIT_RETRYABLE does not reach the script). Named in core.slurm.script too.
REQUEUE_REQUEST = "requeue.request"


class Preempted(Exception):
    """The job was asked to stop for a requeue; its checkpoint at ``iteration`` is saved."""

    def __init__(self, iteration: int):
        super().__init__(f"Slurm asked the job to stop (USR2): checkpoint saved at iteration {iteration}")
        self.iteration = iteration


def _on_usr2(signum: int, frame: FrameType | None) -> None:
    _ASKED.set()


def install() -> bool:
    """Catch USR2 in this rank when it runs under Slurm; True if so."""
    if not os.environ.get("SLURM_JOB_ID") or threading.current_thread() is not threading.main_thread():
        return False
    signal.signal(signal.SIGUSR2, _on_usr2)
    return True


def asked(device: torch.device) -> bool:
    """Whether any rank got USR2 (every rank gets the same answer at the same step)."""
    import torch  # here: engine.cli imports ``Preempted`` without torch
    import torch.distributed as dist

    flag = torch.tensor([1.0 if _ASKED.is_set() else 0.0], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())
