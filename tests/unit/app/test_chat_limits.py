"""The chat page asks each deployment for at most its own max_model_len (read from its effective spec), and by
default for no max_tokens at all: the engine then generates up to the model's length, prompt included."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

CHAT = Path(__file__).resolve().parents[3] / "app" / "ui" / "js" / "views" / "chat.js"
SCRIPT = """
const {maxTokensFor} = await import(process.argv[1]);
console.log(JSON.stringify([
  maxTokensFor({maxModelLen: 400}, 512), maxTokensFor({maxModelLen: 400}, 100),
  maxTokensFor({maxModelLen: null}, 512), maxTokensFor({maxModelLen: 400}, undefined) ?? null,
]));
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node to run the dashboard's module")
def test_max_tokens_never_above_the_deployments_length() -> None:
    out = subprocess.run(["node", "--input-type=module", "-e", SCRIPT, str(CHAT)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [400, 100, 512, None]
