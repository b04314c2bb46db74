"""llmjobs HTTP layer: the FastAPI app, routes, dependencies, error handlers, SSE streaming, response schemas and the
dashboard (ui/). It calls the domain core (core/) and never the worker."""
