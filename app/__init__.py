"""llmjobs service: HTTP API, database, dispatcher/reconciler and CLI."""
