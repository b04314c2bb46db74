"""Qwen3 dense decoder: math only. Parallelism is applied from outside (engine.parallel)."""
