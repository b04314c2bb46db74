"""The engine's torch-free contract: what the service (``app``, ``core``, ``worker``) and the torch runtime share.

Nothing here imports torch, directly or indirectly (an import-linter contract in ``pyproject.toml`` holds it).
"""
