"""MoE router figures of a training step: the aux-loss weight each MoE layer applies, and the per-step report.

The load-balancing loss reaches the gradient inside the model (``engine.model.moe``: each MoE layer attaches
``coeff × switch loss`` to its output with Megatron's ``MoEAuxLossAutoScaler``), so it is differentiated wherever the
LM loss is — under activation recompute too — and the LM loss the runner returns stays the LM loss. The trainer only
sets how much one routed token's aux loss weighs: ``loss_scale / global real tokens``, so each micro-batch's aux loss
counts in proportion to its tokens and the step differentiates ``lm_loss + coeff × sum over MoE layers of the
(token-weighted mean) switch loss`` (transformers' ``loss + router_aux_loss_coef × aux_loss`` shape), whatever the
share of labelled tokens or the micro-batch split. It reports, per step: ``load_balancing_loss`` (Megatron's logged
value: the switch loss without its coefficient, mean over MoE layers and micro-batches, 1.0 when perfectly
balanced), ``expert_load_imbalance_max`` and ``expert_load_imbalance_layer_<i>`` (max / mean tokens per expert of MoE
layer i over the global batch, 1.0 = even) and ``dropped_token_fraction`` (capacity dropping). The per-layer counts
are summed over DP ranks and gathered over pipeline stages with one small all-reduce each per step; the numbers are
read on the host only at the metrics flush.

Padding tokens are routed like any token (Megatron does the same): they count in the figures and the aux loss. So a
pipeline run, which pads packed rows (``padding_free``) or ``variable_seq_lengths`` micro-batches to a bucketed
width, routes a few more padding tokens than one process would, and so does context parallelism where a row's
length is not a multiple of 2 × CP (``engine.train.batches.context_shard`` pads it); samples padded to ``seq_length``
route the same.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from engine.model.moe import MoELayer, RouterMetrics, moe_layers


class RouterTracker:
    """The MoE layers of the model this rank trains part of (a dense model: every method is a no-op).

    ``layers``: every MoE layer of the whole model (global indices); ``modules``: those this rank holds (a pipeline
    stage holds some; a stage may hold none). Figures are summed over DP and gathered over pipeline stages (each
    layer's row comes from the one stage holding it), so every rank reports the one-process figures. TP ranks route
    the same tokens (``engine.parallel.tensor_parallel.ExpertTensorParallel``) and count the same: no TP reduction.
    Under context parallelism each rank counts its share of the tokens and its share of the switch loss (``engine.
    model.moe.MoELayer._sequence_counts``): summed over DP × CP they are the one-process figures, the forwards (each
    seen by every CP rank) divided by CP."""

    def __init__(
        self,
        module: nn.Module,
        dp_group: dist.ProcessGroup | None,
        pp_group: dist.ProcessGroup | None = None,
        context_parallel: int = 1,
    ) -> None:
        self.modules: dict[int, MoELayer] = moe_layers(module)
        cfg = getattr(module, "cfg", None)
        self.layers: list[int] = list(cfg.moe_layers) if cfg is not None else list(self.modules)
        self.num_experts = int(cfg.num_experts or 0) if cfg is not None and self.layers else 0
        self.dp_group, self.pp_group = dp_group, pp_group
        self.context_parallel = context_parallel  # ``dp_group`` is DP × CP then: each forward counted CP times
        first = next(iter(module.parameters()), None)
        self.device = first.device if first is not None else torch.device("cpu")

    def __bool__(self) -> bool:
        return bool(self.layers)

    def set_token_weight(self, weight: torch.Tensor | float) -> None:
        """Weight of one routed token's aux loss in backward (the LM loss's per-token weight): every micro-batch's
        forward multiplies it by its own routed-token count, as the LM loss counts that micro-batch's tokens."""
        for layer in self.modules.values():
            layer.aux_loss_token_scale = weight

    def discard(self) -> None:
        """Forget what forwards counted so far (validation passes)."""
        for layer in self.modules.values():
            layer.stats = None

    def step_figures(self) -> torch.Tensor | None:
        """(layers, E + 3) global sums since the last call: tokens per expert, switch-loss sum, dropped assignments,
        forwards; None without MoE layers. One all-reduce over DP (and one over PP); stays on the device."""
        if not self.layers:
            return None
        figures = torch.zeros(len(self.layers), self.num_experts + 3, dtype=torch.float64, device=self.device)
        for row, index in enumerate(self.layers):
            layer = self.modules.get(index)
            s = layer.stats if layer is not None else None
            if s is None:
                continue  # another stage's layer, or no forward yet: zeros in the sum
            figures[row, :-3] = s.tokens_per_expert
            figures[row, -3] = s.balance_loss_sum
            figures[row, -2] = s.dropped
            figures[row, -1] = float(s.forwards)
        self.discard()
        if dist.is_initialized():
            dist.all_reduce(figures, group=self.dp_group)
            if self.pp_group is not None:
                dist.all_reduce(figures, group=self.pp_group)
        figures[:, -1] /= self.context_parallel
        return figures


def router_summary(layers: list[int], figures: list[list[float]]) -> dict[str, float]:
    """The step's metrics from ``step_figures`` read on the host (rows in ``layers`` order)."""
    if not layers:
        return {}
    table = torch.tensor(figures, dtype=torch.float64)
    metrics = RouterMetrics(layers, table[:, :-3], table[:, -3], table[:, -2], int(table[:, -1].max()))
    summary = metrics.summary()
    out: dict[str, float] = {}
    for name, value in summary.items():
        if isinstance(value, list):
            out.update({f"{name}_layer_{i}": v for i, v in zip(layers, value, strict=True)})
        else:
            out[name] = value
    return out
