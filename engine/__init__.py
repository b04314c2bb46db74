"""The distributed engine: Qwen3 model, data, training, conversion, evaluation. Knows nothing of HTTP or databases."""
