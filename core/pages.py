"""Cursor pages: ``limit`` rows and whether more follow, read as ``limit + 1`` rows in one query."""

from __future__ import annotations

from typing import TypeVar

from sqlalchemy import Select
from sqlalchemy.orm import Session

T = TypeVar("T")


def fetch_page(session: Session, query: Select[T], limit: int) -> tuple[list[T], bool]:
    """The first ``limit`` rows of ``query`` (already ordered and filtered past the cursor) and ``has_more``."""
    rows = list(session.scalars(query.limit(limit + 1)))
    return rows[:limit], len(rows) > limit
