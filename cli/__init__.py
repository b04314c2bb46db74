"""The `llmjobs` command: service processes, remote client commands, tokens, local runs."""
