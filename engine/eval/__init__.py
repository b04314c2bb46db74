"""Evaluation: batched generation with a KV cache, exact-match scoring, loss evaluation; the ``eval`` job kind."""
