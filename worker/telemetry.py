"""Device telemetry of a running job, sampled by the worker next to the engine (the engine knows nothing of it).

Every ``telemetry_interval_s`` a thread samples each device this node leased and appends one line to
``<run_dir>/telemetry-node<R>.jsonl`` in ``metrics.jsonl``'s shape; the ingestor copies those lines like the
engine's metrics, so they reach the database, the SSE stream and the dashboard by the existing path.

- CUDA: NVML through ``pynvml`` (the ``nvidia-ml-py`` package), imported only when a CUDA job runs.
- NPU: ``npu-smi info -t common|usages|power -i <id>`` (Ascend's own tool; reading it does not open a device
  context in the worker, which ``torch_npu`` would).
- CPU: the engine processes (one per rank, found by their ``LOCAL_RANK``; a job launched without torchrun is one
  rank 0) with their children, through ``psutil``: CPU % (100 = one core), resident memory, the host's total memory.

Names: ``sys_util_pct``, ``sys_mem_used_mb``, ``sys_mem_total_mb``, ``sys_temp_c``, ``sys_power_w`` (each only where
the device reports it), and ``sys_device_id``, the device's id on its host (what the hosts page shows).
``rank_metrics`` is keyed by the device's index within the job (node_rank * devices per node + position), and
``step`` is whole seconds since the node started: a sampling clock, not a training step.
"""

from __future__ import annotations

import importlib
import json
import logging
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import psutil

log = logging.getLogger(__name__)
MB = 1 << 20
Sample = dict[int, dict[str, float]]  # device position on this node -> metrics


class Sampler(Protocol):
    def sample(self) -> Sample: ...


