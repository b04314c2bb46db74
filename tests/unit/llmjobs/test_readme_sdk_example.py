"""The README's SDK example, run on a stream as the API sends it (each line on ``launcher`` and on ``rank0``): every
log line is printed once. And the README says why examples/04-eval.json reports accuracy 0.0."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from typing import Any

from llmjobs.client import StreamMessage

README = (Path(__file__).resolve().parents[3] / "README.md").read_text()


def _stream_loop() -> str:
    """The example's ``for message in client.stream(...)`` loop, dedented."""
    block = README.split("## Python SDK", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    match = re.search(r"^( *)for message in client\.stream\(.*?(?=^\1\S)", block, re.DOTALL | re.MULTILINE)
    assert match, "the SDK example lost its stream loop"
    return textwrap.dedent(match.group(0))


def test_the_sdk_example_prints_each_log_line_once(capsys: Any) -> None:
    lines = ["loading", "step 1"]
    sent = [StreamMessage("log", {"stream": s, "text": t}, None) for t in lines for s in ("launcher", "rank0")]

    class Stub:
        def stream(self, _job_id: str) -> list[StreamMessage]:
            return [StreamMessage("state", {"state": "running"}, None), *sent]

    exec(_stream_loop(), {"client": Stub(), "job": {"id": "j"}})  # noqa: S102 - the README's own code
    assert capsys.readouterr().out.splitlines() == lines


def test_the_readme_says_why_the_demo_eval_scores_zero() -> None:
    assert "`04-eval.json` reports `accuracy` 0.0 after the demo's training, and that is right" in README
