"""llmjobs worker: Celery tasks, the engine launcher, process supervision and run-file ingestion."""
