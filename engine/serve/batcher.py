"""Continuous batching: one thread runs the model for every sequence in flight, one step at a time.

Each iteration of the loop (``step``) runs ONE forward of at most ``max_batched_tokens`` tokens (vLLM's
``max_num_batched_tokens``) that carries prompt chunks and decode tokens together (``engine.serve.slots.SlotView``:
a flat token batch with per-sequence positions and slots, attention masked per sequence):
1. admits *every* waiting sequence (FIFO) that finds a free slot of the ``SlotCache``; with prefix caching a
   sequence starts after the longest prompt prefix some slot already holds (``engine.serve.slots``);
2. schedules one token for every sequence past its prompt, and prompt chunks, oldest sequence first (at most
   ``prefill_chunk`` tokens of one sequence per step), in what the decodes leave of the budget;
3. runs them in one forward; every sequence whose prompt is done samples a token from its last position (a new
   sequence its first, from its chunk's last).
So a request that finds a free slot gets its first token within one step per budget of prompt tokens ahead of it,
a long prompt never stalls the others for more than one budget, and a sequence joins or leaves the batch
between any two steps. Sequences end on a stop token, at ``max_tokens``, at the slot's capacity (``max_model_len``)
or when cancelled (client gone, stop string seen by the caller); their slot is freed at once.

Callers (the HTTP handler threads) ``submit`` the sequences of a request, sharing one ``events`` queue, and read
``(index, Pick)`` per new token, then ``(index, None)`` when choice ``index`` ends (its ``finish_reason`` set).
Only the loop thread touches the model and the cache: a LoRA adapter loaded into a running deployment is added
there, between two steps (``call``), and an unloaded one leaves once no sequence uses it (``retire_adapter``).

Failures never leave a reader waiting: a sequence that cannot be sampled ends with ``finish_reason`` "error" (its
``error`` set) and the others go on; an exception anywhere in a step ends every running sequence so, frees their
slots and restarts the loop after ``RESTART_DELAY_S`` (``state`` "restarting", waiting sequences stay queued). A
loop that failed ``MAX_CRASHES`` times within ``CRASH_WINDOW_S``, or once under tensor parallelism (the other
ranks' collectives cannot be resynchronised), is ``dead``: it fails whatever is left and ends; the job then ends
as failed (``engine.serve.job``), which the worker retries.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from engine.parallel.vocab_head import last_logits
from engine.serve.adapters import AdapterRows, remove_adapter
from engine.serve.greedy_head import GreedyHead
from engine.serve.sampling import Pick, RequestOptions, SamplingError, pick_token
from engine.serve.slots import SlotCache, install_flat_attention
from engine.serve.stats import ServeStats
from engine.serve.structured import Constraint
from engine.serve.tp_sync import Step, StepSync

log = logging.getLogger(__name__)

MAX_CRASHES = 3  # step failures within CRASH_WINDOW_S that end the loop for good
CRASH_WINDOW_S = 60.0
RESTART_DELAY_S = 1.0  # between a failed step and the next (read at use: tests shorten it)
READY, RESTARTING, DEAD, STOPPED = "ready", "restarting", "dead", "stopped"
_NO_PLAN = torch.ones(1, 1, 1, 1, dtype=torch.bool)  # a 4-D attention_mask: the model plans no attention itself


class LoopDead(Exception):
    """The loop has ended (failed for good or stopped): nothing more is served by this process."""


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
    cached: int = 0  # prompt tokens found in the prefix cache (not computed)
    output: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None  # why it ended with finish_reason "error" (safe to show the client)
    cancelled: bool = False
    events: queue.Queue[tuple[int, Pick | None]] = dataclasses.field(default_factory=queue.Queue)
    submitted: float = dataclasses.field(default_factory=time.monotonic)
    last_token: float | None = None  # when its previous token was sampled (inter-token latency)
    constraint: Constraint | None = None  # its grammar (structured output, engine.serve.structured), if any

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
        max_batched_tokens: int = 2048,
        prefix_caching: bool = True,
        bf16_greedy_head: bool = True,
    ) -> None:
        self.model, self.cache, self.stop_ids, self.adapters = model, cache, stop_ids, adapters
        self.sync = sync  # under TP: rank 0 broadcasts each forward for the other ranks to replay
        self.prefill_chunk, self.max_waiting = prefill_chunk, max_waiting
        self.max_batched_tokens = max_batched_tokens  # tokens per step, decodes first, prompt chunks in what is left
        # under TP the followers' caches would need every prefix copy replayed too: not done yet, so off there
        self.prefix_caching = prefix_caching and sync is None
        self.device = next(model.parameters()).device
        self.flat = install_flat_attention(model)  # attention per row of the flat batch (engine.serve.slots)
        # plain greedy rows' tokens from a bf16 head pass and an fp32 re-score (exact; engine.serve.greedy_head)
        self.greedy_head = GreedyHead.for_model(model) if bf16_greedy_head and sync is None else None
        if self.greedy_head is not None:
            log.info("serving loop: plain greedy rows take the bf16 greedy head (engine.serve.greedy_head)")
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._wake = threading.Condition()
        self._stop = threading.Event()
        self.last_activity = time.monotonic()
        self.stats = {"requests": 0, "prompt_tokens": 0, "generated_tokens": 0}
        self.stats |= {"prefix_cache_queries": 0, "prefix_cache_hits": 0}  # prompt tokens looked up / found cached
        self.window = ServeStats()  # the deployment metrics' current window (engine.serve.stats)
        self.state = READY
        self.error: str | None = None  # the last step failure, as "ExceptionType: message"
        self._crashes: list[float] = []
        self._calls: deque[tuple[Callable[[], Any], Future[Any]]] = deque()  # run on the loop thread (``call``)
        self._retiring: set[int] = set()  # unloaded adapters, dropped from the model once no sequence uses them

    # ------------------------------------------------------------ callers' side

    def submit(self, seqs: list[Sequence]) -> None:
        """Queue the sequences of one request, all or none; raises ``QueueFull``, or ``LoopDead`` once it ended."""
        with self._wake:
            if self.state in (DEAD, STOPPED):
                raise LoopDead(f"the serving loop has {'failed' if self.state == DEAD else 'stopped'}")
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

    def call(self, fn: Callable[[], Any], timeout: float = 300.0) -> Any:
        """Run ``fn`` on the loop thread between two steps (the model changes only there: a LoRA adapter loaded into
        a running deployment) and return its result or raise its exception; ``LoopDead`` once the loop ended."""
        done: Future[Any] = Future()
        with self._wake:
            if self.state in (DEAD, STOPPED):
                raise LoopDead(f"the serving loop has {'failed' if self.state == DEAD else 'stopped'}")
            self._calls.append((fn, done))
            self._wake.notify()
        return done.result(timeout=timeout)

    def retire_adapter(self, index: int) -> None:
        """Drop adapter ``index`` from the model once no running or waiting sequence uses it (its name was already
        taken away from new requests)."""
        with self._wake:
            self._retiring.add(index)
            self._wake.notify()

    def _run_calls(self) -> None:
        while self._calls:
            fn, done = self._calls.popleft()
            try:
                done.set_result(fn())
            except Exception as err:  # noqa: BLE001 - the caller hears of it
                done.set_exception(err)
        if self._retiring and self.adapters is not None:
            used = {s.adapter for s in [*self.running, *self.waiting]}
            for index in self._retiring - used:
                remove_adapter(self.model, index)
                self._retiring.discard(index)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def stop(self) -> None:
        self._stop.set()
        with self._wake:
            self._wake.notify()

    # ------------------------------------------------------------ the loop

    def run_forever(self) -> None:
        """The loop thread's body: step while there is work, sleep on the condition otherwise; a failed step is
        recovered from or ends the loop (see the module docstring)."""
        try:
            while not self._stop.is_set():
                self._run_calls()
                with self._wake:
                    if self._calls:
                        continue
                    if not self.busy:
                        self._wake.wait(timeout=0.5)
                        if self.sync is not None:
                            self.sync.keep_alive()
                        continue
                try:
                    self.step()
                except Exception as err:  # noqa: BLE001 - whatever failed, the readers must hear of it
                    if not self._recover(err):
                        return
        finally:
            self._end()

    def _recover(self, err: Exception) -> bool:
        """After a failed step: fail the running sequences, then restart (True) or give up (False)."""
        log.exception("serving loop: a step failed")
        now = time.monotonic()
        self._crashes = [t for t in self._crashes if now - t < CRASH_WINDOW_S] + [now]
        self.error = f"{type(err).__name__}: {err}"
        self.state = RESTARTING  # before the readers hear: health is not ready by the time a client sees the error
        for seq in list(self.running):
            self._fail(seq, f"the engine failed while generating ({type(err).__name__}); retry the request")
        if self.sync is not None or len(self._crashes) >= MAX_CRASHES:
            self.state = DEAD
            return False
        self._stop.wait(RESTART_DELAY_S)
        self.state = READY
        return True

    def _end(self) -> None:
        """The loop has ended: nothing in flight stays unanswered, and followers are released when it is safe."""
        dead = self.state == DEAD or not self._stop.is_set()  # ended without being asked to: it failed
        self.state = DEAD if dead else STOPPED
        with self._wake:
            left = [*self.running, *self.waiting]
            self.waiting.clear()
            while self._calls:  # state is set: no call is queued after this
                self._calls.popleft()[1].set_exception(LoopDead("the serving loop has ended"))
        for seq in left:
            if dead:
                self._fail(seq, "the engine's serving loop has failed; retry the request")
            else:
                self._finish(seq, "abort")
        if self.sync is not None and not dead:
            self.sync.lead(None)  # the other TP ranks' loops end with this one (after a failure they may be
            # inside a collective of the failed step: the job's failure ends them instead)

    @torch.inference_mode()
    def step(self) -> None:
        self._drop_cancelled()
        self._admit()
        decoding = [s for s in self.running if s.prefilled == len(s.prompt) and s.finish_reason is None]
        chunks = self._schedule_prefills(self.max_batched_tokens - len(decoding))
        if decoding or chunks:  # one forward: the decodes and the prompt chunks, flattened
            self._run(decoding + [seq for seq, _ in chunks], [1] * len(decoding) + [n for _, n in chunks])
        self.last_activity = time.monotonic()

    def _schedule_prefills(self, budget: int) -> list[tuple[Sequence, int]]:
        """The prompt chunks of this step, oldest sequence first, within what the decodes left of the token budget
        (at least a quarter of it, so prompts progress even when the decodes take it all)."""
        budget = max(budget, self.max_batched_tokens // 4, 1)
        chunks = []
        for seq in self.running:
            left = len(seq.prompt) - seq.prefilled
            if left <= 0:
                continue
            n = min(left, self.prefill_chunk, budget)
            if n <= 0:
                break
            chunks.append((seq, n))
            budget -= n
        return chunks

    def _drop_cancelled(self) -> None:
        for seq in [s for s in self.running if s.cancelled]:
            self._finish(seq, "abort")
        with self._wake:
            for seq in [s for s in self.waiting if s.cancelled]:
                self.waiting.remove(seq)
                self._finish(seq, "abort")

    def _admit(self) -> None:
        """Every waiting sequence that finds a free slot starts now; with prefix caching it starts after the
        longest prefix some slot already holds (``engine.serve.slots``)."""
        with self._wake:
            while self.waiting and self.cache.free:
                seq = self.waiting.popleft()
                src, hit = self.cache.match(seq.prompt, seq.adapter) if self.prefix_caching else (None, 0)
                if src is not None and src in self.cache.free:
                    seq.slot = self.cache.acquire(src, keep=hit)
                else:
                    seq.slot = self.cache.acquire()
                    assert seq.slot is not None  # a slot was free
                    self.cache.adapter[seq.slot] = seq.adapter
                    if src is not None:
                        self.cache.copy_prefix(src, seq.slot, hit)
                seq.prefilled = seq.cached = hit
                self.stats["prefix_cache_queries"] += len(seq.prompt)
                self.stats["prefix_cache_hits"] += hit
                self.running.append(seq)

    def _run(self, seqs: list[Sequence], counts: list[int]) -> None:
        """One forward: ``counts[i]`` new tokens of ``seqs[i]`` (its next prompt chunk, or its last output token),
        then a token sampled for every sequence whose prompt is done."""
        order = sorted(range(len(seqs)), key=lambda i: seqs[i].slot or 0)  # consecutive slots read as a slice
        seqs, counts = [seqs[i] for i in order], [counts[i] for i in order]
        tokens = [_next_input(s, n) for s, n in zip(seqs, counts, strict=True)]
        slots = [s.slot for s in seqs if s.slot is not None]
        adapters = [s.adapter for s in seqs]
        if self.sync is not None:
            starts = [self.cache.lengths[s] for s in slots]
            self.sync.lead(Step(tokens, slots, starts, adapters))
        hidden = self._compute(slots, adapters, tokens)
        ready: list[tuple[int, Sequence]] = []
        for row, seq in enumerate(seqs):
            if seq.prefilled < len(seq.prompt):
                seq.prefilled += counts[row]
                if seq.prefilled < len(seq.prompt):
                    continue
            ready.append((row, seq))
        self._emit_all(ready, hidden)

    def _emit_all(self, ready: list[tuple[int, Sequence]], hidden: torch.Tensor) -> None:
        """A token for each ``(row, seq)`` from ``hidden`` (B, H), every row's last state: plain greedy rows from the
        bf16 greedy head where it decides, the other plain greedy rows by one batched argmax of their fp32 logits,
        the rest through ``pick_token``. Only rows that need them get fp32 logits (under TP every row: each rank
        all-gathers the head over the step's rows, as ``replay`` does)."""
        plain = [(row, seq) for row, seq in ready if _plain_greedy(seq)]
        fast: dict[int, int] = {}
        if plain and self.greedy_head is not None:
            picks = self.greedy_head.argmax(_take_rows(hidden, [row for row, _ in plain]))
            fast = {id(seq): tok for (_, seq), tok in zip(plain, picks, strict=True) if tok is not None}
        need = list(range(len(hidden))) if self.sync is not None else [r for r, s in ready if id(s) not in fast]
        logits = last_logits(self.model, _take_rows(hidden, need)[:, None]) if need else hidden[:0]
        at = {row: i for i, row in enumerate(need)}
        fast |= _batched_argmax([(at[row], seq) for row, seq in plain if id(seq) not in fast], logits)
        for row, seq in ready:
            token = fast.get(id(seq))
            if token is None:
                self._emit(seq, logits[at[row]])
            else:
                self._take(seq, Pick(token))

    def _compute(self, slots: list[int], adapters: list[int], tokens: list[list[int]]) -> torch.Tensor:
        """The forward itself (every TP rank runs it): row ``i``'s ``tokens[i]`` appended to slot ``slots[i]``, all
        rows flattened into one (1, N) batch (``engine.serve.slots.SlotView``); (B, H) final hidden states at each
        row's last token (the head is applied by ``_emit_all`` to the rows that need it)."""
        counts = [len(t) for t in tokens]
        if self.adapters is not None:  # one adapter index per token of the flat batch
            self.adapters.set([a for a, n in zip(adapters, counts, strict=True) for _ in range(n)], self.device)
        view = self.cache.view(slots, counts)
        ids = torch.tensor([[t for row in tokens for t in row]], dtype=torch.long, device=self.device)
        self.flat.view = view
        try:
            # a 4-D mask: the model plans nothing (a (1,1,1,1) stand-in); attention is masked per row by the view
            hidden = self.model(
                ids, position_ids=view.positions(), attention_mask=_NO_PLAN, kv_cache=view, return_hidden=True
            )
        finally:
            self.flat.view = None
        view.commit(tokens)
        return hidden[0, view.last.to(hidden.device)]

    @torch.inference_mode()
    def replay(self, step: Step) -> None:
        """A TP follower: run rank 0's forward ``step`` on this rank's shard (``engine.serve.tp_sync``)."""
        for slot, start in zip(step.slots, step.starts, strict=True):
            self.cache.lengths[slot] = start  # where rank 0's slot stands
        hidden = self._compute(step.slots, step.adapters, step.tokens)
        last_logits(self.model, hidden[:, None])  # the head's all-gather, which rank 0's _emit_all joins

    def _emit(self, seq: Sequence, logits: torch.Tensor) -> None:
        """Sample ``seq``'s next token, hand it to the reader and end the sequence if it is done."""
        try:
            pick = pick_token(logits, seq.opts, seq.prompt, seq.output, seq.generator, seq.constraint)
        except Exception as err:  # noqa: BLE001 - this sequence's fault (or its logits'): the others go on
            log.warning("serving loop: sampling failed for one sequence: %s", err)
            detail = str(err) if isinstance(err, SamplingError) else type(err).__name__
            self._fail(seq, f"the engine could not sample the next token ({detail})")
            return
        self._take(seq, pick)

    def _take(self, seq: Sequence, pick: Pick) -> None:
        """Hand ``seq``'s new token to its reader and end the sequence if it is done."""
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

    def _fail(self, seq: Sequence, message: str) -> None:
        seq.error = message
        self._finish(seq, "error")

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        if seq.slot is not None:
            self.cache.release(seq.slot)
            seq.slot = None
        if seq in self.running:
            self.running.remove(seq)
        seq.events.put((seq.index, None))


def _plain_greedy(seq: Sequence) -> bool:
    """Whether ``seq``'s next token is its logits' argmax as such: greedy, no penalty, no log-probabilities, no
    grammar (a new option that changes the pick must be checked here too)."""
    opts = seq.opts
    return (
        seq.constraint is None
        and opts.sampling().greedy
        and opts.repetition_penalty == 1.0
        and not opts.frequency_penalty
        and not opts.presence_penalty
        and opts.logprobs is None
    )


def _take_rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``x[rows]``, without a copy when ``rows`` is all of them in order."""
    if rows == list(range(len(x))):
        return x
    return x[torch.tensor(rows, dtype=torch.long, device=x.device)]


def _batched_argmax(rows: list[tuple[int, Sequence]], logits: torch.Tensor) -> dict[int, int]:
    """``{id(seq): argmax of logits[i]}`` for ``(i, seq)`` in ``rows`` whose logits are finite, in one batched op
    (per row it costs more than the forward at 32 rows of a 151k vocabulary); a row left out takes ``pick_token``,
    which checks it exactly."""
    if not rows:
        return {}
    picked = _take_rows(logits, [i for i, _ in rows])
    # a row's sum is finite only if all its logits are (a finite row whose sum overflows only takes the slow path)
    finite = torch.isfinite(picked.sum(dim=-1)).tolist()
    best = picked.argmax(dim=-1).tolist()
    return {id(seq): tok for (_, seq), ok, tok in zip(rows, finite, best, strict=True) if ok}


def _next_input(seq: Sequence, count: int) -> list[int]:
    """The ids a forward feeds ``seq``: its next ``count`` prompt tokens, else its last sampled token."""
    if seq.prefilled < len(seq.prompt):
        return seq.prompt[seq.prefilled : seq.prefilled + count]
    return seq.output[-1:]
