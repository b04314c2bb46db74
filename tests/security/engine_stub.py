"""A stand-in for a deployment's engine endpoint, the API proxy's true outside boundary: the engine's HTTP/1.1 JSON-lines
answer, chunked on a kept-alive connection (``engine.serve.protocol``, ``engine.serve.server``), with the failure a test sets (silent before or during its answer, cut off without
``done``), and a record of what reached it and whether its client hung up."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Behaviour:
    tokens: int = 3  # token lines per answer, unless the request sets max_tokens
    gap_s: float = 0.0  # between two token lines
    silent_after: int | None = None  # lines sent (0: not even the status line) before it goes silent
    cut_after: int | None = None  # token lines sent before the connection ends with no finish/done
    fail_after: int | None = None  # token lines sent before an error line (its generation failed) ends the answer


@dataclass
class StubEngine:
    url: str = ""
    behaviour: Behaviour = field(default_factory=Behaviour)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    hung_up: threading.Event = field(default_factory=threading.Event)  # a client closed mid-answer
    connections: int = 0  # connections accepted: a pooled client reuses one for its requests one after the other
    release: threading.Event = field(default_factory=threading.Event)  # ends every silence


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass

    def setup(self) -> None:
        super().setup()
        self.server.stub.connections += 1

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        stub = self.server.stub
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        stub.bodies.append(body)
        how = dataclasses.replace(stub.behaviour, tokens=body.get("max_tokens") or stub.behaviour.tokens)
        self.close_connection = True  # unless the answer ends with its last chunk (below)
        if how.silent_after == 0:
            stub.release.wait(60)
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            if self._answer(stub, how):
                self.wfile.write(b"0\r\n\r\n")
                self.close_connection = False
        except (BrokenPipeError, ConnectionResetError):
            stub.hung_up.set()

    def _answer(self, stub: StubEngine, how: Behaviour) -> bool:
        """The answer's lines; whether it ended as the engine ends one (else its connection is cut)."""
        self._line({"type": "start", "prompt_tokens": 2})
        for i in range(how.tokens):
            if how.silent_after is not None and i + 1 >= how.silent_after:
                stub.release.wait(60)
                return False
            if how.cut_after is not None and i >= how.cut_after:
                return False
            if how.fail_after is not None and i >= how.fail_after:
                error = {"message": "the engine failed while answering", "field": None, "type": "engine_error"}
                self._line({"type": "error", "error": error})
                return True
            self._line({"type": "token", "index": 0, "token_id": 9, "text": "a"})
            time.sleep(how.gap_s)
        self._line({"type": "finish", "index": 0, "finish_reason": "length", "completion_tokens": how.tokens})
        usage = {"prompt_tokens": 2, "completion_tokens": how.tokens, "total_tokens": 2 + how.tokens}
        self._line({"type": "done", "usage": usage})
        return True

    def _line(self, obj: dict[str, Any]) -> None:
        data = json.dumps(obj).encode() + b"\n"
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    stub: StubEngine


@contextmanager
def stub_engine() -> Iterator[StubEngine]:
    server = _Server(("127.0.0.1", 0), _Handler)
    server.stub = StubEngine(url=f"http://127.0.0.1:{server.server_address[1]}")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.stub
    finally:
        server.stub.release.set()
        server.shutdown()
        server.server_close()
