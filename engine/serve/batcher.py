"""Continuous batching: one thread runs the model for every sequence in flight, one step at a time.

Each iteration of the loop (``step``):
1. admits waiting sequences (FIFO) into free slots of the ``SlotCache``;
2. prefills one chunk (at most ``prefill_chunk`` tokens) of the oldest sequence still reading its prompt; when the
   prompt is done, its first token is sampled from the chunk's last position;
3. decodes one token for every sequence past its prompt, all in one batched forward.
A long prompt therefore never stalls the others for more than one chunk, and a sequence joins or leaves the batch
between any two steps. Sequences end on a stop token, at ``max_tokens``, at the slot's capacity (``max_model_len``)
or when cancelled (client gone, stop string seen by the caller); their slot is freed at once.

Callers (the HTTP handler threads) ``submit`` the sequences of a request, sharing one ``events`` queue, and read
``(index, Pick)`` per new token, then ``(index, None)`` when choice ``index`` ends (its ``finish_reason`` set).
Only the loop thread touches the model and the cache.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections import deque

import torch

from engine.eval.generate import last_logits
from engine.serve.adapters import AdapterRows
from engine.serve.sampling import Pick, RequestOptions, pick_token
from engine.serve.slots import SlotCache
from engine.serve.stats import ServeStats
from engine.serve.tp_sync import Step, StepSync

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """More sequences wait than the engine queues; the caller should retry after ``retry_after`` seconds."""

    def __init__(self, retry_after: float) -> None:
        super().__init__(f"the queue is full; retry after {retry_after:.0f} s")
        self.retry_after = retry_after


@dataclasses.dataclass
class Sequence:
    """One choice of one request: its prompt, options, progress and the events its reader consumes."""

    prompt: list[int]
    opts: RequestOptions
    max_tokens: int
    index: int = 0
    adapter: int = 0  # the LoRA adapter its tokens go through (engine.serve.adapters); 0: the base
    generator: torch.Generator | None = None
    slot: int | None = None
    prefilled: int = 0
    output: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    cancelled: bool = False
    events: queue.Queue[tuple[int, Pick | None]] = dataclasses.field(default_factory=queue.Queue)
    submitted: float = dataclasses.field(default_factory=time.monotonic)
    last_token: float | None = None  # when its previous token was sampled (inter-token latency)

    def cancel(self) -> None:
        """Ask the loop to drop this sequence (thread-safe: the loop reads the flag between steps)."""
        self.cancelled = True


class Batcher:
    """The serving loop over one model and one ``SlotCache`` (see the module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        cache: SlotCache,
        stop_ids: set[int],
        prefill_chunk: int = 512,
        max_waiting: int = 256,
        adapters: AdapterRows | None = None,
        sync: StepSync | None = None,
    ) -> None:
        self.model, self.cache, self.stop_ids, self.adapters = model, cache, stop_ids, adapters
        self.sync = sync  # under TP: rank 0 broadcasts each forward for the other ranks to replay
        self.prefill_chunk, self.max_waiting = prefill_chunk, max_waiting
        self.device = next(model.parameters()).device
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._wake = threading.Condition()
        self._stop = threading.Event()
        self.last_activity = time.monotonic()
        self.stats = {"requests": 0, "prompt_tokens": 0, "generated_tokens": 0}
        self.window = ServeStats()  # the deployment metrics' current window (engine.serve.stats)

    # ------------------------------------------------------------ callers' side

    def submit(self, seqs: list[Sequence]) -> None:
        """Queue the sequences of one request, all or none; raises ``QueueFull``."""
        with self._wake:
            if len(self.waiting) + len(seqs) > self.max_waiting:
                raise QueueFull(retry_after=1.0)
            for seq in seqs:
                seq.generator = seq.opts.generator(seq.index, self.device)
                self.waiting.append(seq)
            self.stats["requests"] += 1
            self.stats["prompt_tokens"] += len(seqs[0].prompt) if seqs else 0
            self.window.request(len(seqs[0].prompt) if seqs else 0)
            self.last_activity = time.monotonic()
            self._wake.notify()

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def stop(self) -> None:
        self._stop.set()
        with self._wake:
            self._wake.notify()

    # ------------------------------------------------------------ the loop

    def run_forever(self) -> None:
        """The loop thread's body: step while there is work, sleep on the condition otherwise."""
        while not self._stop.is_set():
            with self._wake:
                if not self.busy:
                    self._wake.wait(timeout=0.5)
                    if self.sync is not None:
                        self.sync.keep_alive()
                    continue
            self.step()
        for seq in [*self.running, *self.waiting]:
            self._finish(seq, "abort")
        if self.sync is not None:
            self.sync.lead(None)  # the other TP ranks' loops end with this one

    @torch.inference_mode()
    def step(self) -> None:
        self._drop_cancelled()
        self._admit()
        prefilling = [s for s in self.running if s.prefilled < len(s.prompt)]
        if prefilling:
            self._prefill(prefilling[0])
        decoding = [s for s in self.running if s.prefilled == len(s.prompt) and s.finish_reason is None]
        if decoding:
            self._decode(decoding)
        self.last_activity = time.monotonic()

    def _drop_cancelled(self) -> None:
        for seq in [s for s in self.running if s.cancelled]:
            self._finish(seq, "abort")
        with self._wake:
            for seq in [s for s in self.waiting if s.cancelled]:
                self.waiting.remove(seq)
                self._finish(seq, "abort")

    def _admit(self) -> None:
        with self._wake:
            while self.waiting and self.cache.free:
                seq = self.waiting.popleft()
                seq.slot = self.cache.acquire()
                self.running.append(seq)

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, seqs: list[Sequence], mask: torch.Tensor | None):
        slots = [s.slot for s in seqs if s.slot is not None]
        adapters = [s.adapter for s in seqs]
        if self.sync is not None:
            self.sync.lead(Step(ids.tolist(), positions.tolist(), slots, adapters, mask is not None))
        return self._compute(ids, positions, slots, adapters, mask)

    def _compute(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        slots: list[int],
        adapters: list[int],
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        if self.adapters is not None:
            self.adapters.set(adapters, self.device)
        view = self.cache.view(slots, ids.shape[1])
        hidden = self.model(ids, position_ids=positions, attention_mask=mask, kv_cache=view, return_hidden=True)
        view.commit()
        return last_logits(self.model, hidden)  # (B, V) fp32

    @torch.inference_mode()
    def replay(self, step: Step) -> None:
        """A TP follower: run rank 0's forward ``step`` on this rank's shard (``engine.serve.tp_sync``)."""
        for slot, row in zip(step.slots, step.positions, strict=True):
            self.cache.lengths[slot] = row[0]  # where rank 0's slot stands: its first new position
        ids = torch.tensor(step.ids, dtype=torch.long, device=self.device)
        positions = torch.tensor(step.positions, dtype=torch.long, device=self.device)
        mask = self.cache.decode_mask(step.slots) if step.decode else None
        self._compute(ids, positions, step.slots, step.adapters, mask)

    def _prefill(self, seq: Sequence) -> None:
        assert seq.slot is not None
        start, end = seq.prefilled, min(len(seq.prompt), seq.prefilled + self.prefill_chunk)
        ids = torch.tensor([seq.prompt[start:end]], dtype=torch.long, device=self.device)
        positions = torch.arange(start, end, device=self.device)[None]
        logits = self._forward(ids, positions, [seq], None)
        seq.prefilled = end
        if end == len(seq.prompt):
            self._emit(seq, logits[0])

    def _decode(self, seqs: list[Sequence]) -> None:
        slots = [s.slot for s in seqs if s.slot is not None]
        ids = torch.tensor([[s.output[-1]] for s in seqs], dtype=torch.long, device=self.device)
        positions = torch.tensor([[self.cache.lengths[s]] for s in slots], device=self.device)
        logits = self._forward(ids, positions, seqs, self.cache.decode_mask(slots))
        for row, seq in enumerate(seqs):
            self._emit(seq, logits[row])

    def _emit(self, seq: Sequence, logits: torch.Tensor) -> None:
        """Sample ``seq``'s next token, hand it to the reader and end the sequence if it is done."""
        pick = pick_token(logits, seq.opts, seq.prompt, seq.output, seq.generator)
        seq.output.append(pick.token)
        self.stats["generated_tokens"] += 1
        now = time.monotonic()
        first = seq.last_token is None
        self.window.token(now - seq.submitted if first else None, None if first else now - (seq.last_token or now))
        seq.last_token = now
        seq.events.put((seq.index, pick))
        if pick.token in self.stop_ids:
            self._finish(seq, "stop")
        elif len(seq.output) >= seq.max_tokens or len(seq.prompt) + len(seq.output) >= self.cache.max_len:
            self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        if seq.slot is not None:
            self.cache.release(seq.slot)
            seq.slot = None
        if seq in self.running:
            self.running.remove(seq)
        seq.events.put((seq.index, None))
