"""Job-node transitions: each one compare-and-set on ``job_nodes.state`` (see ``core.states.NodeState``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy import ColumnElement, update
from sqlalchemy.orm import Session

from core.models import JobNode
from core.states import NodeState, sources


def move_nodes(
    session: Session,
    target: NodeState,
    *where: ColumnElement[bool],
    only_from: Iterable[NodeState] | None = None,
    **values: Any,
) -> int:
    """Move the nodes matching ``where`` that are in an allowed source state to ``target``; returns how many moved.

    Does not commit: the caller's transaction decides (a claim commits alone, a drop commits with its leases)."""
    stmt = (
        update(JobNode)
        .where(*where, JobNode.state.in_(sources(target, only_from)))
        .values(state=target.value, **values)
        .execution_options(synchronize_session=False)
    )
    return int(session.execute(stmt).rowcount)  # type: ignore[attr-defined]
