"""Memory planner: per-rank parameters, grads, optimizer state, activations, loss and communication buffers of a
train/eval job, from its spec and the lengths its data's index holds. No torch import: the API runs it at submission (``check_fits``).

- ``shape``: the model shape from ``load``'s config.json / Megatron args, a preset, or the flags.
- ``data_shape``: the largest micro-batch the job's data forms (its ``.idx`` lengths, the run's sample order).
- ``memory``: the accounting (Megatron's bf16 + distributed-optimizer scheme, PP schedules, recompute).
- ``planner``: spec -> ``MemoryPlan`` (``worst_case`` and ``this_data``); ``check_fits`` -> ``DoesNotFit`` naming the
  field to change and what would fit.
- ``cli``: ``python -m engine plan``.
"""

from engine.contract.plan.memory import Layout, RankMemory, plan_ranks
from engine.contract.plan.planner import (
    DoesNotFit,
    MemoryPlan,
    breakdown,
    check_fits,
    check_registered_memory,
    plan_spec,
)
from engine.contract.plan.shape import ShapeUnknown, model_config

__all__ = [
    "DoesNotFit",
    "Layout",
    "MemoryPlan",
    "RankMemory",
    "ShapeUnknown",
    "breakdown",
    "check_fits",
    "check_registered_memory",
    "model_config",
    "plan_ranks",
    "plan_spec",
]
