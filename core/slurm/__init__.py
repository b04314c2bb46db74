"""Slurm pools: jobs with ``resources.pool`` run on a Slurm partition instead of the pinned hosts.

``pools`` (admission against a pool), ``states`` (Slurm's job states -> the job's), ``queue`` (the batched
squeue/sacct reads and their parsing), ``script`` (the sbatch script), ``tracker`` (the database side: submit,
apply Slurm's states, cancel). The process that runs them is ``worker.slurm_agent`` (``llmjobs slurm-agent``).
"""
