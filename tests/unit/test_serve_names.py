"""One name per concept from the serve spec to the cache (issue 46): ``max_num_seqs`` and ``max_model_len`` are the
only spellings in product code. Other servers' names (vLLM's, TGI's) are accepted as input and mapped to ours by
``core.admission.SERVE_SYNONYMS``: that table is the one place they may appear."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("app", "cli", "core", "engine", "llmjobs", "worker")
# Other spellings of the serve spec's two sizes (the generic batch_size / max_length are every library's words)
OTHER_NAMES = ("num_slots", "max_batch_size", "max_concurrent_requests", "max_seq_len", "context_length")
SYNONYM_TABLE = Path("core/admission.py")


def test_the_serve_sizes_have_one_name_in_product_code() -> None:
    pattern = re.compile(r"\b(" + "|".join(OTHER_NAMES) + r")\b")
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        if path.relative_to(ROOT) != SYNONYM_TABLE
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert found == [], "\n".join(found)
    assert pattern.search((ROOT / SYNONYM_TABLE).read_text()), "the synonym table moved: update SYNONYM_TABLE"
