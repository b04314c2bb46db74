"""Shared helper of the torchrun worker scripts (not a test module): the worker side of
``torchrun_support.launch_worker``."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import torch.distributed as dist


def run_ranks(body: Callable[[], Any]) -> NoReturn:
    """Join the gloo group, run ``body`` on every rank, write rank 0's result as JSON to ``sys.argv[1]``, leave the
    group and end with ``os._exit(0)`` (the gloo/DeviceMesh exit-crash trap, docs/torch-distributed-on-gloo.md §f.1). An
    exception in ``body`` propagates: the rank exits non-zero and writes nothing."""
    out_path = sys.argv[1]
    dist.init_process_group("gloo")
    result = body()
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(result))
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
