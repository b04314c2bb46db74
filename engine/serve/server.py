"""The engine's own HTTP endpoint on the worker host: the standard library's ``ThreadingHTTPServer`` (the engine
imports no web framework, see the import contracts in pyproject.toml), one thread per connection.

HTTP/1.1 with keep-alive: the API's proxy keeps a pool of connections to each engine, so a request does not pay a TCP
connect (and a thread start here). ``http.server`` parses HTTP/1.1 and keeps the connection open when an answer is
framed; it does not frame a streamed body, so the few lines of chunked transfer encoding are ours (``_chunk``): a
framework would only bring this one thing and the import contracts keep web frameworks out of the engine. An
HTTP/1.0 request (no chunked encoding) gets its stream ended by the connection's close, as before. A connection
idle for ``IDLE_S`` between requests is closed (the API's pool lets its idle ones go sooner). A request whose body was
not read (refused before reading it) is answered with ``Connection: close``: its bytes must not be taken for the
next request. Every socket is ``TCP_NODELAY``: the small lines of a stream go out at once, not held back by Nagle's
algorithm for the previous one's ACK (the ~40 ms stall of kept-alive connections).

``GET /health`` answers the deployment's state: 200 while the batching loop serves, 503 while it restarts after a
failure or once it is dead. ``GET /metrics`` is the Prometheus exposition under vLLM's names (``engine.serve.prom``).
``POST /tokenize`` / ``POST /detokenize`` answer vLLM's shapes with the deployment's tokenizer and template.
``POST /v1/generate`` takes the internal protocol's request (``engine.serve.protocol``)
and streams JSON lines as tokens come out of the ``Batcher`` (one chunk a line).

The status line waits for the request's first event, so a request that fails before its first token (a sampling
failure, the loop failing) is a plain 500 ``{"error": ...}``; once tokens were sent, a failure is a last line
``{"type": "error", "error": {"message", "field": null, "type": "engine_error"}}`` (no ``finish``/``done``).
A request that waits (queued, a long prefill) gets a ``{"type": "keepalive"}`` line every ``KEEPALIVE_S``, so a
reader's read timeout measures a silent engine, not a busy one.
A client that goes away is noticed at the next write, or while nothing is written (queued, prefilling) by polling
its socket for end-of-file: its sequences are cancelled and their slots freed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import queue
import select
import socket
import threading
import time
from collections.abc import Iterator
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from engine.contract.guard import check_path
from engine.contract.runfiles import BadInput
from engine.contract.spec import ServeSpec
from engine.serve.adapters import AdapterRows, add_adapter, read_adapter
from engine.serve.batcher import READY, Batcher, LoopDead, QueueFull, Sequence
from engine.serve.prom import EngineMetrics, RequestRecord
from engine.serve.protocol import (
    BadRequest,
    Detokenizer,
    adapter_index,
    detokenize_ids,
    parse_options,
    prompt_ids,
    structured_grammar,
    thinking,
    tokenize_body,
)
from engine.serve.sampling import Pick
from engine.serve.structured import Grammars

log = logging.getLogger(__name__)

MAX_BODY = 8 << 20
POLL_S = 0.5  # while no event comes, how often the client's socket is checked for a hang-up
KEEPALIVE_S = 10.0  # the longest silence on an answer: well under the API's read timeout (queued, long prefill)
IDLE_S = 120.0  # a kept-alive connection's longest wait for its next request (the API's pool expires its own at 30 s)


class ClientGone(Exception):
    """The client closed its connection: its request is dropped."""


class _Failed(Exception):
    """A choice of the request ended in an error (``Sequence.error``): the request ends with it."""


@dataclasses.dataclass
class Deployment:
    """What the handler threads share: the loop, the tokenizer and the limits."""

    batcher: Batcher
    tokenizer: Any
    template: str
    served_model_name: str
    max_model_len: int
    vocab_size: int
    adapters: dict[str, int] = dataclasses.field(default_factory=dict)  # LoRA adapter name -> its index
    spec: ServeSpec | None = None  # the job's spec: adapters loaded at run time are read as its lora_adapters are
    grammars: Grammars = dataclasses.field(init=False)  # structured output (its tokenizer built at first use)
    metrics: EngineMetrics = dataclasses.field(init=False)
    _lock: threading.Lock = dataclasses.field(init=False, default_factory=threading.Lock)
    _next_index: int = dataclasses.field(init=False, default=0)

    def __post_init__(self) -> None:
        end = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        eos = end if isinstance(end, int) and end >= 0 else self.tokenizer.eos_token_id
        self.grammars = Grammars(self.tokenizer, self.vocab_size, eos)
        self.metrics = EngineMetrics(self.batcher, self.served_model_name)
        # an index is never reused: the prefix cache keys blocks by adapter index, so an unloaded adapter's cached
        # keys can never be taken for a later adapter's
        self._next_index = max(self.adapters.values(), default=0) + 1

    def load_adapter(self, name: str, path: str) -> None:
        """vLLM's ``/v1/load_lora_adapter``: LoRA checkpoint ``path`` served as ``name`` from the next request on,
        read and checked as a ``lora_adapters`` entry (inside the job's data areas, from a private copy made without
        following links); BadRequest naming ``lora_name`` or ``lora_path``."""
        if self.spec is None or self.batcher.sync is not None:
            raise BadRequest("lora_path: adapters are loaded at run time only with tensor parallelism 1", "lora_path")
        with self._lock:
            if name == self.served_model_name or name in self.adapters:
                raise BadRequest(f"lora_name: {name!r} is already served by this deployment", "lora_name")
            index, self._next_index = self._next_index, self._next_index + 1
        try:
            check_path("lora_path", path, output=False)
            adapters = read_adapter(self.spec, name, path)
            batcher = self.batcher
            device = batcher.device

            def attach() -> None:  # on the loop thread, between two forwards
                if batcher.adapters is None:
                    batcher.adapters = AdapterRows()
                add_adapter(batcher.model, batcher.adapters, index, name, adapters, device)

            batcher.call(attach)
        except BadInput as err:
            raise BadRequest(str(err).replace(f"lora_adapters.{name}", "lora_path", 1), "lora_path") from err
        with self._lock:
            if name in self.adapters:  # a concurrent load of the same name won: this one's copy goes
                self.batcher.retire_adapter(index)
                raise BadRequest(f"lora_name: {name!r} is already served by this deployment", "lora_name")
            self.adapters[name] = index

    def unload_adapter(self, name: str) -> None:
        """vLLM's ``/v1/unload_lora_adapter``: ``name`` is refused from now on; its tensors leave the model once the
        requests already using it end. BadRequest (404) when no adapter has that name."""
        with self._lock:
            index = self.adapters.pop(name, None)
        if index is None:
            raise BadRequest(f"lora_name: no adapter {name!r} is loaded", "lora_name", status=404)
        self.batcher.retire_adapter(index)

    def adapter_name(self, index: int) -> str:
        """The name a request's adapter index is served as (the base's for 0), the metrics' ``model_name``."""
        return next((n for n, i in self.adapters.items() if i == index), self.served_model_name)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    _started = False  # whether this request's 200 and start line went out
    _chunked = False  # whether this request's stream is chunked (an HTTP/1.1 request) or ends with the connection
    _unread = False  # whether this request's body is still unread: the connection cannot carry another request
    _gone = False  # whether this request's client hung up: nothing more is written to it
    _prompt_tokens = 0
    _last_write = 0.0

    def setup(self) -> None:
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def handle_one_request(self) -> None:
        self.connection.settimeout(IDLE_S)  # the wait for a request line; http.server closes the connection on expiry
        super().handle_one_request()

    def parse_request(self) -> bool:
        ok = super().parse_request()  # the headers are read under IDLE_S too: a stalled head cannot hold a thread
        self.connection.settimeout(None)  # a request came: its handling waits as long as it needs
        self._started, self._gone = False, False
        self._chunked = self.request_version not in ("HTTP/0.9", "HTTP/1.0")
        self._unread = self.command == "POST"
        return ok

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        log.debug("%s " + format, self.address_string(), *args)

    def _head(self, status: int, content_type: str, length: int | None = None) -> None:
        """The status line and headers of an answer: of ``length`` bytes, else a stream (chunked, or for an HTTP/1.0
        client ended by the close)."""
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        if length is not None:
            self.send_header("Content-Length", str(length))
        elif self._chunked:
            self.send_header("Transfer-Encoding", "chunked")
        if self._unread or (length is None and not self._chunked):
            self.send_header("Connection", "close")  # http.server then closes the connection after this answer

    def _json(self, status: int, obj: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        data = json.dumps(obj).encode()
        self._head(status, "application/json", len(data))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str, field: str | None, kind: str, **headers: str) -> None:
        self._json(status, {"error": {"message": message, "field": field, "type": kind}}, headers)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        dep = self.server.deployment
        if self.path == "/metrics":
            return self._raw(200, dep.metrics.exposition(), "text/plain; version=0.0.4; charset=utf-8")
        if self.path != "/health":
            return self._error(404, f"{self.path}: not found", None, "not_found")
        b = dep.batcher
        self._json(
            200 if b.state == READY else 503,
            {
                "status": b.state,
                "error": b.error,
                "model": dep.served_model_name,
                "max_model_len": dep.max_model_len,
                "adapters": sorted(dep.adapters),
                "running": len(b.running),
                "waiting": len(b.waiting),
                "free_slots": len(b.cache.free),
                **b.stats,
            },
        )

    def _raw(self, status: int, data: bytes, content_type: str) -> None:
        self._head(status, content_type, len(data))
        self.end_headers()
        self.wfile.write(data)

    def _tokens(self) -> None:
        """``/tokenize`` and ``/detokenize`` (vLLM's shapes, see ``engine.serve.protocol``)."""
        dep = self.server.deployment
        try:
            body = self._body()
            adapter_index(body, dep.served_model_name, dep.adapters)
            if self.path == "/detokenize":
                ids = detokenize_ids(body, dep.vocab_size)
                return self._json(200, {"prompt": dep.tokenizer.decode(ids)})
            tokenize_body(body)
            ids = prompt_ids(body, dep.tokenizer, dep.template, dep.vocab_size)
        except BadRequest as err:
            kind = "model_not_found" if err.status == 404 else "invalid_request_error"
            return self._error(err.status, str(err), err.field, kind)
        self._json(200, {"count": len(ids), "max_model_len": dep.max_model_len, "tokens": ids})

    def _lora(self) -> None:
        """vLLM's ``/v1/load_lora_adapter`` ``{"lora_name", "lora_path"}`` and ``/v1/unload_lora_adapter``
        ``{"lora_name"}``; 200 with vLLM's text, else an error naming the field."""
        dep = self.server.deployment
        try:
            body = self._body()
            name = body.get("lora_name")
            if not isinstance(name, str) or not name.strip() or len(name) > 255:
                raise BadRequest("lora_name: a name of 1 to 255 characters is required", "lora_name")
            if self.path == "/v1/unload_lora_adapter":
                dep.unload_adapter(name)
                return self._raw(200, f"Success: LoRA adapter '{name}' removed successfully.".encode(), "text/plain")
            path = body.get("lora_path")
            if not isinstance(path, str) or not path:
                raise BadRequest("lora_path: the adapter checkpoint's path is required", "lora_path")
            dep.load_adapter(name, path)
        except BadRequest as err:
            kind = "not_found" if err.status == 404 else "invalid_request_error"
            return self._error(err.status, str(err), err.field, kind)
        except LoopDead as err:
            return self._error(503, str(err), None, "engine_unavailable", **{"Retry-After": "5"})
        except Exception:  # noqa: BLE001 - an unreadable checkpoint must still be answered
            log.exception("loading a LoRA adapter failed")
            return self._error(500, "lora_path: the adapter could not be loaded", "lora_path", "engine_error")
        self._raw(200, f"Success: LoRA adapter '{name}' added successfully.".encode(), "text/plain")

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        if self.path in ("/tokenize", "/detokenize"):
            return self._tokens()
        if self.path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            return self._lora()
        if self.path != "/v1/generate":
            return self._error(404, f"{self.path}: not found", None, "not_found")
        try:
            seqs, prompt = self._sequences(self._body())
        except BadRequest as err:
            kind = "model_not_found" if err.status == 404 else "invalid_request_error"
            return self._error(err.status, str(err), err.field, kind)
        try:
            self.server.deployment.batcher.submit(seqs)
        except QueueFull as err:
            return self._error(429, str(err), None, "rate_limit_error", **{"Retry-After": f"{err.retry_after:.0f}"})
        except LoopDead as err:
            return self._error(503, str(err), None, "engine_unavailable", **{"Retry-After": "5"})
        try:
            self._stream(seqs, len(prompt))
        except _Failed as err:
            self._fail(str(err))
        except (BrokenPipeError, ConnectionResetError, ClientGone):
            self._gone = self.close_connection = True
            log.info("client gone: %d sequence(s) cancelled", len(seqs))
        except Exception:  # noqa: BLE001 - a bug here must still end the request with an error, not a cut stream
            log.exception("serving a request failed")
            self._fail("the engine failed while answering; retry the request")
        finally:
            for seq in seqs:
                seq.cancel()  # no-op for finished ones; frees the slots of a disconnected client
        self._end_stream()

    def _end_stream(self) -> None:
        """The chunked stream's last chunk, after which the connection carries the client's next request (or closes,
        when the client asked for ``Connection: close``)."""
        if not (self._started and self._chunked and not self._gone):
            return
        try:
            self.wfile.write(b"0\r\n\r\n")
        except OSError:
            self._gone = self.close_connection = True

    def _fail(self, message: str) -> None:
        """End the request with an error: a 500 before the stream began, else its last line."""
        error = {"message": message, "field": None, "type": "engine_error"}
        try:
            if self._started:
                self._line({"type": "error", "error": error})
            else:
                self._json(500, {"error": error})
        except OSError:
            self._gone = self.close_connection = True
            log.info("client gone before hearing of its error")

    def _body(self) -> dict[str, Any]:
        given = self.headers.get("Content-Length") or "0"
        # a chunked or garbled length is refused, not a crashed thread (isdigit alone takes latin-1's superscripts)
        length = int(given) if given.isascii() and given.isdigit() else 0
        if not 0 < length <= MAX_BODY:
            raise BadRequest(f"body: a JSON object of 1 to {MAX_BODY} bytes is required", field="body")
        try:
            data = self.rfile.read(length)
            self._unread = False
            body = json.loads(data)
        except ValueError as err:
            raise BadRequest(f"body: not JSON: {err}", field="body") from err
        if not isinstance(body, dict):
            raise BadRequest("body: must be a JSON object", field="body")
        return body

    def _sequences(self, body: dict[str, Any]) -> tuple[list[Sequence], list[int]]:
        dep = self.server.deployment
        opts = parse_options(body)
        adapter = adapter_index(body, dep.served_model_name, dep.adapters)
        prompt = prompt_ids(body, dep.tokenizer, dep.template, dep.vocab_size)
        room = dep.max_model_len - len(prompt)
        if room < 1:
            raise BadRequest(
                f"messages: the prompt has {len(prompt)} tokens; max_model_len is {dep.max_model_len}",
                field="messages",
            )
        if opts.max_tokens is not None and opts.max_tokens > room:
            raise BadRequest(
                f"max_tokens: {opts.max_tokens} + the prompt's {len(prompt)} tokens exceed max_model_len "
                f"{dep.max_model_len}",
                field="max_tokens",
            )
        grammar, think = structured_grammar(body), thinking(body)
        events: Any = None
        seqs = []
        for i in range(opts.n):
            seq = Sequence(prompt, opts, opts.max_tokens or room, index=i, adapter=adapter)
            seq.constraint = dep.grammars.constraint(grammar, think) if grammar is not None else None
            events = events or seq.events
            seq.events = events  # one queue for the request: this thread reads every choice from it
            seqs.append(seq)
        return seqs, prompt

    def _line(self, obj: dict[str, Any]) -> None:
        if not self._started:  # the status line waits for the first event (see the module docstring)
            self._started = True
            self._head(HTTPStatus.OK, "application/x-ndjson")
            self.end_headers()
            self._line({"type": "start", "prompt_tokens": self._prompt_tokens})
        self.wfile.write(self._chunk(json.dumps(obj, ensure_ascii=False).encode() + b"\n"))
        self._last_write = time.monotonic()

    def _chunk(self, data: bytes) -> bytes:
        """``data`` framed for this request's stream: one chunk (one write, one TCP segment), or as is for HTTP/1.0."""
        return b"%x\r\n%s\r\n" % (len(data), data) if self._chunked else data

    def _client_gone(self) -> bool:
        """Whether the client hung up: its socket reads as end-of-file (it sends nothing after its request)."""
        conn = self.connection
        try:
            readable, _, _ = select.select([conn], [], [], 0)
            return bool(readable) and conn.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def _events(self, seqs: list[Sequence]) -> Iterator[tuple[int, Pick | None]]:
        """The request's events; while none comes, checks that the client is still there and, after
        ``KEEPALIVE_S`` of silence, sends a ``keepalive`` line (the status line then goes out: a later failure is
        an error line)."""
        self._last_write = time.monotonic()
        while True:
            try:
                yield seqs[0].events.get(timeout=POLL_S)
            except queue.Empty:
                if self._client_gone():
                    raise ClientGone from None
                if time.monotonic() - self._last_write >= KEEPALIVE_S:
                    self._line({"type": "keepalive"})

    def _stream(self, seqs: list[Sequence], prompt_tokens: int) -> None:
        dep = self.server.deployment
        tok = dep.tokenizer
        self._prompt_tokens = prompt_tokens
        record = RequestRecord(dep.metrics, dep.adapter_name(seqs[0].adapter), seqs[0].submitted)
        detoks = [Detokenizer(tok, s.opts.stop) for s in seqs]
        open_choices, completion = set(range(len(seqs))), 0
        events = self._events(seqs)
        while open_choices:
            index, pick = next(events)
            if index not in open_choices:
                continue  # a choice already cut by a stop string still sends its last tokens and its end
            seq, detok = seqs[index], detoks[index]
            if pick is None:
                if seq.finish_reason == "error":
                    raise _Failed(seq.error or "the engine failed while generating")
                rest = detok.flush()
                if rest:
                    self._line({"type": "token", "index": index, "token_id": None, "text": rest})
                self._finish(index, seq.finish_reason or "abort", len(seq.output))
                record.finish(seq.finish_reason or "abort")
                completion += len(seq.output)
                open_choices.discard(index)
                continue
            record.token(index)
            line: dict[str, Any] = {
                "type": "token",
                "index": index,
                "token_id": pick.token,
                "text": detok.push(pick.token),
            }
            if pick.logprob is not None:
                line["token_text"] = tok.decode([pick.token])
                line["logprob"] = pick.logprob
                line["top_logprobs"] = [
                    {"token_id": t, "text": tok.decode([t]), "logprob": lp} for t, lp in pick.top or []
                ]
            self._line(line)
            if detok.stopped:
                seq.cancel()
                self._finish(index, "stop", len(detok.ids))
                record.finish("stop")
                completion += len(detok.ids)
                open_choices.discard(index)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion}
        record.done(prompt_tokens, completion)
        self._line({"type": "done", "usage": {**usage, "total_tokens": prompt_tokens + completion}})

    def _finish(self, index: int, reason: str, tokens: int) -> None:
        self._line({"type": "finish", "index": index, "finish_reason": reason, "completion_tokens": tokens})


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # the listen backlog (socketserver's default is 5): a burst of 32 clients connecting at once was reset
    # ("Connection reset by peer") beyond it before the accept loop caught up
    request_queue_size = 1024

    def __init__(self, address: tuple[str, int], deployment: Deployment) -> None:
        super().__init__(address, _Handler)
        self.deployment = deployment


def make_server(deployment: Deployment, host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    """A server bound to ``host:port`` (port 0: any free one; read it from ``server.server_address``)."""
    return _Server((host, port), deployment)
