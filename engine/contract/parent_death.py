"""Tie a process's life to its parent's with Linux ``prctl(PR_SET_PDEATHSIG)``; a no-op on other systems.

The worker sets it on the process it launches (torchrun, or the engine itself), and every rank torchrun starts sets
it on itself: when the worker is SIGKILLed its launch dies, and the ranks die with it. Ranks cannot count on torchrun
forwarding a signal: they live in sessions of their own, and torchrun's SIGTERM handler raises an ``Exception``
subclass that any ``except Exception`` on its path swallows. Torch-free: the worker imports it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1
_prctl: Callable[..., int] | None = None
if sys.platform.startswith("linux"):
    # Loaded here, in the parent: a pre-exec hook must only make one plain C call in the forked child.
    _prctl = ctypes.CDLL(None, use_errno=True).prctl


def preexec_die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``subprocess.Popen`` pre-exec hook sending the child ``sig`` when the thread that started it dies."""
    prctl = _prctl
    if prctl is None:
        return None

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, sig)

    return hook


def die_with_launcher() -> None:
    """In a rank torchrun started: SIGKILL this process when torchrun dies (also if it died a moment ago)."""
    if _prctl is None or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    parent = os.getppid()
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent or parent == 1:  # re-parented before the call took effect: the launcher is gone
        os._exit(1)
