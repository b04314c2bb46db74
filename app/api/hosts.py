"""Hosts: their devices, which job holds each, and health."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from fastapi import APIRouter
from pydantic import BaseModel, Field

from app.api.deps import PrincipalDep, SessionDep, SettingsDep
from app.schemas import ListPage
from core.auth import Principal
from core.inventory import inventory
from core.models import Host, Lease, utcnow
from core.scheduler import host_ids, is_live
from core.states import HostState

router = APIRouter(prefix="/v1/hosts", tags=["hosts"])


class DevicePublic(BaseModel):
    id: int
    held: bool
    job_id: str | None = Field(None, description="the job holding the device (hidden for other teams' jobs)")
    node_rank: int | None = None


Health = Literal["up", "stale", "down"]


class HostPublic(BaseModel):
    object: Literal["host"] = "host"
    name: str
    device_type: str
    address: str | None
    health: Health = Field(description="stale: no heartbeat within host_stale_after_s")
    heartbeat_at: datetime
    heartbeat_age_s: float
    devices: list[DevicePublic]
    free: int


def _host_public(
    host: Host, leases: dict[int, Lease], teams: dict[str, str], principal: Principal, live: bool
) -> HostPublic:
    devices = []
    for device in host_ids(host):
        lease = leases.get(device)
        shown = lease if lease is not None and principal.sees(teams.get(lease.job_id)) else None
        devices.append(
            DevicePublic(
                id=device,
                held=lease is not None,
                job_id=shown.job_id if shown else None,
                node_rank=shown.node_rank if shown else None,
            )
        )
    health: Health = "down" if host.state == HostState.down.value else ("up" if live else "stale")
    return HostPublic(
        name=host.name,
        device_type=host.device_type,
        address=host.address,
        health=health,
        heartbeat_at=host.heartbeat_at,
        heartbeat_age_s=round((utcnow() - host.heartbeat_at).total_seconds(), 1),
        devices=devices,
        free=sum(not d.held for d in devices),
    )


@router.get("", response_model=ListPage[HostPublic], responses={401: {"description": "No or bad token"}})
def list_hosts(session: SessionDep, principal: PrincipalDep, settings: SettingsDep) -> ListPage[HostPublic]:
    """Every registered host with its devices, the job holding each, and health."""
    cluster = inventory(session)
    data = [
        _host_public(h, cluster.leases.get(h.name, {}), cluster.teams, principal, is_live(h, settings))
        for h in cluster.hosts
    ]
    return ListPage[HostPublic].of(data, key=lambda host: host.name)