class CpuSampler:
    """CPU % and RSS of each rank's process tree (the rank from the process's LOCAL_RANK), under the torchrun root."""

    def __init__(self, root_pid: int):
        self.root_pid = root_pid
        self.procs: dict[int, psutil.Process] = {}  # kept across samples: cpu_percent measures since the last call
        self.total_mb = psutil.virtual_memory().total / MB

    def _rank_of(self, proc: psutil.Process) -> int | None:
        try:
            value = proc.environ().get("LOCAL_RANK")
        except (psutil.Error, OSError):
            return None
        return int(value) if value is not None and value.isdigit() else None

    def sample(self) -> Sample:
        try:
            root = psutil.Process(self.root_pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return {}
        current = {p.pid: self.procs.get(p.pid, p) for p in tree}
        self.procs = current
        ranks: dict[int, int | None] = {pid: self._rank_of(p) for pid, p in current.items()}
        if all(r is None for r in ranks.values()):
            ranks[self.root_pid] = 0  # one process, launched without torchrun: the root is rank 0
        out: Sample = {}
        for pid, proc in current.items():
            rank = ranks[pid]
            parent: psutil.Process | None = proc
            while rank is None and parent is not None and parent.pid != self.root_pid:
                try:  # a rank's own children (data workers) count towards it
                    parent = parent.parent()
                except psutil.Error:
                    parent = None
                rank = ranks.get(parent.pid) if parent is not None else None
            if rank is None:
                continue
            try:
                cpu, rss = proc.cpu_percent(None), proc.memory_info().rss / MB
            except psutil.Error:
                continue
            row = out.setdefault(rank, {"sys_util_pct": 0.0, "sys_mem_used_mb": 0.0, "sys_mem_total_mb": self.total_mb})
            row["sys_util_pct"] += cpu
            row["sys_mem_used_mb"] += rss
        return out


class NvmlSampler:
    """Utilisation, memory, temperature and power of the leased GPUs (physical ids) through NVML."""

    def __init__(self, device_ids: list[int]):
        self.nvml = importlib.import_module("pynvml")  # ImportError when nvidia-ml-py is absent
        self.nvml.nvmlInit()  # NVMLError without a driver
        self.handles = [self.nvml.nvmlDeviceGetHandleByIndex(i) for i in device_ids]

    def _read(self, handle: Any) -> dict[str, float]:
        nv, row = self.nvml, {}
        readers: list[tuple[str, Callable[[], float]]] = [
            ("sys_util_pct", lambda: float(nv.nvmlDeviceGetUtilizationRates(handle).gpu)),
            ("sys_mem_used_mb", lambda: nv.nvmlDeviceGetMemoryInfo(handle).used / MB),
            ("sys_mem_total_mb", lambda: nv.nvmlDeviceGetMemoryInfo(handle).total / MB),
            ("sys_temp_c", lambda: float(nv.nvmlDeviceGetTemperature(handle, nv.NVML_TEMPERATURE_GPU))),
            ("sys_power_w", lambda: nv.nvmlDeviceGetPowerUsage(handle) / 1000.0),
        ]
        for name, read in readers:
            try:
                row[name] = read()
            except nv.NVMLError:
                continue  # not every board reports every field
        return row

    def sample(self) -> Sample:
        return {i: self._read(h) for i, h in enumerate(self.handles)}


_NPU_FIELDS = {
    "Aicore Usage Rate(%)": "sys_util_pct",
    "Temperature(C)": "sys_temp_c",
    "Power Dissipation(W)": "sys_power_w",
    "NPU Real-time Power(W)": "sys_power_w",
    "HBM Capacity(MB)": "sys_mem_total_mb",
    "HBM Usage Rate(%)": "hbm_pct",
}


def parse_npu_smi(text: str) -> dict[str, float]:
    """The fields we chart from ``npu-smi info -t ...`` text ("Key : value" lines); memory used from HBM capacity
    and usage rate, as npu-smi reports no used-MB figure there."""
    row: dict[str, float] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        name = _NPU_FIELDS.get(key.strip())
        number = re.match(r"\s*(-?\d+(?:\.\d+)?)", value)
        if sep and name and number:
            row[name] = float(number.group(1))
    if "hbm_pct" in row:
        pct = row.pop("hbm_pct")
        if "sys_mem_total_mb" in row:
            row["sys_mem_used_mb"] = row["sys_mem_total_mb"] * pct / 100.0
    return row


class NpuSmiSampler:
    def __init__(self, device_ids: list[int], npu_smi: str):
        self.device_ids, self.npu_smi = device_ids, npu_smi

    def _read(self, device: int) -> dict[str, float]:
        row: dict[str, float] = {}
        for kind in ("common", "usages", "power"):
            try:
                out = subprocess.run(
                    [self.npu_smi, "info", "-t", kind, "-i", str(device)],
                    capture_output=True,
                    text=True,
                    timeout=10,
                    check=False,
                ).stdout
            except (OSError, subprocess.TimeoutExpired):
                continue
            row.update(parse_npu_smi(out))
        return row

    def sample(self) -> Sample:
        return {i: self._read(d) for i, d in enumerate(self.device_ids)}


def pick_sampler(device_type: str, device_ids: list[int], root_pid: int) -> Sampler | None:
    """The sampler for this node's devices, or None (logged) when the device's library or tool is missing."""
    try:
        if device_type == "cuda":
            return NvmlSampler(device_ids)
        if device_type == "npu":
            tool = shutil.which("npu-smi")
            if tool is None:
                log.info("no npu-smi on PATH: no NPU telemetry")
                return None
            return NpuSmiSampler(device_ids, tool)
        return CpuSampler(root_pid)
    except Exception as err:  # noqa: BLE001 - telemetry is optional: no NVML/driver must not fail the job
        log.info("no %s telemetry: %s", device_type, err)
        return None


class TelemetryRecorder:
    """A daemon thread appending one sample line every ``interval_s`` until ``stop()``."""

    def __init__(self, path: Path, sampler: Sampler, interval_s: float, first_index: int, device_ids: list[int]):
        self.path, self.sampler, self.interval_s, self.first_index = path, sampler, interval_s, first_index
        self.device_ids = device_ids
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"telemetry:{path.parent.name}", daemon=True)

    def start(self) -> TelemetryRecorder:
        self._thread.start()
        return self

    def record_once(self) -> int:
        """Sample now and append the line; returns the number of devices reported."""
        sample = self.sampler.sample()
        if not sample:
            return 0
        rows = {
            str(self.first_index + i): {**values, "sys_device_id": float(self.device_ids[i])}
            for i, values in sample.items()
            if values and i < len(self.device_ids)
        }
        record = {
            "time": time.time(),
            "step": int(time.monotonic() - self.started),
            "metrics": {},
            "rank_metrics": rows,
        }
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        return len(rows)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.record_once()
            except Exception as err:  # noqa: BLE001 - a failed sample is skipped, the job goes on
                log.warning("telemetry sample failed: %s", err)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=15)


def start_telemetry(
    run_dir: Path, node_rank: int, device_type: str, device_ids: list[int], root_pid: int, interval_s: float
) -> TelemetryRecorder | None:
    """Start sampling this node's devices (None when telemetry is off or unavailable here)."""
    if interval_s <= 0:
        return None
    sampler = pick_sampler(device_type, device_ids, root_pid)
    if sampler is None:
        return None
    path = run_dir / f"telemetry-node{node_rank}.jsonl"
    return TelemetryRecorder(path, sampler, interval_s, node_rank * len(device_ids), device_ids).start()
