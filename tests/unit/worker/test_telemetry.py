"""Device telemetry sampled by the worker: the CPU sampler on a real process tree (two 'ranks' under a launcher,
found by LOCAL_RANK), lines in metrics.jsonl's shape ingested as per-device metric points, the npu-smi parser (a
stand-in text: no Ascend tool here), and no sampler (not a failure) where the device library is missing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from sqlalchemy import select

from core.db import session_scope
from core.models import MetricPoint
from core_support import isolated_settings, make_job
from worker.ingest import RunIngestor
from worker.telemetry import CpuSampler, TelemetryRecorder, parse_npu_smi, pick_sampler, start_telemetry

# A launcher that starts two ranks: rank 0 spins and holds ~64 MB, rank 1 sleeps.
LAUNCHER = """
import os, subprocess, sys, time
rank0 = "b = bytearray(64 << 20)\\nimport time\\nend = time.time() + 30\\nwhile time.time() < end: pass"
kids = [subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "LOCAL_RANK": str(r)})
        for r, code in ((0, rank0), (1, "import time; time.sleep(30)"))]
print("up", flush=True)
for k in kids: k.wait()
"""


@pytest.fixture
def launcher() -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"}
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
    yield proc
    os.killpg(proc.pid, 9)
    proc.wait()


def test_cpu_sampler_reports_each_rank_process(launcher: subprocess.Popen[str]) -> None:
    sampler = CpuSampler(launcher.pid)
    sampler.sample()  # cpu_percent measures from the first call on
    deadline = time.monotonic() + 20
    while True:
        time.sleep(1.0)
        sample = sampler.sample()
        if (
            sample.get(0, {}).get("sys_mem_used_mb", 0) > 64
            and sample[0]["sys_util_pct"] > 20
            or time.monotonic() > deadline
        ):
            break
    assert set(sample) == {0, 1}  # the launcher itself is no rank
    assert sample[0]["sys_mem_used_mb"] > 64 and sample[0]["sys_util_pct"] > 20  # the spinning rank holding 64 MB
    assert sample[1]["sys_util_pct"] < sample[0]["sys_util_pct"]
    assert sample[0]["sys_mem_total_mb"] == sample[1]["sys_mem_total_mb"] > sample[0]["sys_mem_used_mb"]


def test_a_single_process_job_is_rank_0(tmp_path: Path) -> None:
    code = "b = bytearray(48 << 20)\nimport time\nend = time.time() + 20\nwhile time.time() < end: pass"
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env)  # `python -m engine`, no torchrun
    try:
        sampler = CpuSampler(proc.pid)
        sampler.sample()
        deadline = time.monotonic() + 15
        while True:  # until the child has started and allocated (a loaded machine starts Python slowly)
            time.sleep(0.5)
            sample = sampler.sample()
            if sample.get(0, {}).get("sys_mem_used_mb", 0) > 48 or time.monotonic() > deadline:
                break
    finally:
        proc.kill()
        proc.wait()
    assert set(sample) == {0} and sample[0]["sys_mem_used_mb"] > 48 and sample[0]["sys_util_pct"] > 0


def test_samples_are_ingested_as_per_device_metrics(tmp_path: Path, launcher: subprocess.Popen[str]) -> None:
    settings = isolated_settings(tmp_path / "var")
    job_id = make_job(settings)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    ingestor = RunIngestor(settings.database_url, job_id, run_dir, attempt=1)  # before the file exists, as on a node
    recorder = TelemetryRecorder(run_dir / "telemetry-node1.jsonl", CpuSampler(launcher.pid), 5.0, 2, [4, 5])
    assert recorder.record_once() == 2 and recorder.record_once() == 2
    line = json.loads((run_dir / "telemetry-node1.jsonl").read_text().splitlines()[0])
    assert set(line["rank_metrics"]) == {"2", "3"} and line["metrics"] == {}  # node 1 of two-device nodes
    assert line["rank_metrics"]["3"]["sys_device_id"] == 5  # the host's id of the node's second device
    assert ingestor.poll(final=True)["metrics"] == 2 * 2 * 4
    with session_scope(settings.database_url) as session:
        points = session.scalars(select(MetricPoint).where(MetricPoint.job_id == job_id)).all()
    assert {(p.name, p.rank) for p in points} == {
        (n, r) for n in ("sys_util_pct", "sys_mem_used_mb", "sys_mem_total_mb", "sys_device_id") for r in (2, 3)
    }


def test_recorder_thread_samples_until_stopped(tmp_path: Path, launcher: subprocess.Popen[str]) -> None:
    recorder = start_telemetry(tmp_path, 0, "cpu", [0, 1], launcher.pid, interval_s=0.2)
    assert recorder is not None
    time.sleep(1.5)
    recorder.stop()
    lines = (tmp_path / "telemetry-node0.jsonl").read_text().splitlines()
    assert len(lines) >= 3
    count = len(lines)
    time.sleep(0.5)
    assert len((tmp_path / "telemetry-node0.jsonl").read_text().splitlines()) == count  # stopped means stopped
    assert start_telemetry(tmp_path, 0, "cpu", [0], launcher.pid, interval_s=0) is None  # 0 = off


NPU_SMI_TEXT = """
        NPU ID                         : 0
        Chip Count                     : 1
        Aicore Usage Rate(%)           : 87
        Temperature(C)                 : 52
        HBM Capacity(MB)               : 65536
        HBM Usage Rate(%)              : 25
        Power Dissipation(W)           : 210.5
        Aicore curFreq(MHZ)            : 1800
"""


def test_npu_smi_text_parsed() -> None:
    assert parse_npu_smi(NPU_SMI_TEXT) == {
        "sys_util_pct": 87,
        "sys_temp_c": 52,
        "sys_mem_total_mb": 65536,
        "sys_mem_used_mb": 16384,
        "sys_power_w": 210.5,
    }
    assert parse_npu_smi("Error: no such device") == {}


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine has NVML")
def test_no_sampler_where_the_device_library_is_missing() -> None:
    assert pick_sampler("cuda", [0], os.getpid()) is None  # no NVML library or driver: no telemetry, no failure
    if not any((Path(p) / "npu-smi").exists() for p in os.environ.get("PATH", "").split(os.pathsep)):
        assert pick_sampler("npu", [0], os.getpid()) is None
