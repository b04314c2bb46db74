"""The engine's torch-free contract: everything the service (``app``, ``core``, ``worker``) and the torch runtime
share, and all of the engine the service may import (import-linter contracts in ``pyproject.toml`` hold both: nothing
here imports torch or the rest of the engine, directly or indirectly).

- ``spec``, ``flags``, ``guard``: the job specs (pydantic), MindSpeed flag names <-> spec fields, path guards.
- ``runfiles``, ``retention``, ``constants``, ``parent_death``: the run directory's files and ``BadInput``, which
  checkpoints a run keeps, shared constants, a child process that dies with its launcher.
- ``model_config``, ``rope_scaling``, ``lora_targets``: model shapes (HF config <-> Megatron names, presets),
  YaRN/linear RoPE scaling, LoRA target names.
- ``families``: the model families the engine runs (a torch-free descriptor each; the runtime registers the model).
- ``layout``: ``ParallelDims`` and the one TP/PP/EP/CP divisibility rule every caller uses.
- ``inspect``, ``owner``, ``allow_list``: checkpoint format detection and shapes, who wrote a checkpoint, the one
  allow-list unpickler.
- ``indexed``, ``sampler``, ``lengths``: Megatron indexed datasets, the trainer's sample order, rows and padding.
- ``plan``: the memory planner (admission and ``engine plan``).
- ``serve_request``: the serving request (``ServeRequest``), typed once for the API's OpenAI routes, the engine's
  server and a remote eval.
"""
