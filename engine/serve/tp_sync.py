"""Tensor-parallel serving: rank 0's batching loop decides every step, the other TP ranks replay its forwards.

Under TP every rank holds a shard of each layer, so every forward is collective: all ranks must run the same forward
on the same token ids in the same order. Only rank 0 runs the HTTP endpoint and the ``Batcher``; before each forward
it broadcasts what the forward needs (``Step``: each row's new token ids, cache slot, fill level and LoRA
adapter) and the other ranks run exactly that on their shard and their own cache
(``Batcher.replay``). A slot's fill level travels with it, so the followers' caches need no slot bookkeeping
of their own. Sampling needs the whole vocabulary's logits, which ``last_logits`` all-gathers on every
rank; only rank 0 samples. While idle, rank 0 sends a keep-alive well within the process group's timeout; ``None``
ends the followers' loop when rank 0 stops.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Protocol

import torch
import torch.distributed as dist

KEEP_ALIVE_S = 60.0  # the process group's collectives time out after 30 minutes


@dataclasses.dataclass(frozen=True)
class Step:
    """One forward of the serving loop, as the followers replay it: row ``i`` appends ``tokens[i]`` (a prompt chunk
    or one decode token) to slot ``slots[i]``, which holds ``starts[i]`` positions, through adapter ``adapters[i]``."""

    tokens: list[list[int]]
    slots: list[int]
    starts: list[int]
    adapters: list[int]


_PING = "ping"


class Replayer(Protocol):
    def replay(self, step: Step) -> None: ...


class StepSync:
    """Broadcasts rank 0's steps (``lead``) and replays them elsewhere (``follow``) over the default group."""

    def __init__(self, device: torch.device) -> None:
        self.device = None if device.type == "cpu" else device  # object collectives stage through it on NCCL/HCCL
        self.last = time.monotonic()

    def _broadcast(self, message: Any) -> Any:
        box = [message]
        dist.broadcast_object_list(box, src=0, device=self.device)
        return box[0]

    def lead(self, step: Step | None) -> None:
        """Rank 0: send ``step`` (``None``: the loop has ended)."""
        self._broadcast(step)
        self.last = time.monotonic()

    def keep_alive(self) -> None:
        """Rank 0, while idle: a message before the followers' wait could time out."""
        if time.monotonic() - self.last > KEEP_ALIVE_S:
            self._broadcast(_PING)
            self.last = time.monotonic()

    def follow(self, batcher: Replayer) -> int:
        """Other ranks: replay every step until rank 0 ends; returns how many were replayed."""
        replayed = 0
        while (message := self._broadcast(None)) is not None:
            if isinstance(message, Step):
                batcher.replay(message)
                replayed += 1
        return replayed
