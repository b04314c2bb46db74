"""The domain core shared by the HTTP API (app/) and the workers (worker/): settings, database, models, state
machines, jobs, scheduler, recovery, reconciler, pipelines, webhooks outbox, messaging. Imports neither of them."""
