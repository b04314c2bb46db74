"""What a worker host offers: its device type and device ids, discovered or configured, and its address.

NPUs are counted through ``torch_npu`` and GPUs through ``torch.cuda`` (imported only when asked for, so a CPU worker
starts without torch). A visible-devices variable set on the worker (``ASCEND_RT_VISIBLE_DEVICES``,
``CUDA_VISIBLE_DEVICES``) restricts the host to those physical ids: leases hand out physical ids, and the launcher
exposes exactly the leased ones to the engine. On CPU machines the "devices" are a configured number of slots.
"""

from __future__ import annotations

import importlib
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from worker.launcher import VISIBLE_DEVICES_VAR

DEVICE_TYPES = ("cpu", "cuda", "npu")


@dataclass(frozen=True)
class Inventory:
    device_type: str
    device_ids: list[int]
    source: str  # "torch_npu", "torch.cuda", "configured" or "visible-devices"


def _count(device_type: str) -> int:
    """Devices the runtime sees (0 when the library is missing or finds none)."""
    try:
        if device_type == "npu":
            importlib.import_module("torch_npu")  # registers torch.npu
            torch = importlib.import_module("torch")
            return int(torch.npu.device_count())
        torch = importlib.import_module("torch")
        return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
    except (ImportError, RuntimeError, AttributeError):
        return 0


def device_memory_bytes(device_type: str, slots: int = 1) -> int | None:
    """Memory of one device (the first visible one; hosts are homogeneous), for the submission-time memory check
    (``engine.contract.plan.check_registered_memory``): on CPU the host's RAM shared by its ``slots`` (each rank is a
    process in the same RAM); None when the runtime cannot tell."""
    if device_type == "cpu":
        return host_memory_bytes() // max(slots, 1) or None
    if device_type not in ("cuda", "npu") or _count(device_type) == 0:
        return None
    try:
        torch = importlib.import_module("torch")
        accelerator = torch.npu if device_type == "npu" else torch.cuda
        return int(accelerator.get_device_properties(0).total_memory)
    except (ImportError, RuntimeError, AttributeError):
        return None


def host_memory_bytes() -> int:
    """Physical RAM of this host (0 where the system cannot say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def _visible_ids(device_type: str, env: Mapping[str, str]) -> list[int] | None:
    raw = env.get(VISIBLE_DEVICES_VAR.get(device_type, ""), "").strip()
    if not raw:
        return None
    try:
        return [int(v) for v in raw.split(",") if v.strip()]
    except ValueError as err:
        raise ValueError(
            f"{VISIBLE_DEVICES_VAR[device_type]}: expected comma-separated device ids, got {raw!r}"
        ) from err


def discover(
    device_type: str = "auto", configured: int | None = None, env: Mapping[str, str] | None = None
) -> Inventory:
    """The host's devices. ``device_type`` "auto" picks npu, then cuda, then cpu; ``configured`` overrides the count."""
    env = os.environ if env is None else env
    if device_type == "auto":
        device_type = next((t for t in ("npu", "cuda") if _count(t) > 0), "cpu")
    if device_type not in DEVICE_TYPES:
        raise ValueError(f"device_type: {device_type!r} is not one of {', '.join(DEVICE_TYPES)}")
    if device_type == "cpu":
        slots = 1 if configured is None else configured
        return Inventory("cpu", list(range(slots)), "configured")
    visible = _visible_ids(device_type, env)
    if configured is not None:
        ids = (visible or list(range(configured)))[:configured]
        return Inventory(device_type, ids, "configured")
    if visible is not None:
        return Inventory(device_type, visible, "visible-devices")
    count = _count(device_type)
    if count == 0:
        lib = "torch_npu" if device_type == "npu" else "torch.cuda"
        raise RuntimeError(
            f"--device-type {device_type}: {lib} finds no device on this host; pass --devices N to "
            "configure them or choose another device type"
        )
    return Inventory(device_type, list(range(count)), "torch_npu" if device_type == "npu" else "torch.cuda")


def host_address(configured: str = "") -> str:
    """The address other hosts reach this one at: the configured one, else the source address of the default route."""
    if configured:
        return configured
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("10.255.255.255", 1))  # UDP connect sends nothing; it only picks the outgoing interface
            return str(probe.getsockname()[0])
    except OSError:
        return "127.0.0.1"
