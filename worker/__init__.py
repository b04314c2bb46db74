"""llmjobs worker: Celery tasks, the engine launcher, process supervision, run-file ingestion and local runs. It calls
the domain core (core/) and never the HTTP layer."""
