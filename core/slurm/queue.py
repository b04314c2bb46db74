"""The batched reads of Slurm's queue: one ``sacct`` (or ``squeue`` where accounting is off) for all live jobs.

``sacct`` is asked first; a cluster without accounting answers an error ("Slurm accounting storage is disabled") and
from then on ``squeue --states=all`` serves, which still lists finished jobs for ``MinJobAge`` seconds (300 by
default). A job neither lists is ``missing``: the tracker decides it from its run directory.
"""

from __future__ import annotations

import logging
import subprocess
from dataclasses import dataclass
from typing import Literal

log = logging.getLogger(__name__)
SACCT_FIELDS = "JobID,State,ExitCode,NodeList,Reason"
SQUEUE_FORMAT = "JobID:|,State:|,exit_code:|,NodeList:|,Reason:|"  # ':|' = no padding, '|' after each field
COMMAND_TIMEOUT_S = 30.0
# sbatch's words for a controller that is busy or away (try again later), not for a job it refuses
UNAVAILABLE = ("Unable to contact slurm controller", "Socket timed out", "temporarily unable", "Resource temporarily")


@dataclass(frozen=True)
class SlurmJob:
    job_id: str
    state: str
    exit_code: int | None  # the batch script's exit status; None while it runs or when killed by a signal
    signal: int | None
    nodes: str
    reason: str


class SlurmUnavailable(RuntimeError):
    """The controller did not answer (or the command is missing); the caller backs off."""


def _exit(text: str) -> tuple[int | None, int | None]:
    """sacct's ``code:signal``."""
    code, _, sig = text.partition(":")
    try:
        return int(code), int(sig or 0) or None
    except ValueError:
        return None, None


def parse_sacct(text: str) -> dict[str, SlurmJob]:
    """``sacct -X -n --parsable2 -o JobID,State,ExitCode,NodeList,Reason``: one line per job allocation. A requeued
    job's later row wins; steps (``123.batch``) and array children's bracketed ids are skipped."""
    jobs: dict[str, SlurmJob] = {}
    for line in text.splitlines():
        parts = line.split("|")
        if len(parts) < 5 or not parts[0].isdigit():
            continue
        code, sig = _exit(parts[2])
        jobs[parts[0]] = SlurmJob(parts[0], parts[1].strip(), code, sig, parts[3].strip(), parts[4].strip())
    return jobs


def parse_squeue(text: str) -> dict[str, SlurmJob]:
    """``squeue -h --states=all -O JobID:|,State:|,exit_code:|,NodeList:|,Reason:|``; squeue's exit code is the raw
    wait status (``code << 8 | signal``)."""
    jobs: dict[str, SlurmJob] = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split("|")]
        if len(parts) < 5 or not parts[0].isdigit():
            continue
        try:
            status = int(parts[2])
        except ValueError:
            code, sig = None, None
        else:
            code, sig = (status >> 8) & 0xFF, (status & 0x7F) or None
        jobs[parts[0]] = SlurmJob(parts[0], parts[1], code, sig, parts[3], parts[4])
    return jobs


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise SlurmUnavailable(f"{argv[0]}: {err}") from err


@dataclass
class Queue:
    """Asks Slurm about many jobs at once; remembers that sacct is off once it said so."""

    source: Literal["sacct", "squeue"] | None = None  # None: try sacct first

    def read(self, job_ids: list[str]) -> dict[str, SlurmJob]:
        if not job_ids:
            return {}
        if self.source != "squeue":
            done = _run(["sacct", "-X", "-n", "--parsable2", "-o", SACCT_FIELDS, "-j", ",".join(job_ids)])
            if done.returncode == 0:
                self.source = "sacct"
                return parse_sacct(done.stdout)
            if self.source == "sacct":  # it worked before: the controller or slurmdbd is busy, back off
                raise SlurmUnavailable(f"sacct: {done.stderr.strip()}")
            log.info("sacct unavailable (%s); reading squeue from now on", done.stderr.strip())
            self.source = "squeue"
        done = _run(["squeue", "-h", "--states=all", "-O", SQUEUE_FORMAT, "-j", ",".join(job_ids)])
        if done.returncode != 0 and "Invalid job id" in done.stderr:
            # every id asked is gone from squeue (past MinJobAge): all of them are missing
            return {}
        if done.returncode != 0:
            raise SlurmUnavailable(f"squeue: {done.stderr.strip()}")
        return parse_squeue(done.stdout)


def submit(script: str, cwd: str) -> str:
    """``sbatch --parsable`` the script from stdin; the Slurm job id."""
    try:
        done = subprocess.run(
            ["sbatch", "--parsable"],
            input=script,
            capture_output=True,
            text=True,
            cwd=cwd,
            timeout=COMMAND_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        raise SlurmUnavailable(f"sbatch: {err}") from err
    if done.returncode != 0 and any(words in done.stderr for words in UNAVAILABLE):
        raise SlurmUnavailable(f"sbatch: {done.stderr.strip()}")  # the job stays queued; the agent backs off
    if done.returncode != 0:
        raise SubmitRefused(done.stderr.strip() or f"sbatch exited {done.returncode}")
    return done.stdout.strip().split(";", 1)[0]  # '<id>[;<cluster>]'


class SubmitRefused(RuntimeError):
    """sbatch refused the script (a bad partition, account, gres...): the job fails with Slurm's words."""


def cancel(job_ids: list[str]) -> None:
    if job_ids:
        done = _run(["scancel", *job_ids])
        if done.returncode != 0:
            raise SlurmUnavailable(f"scancel: {done.stderr.strip()}")
