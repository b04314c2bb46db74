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
layer i over the global batch, 1.0 = even) and ``dropped_token_fraction`` (capacity dropping). The per-layer counts are summed over DP ranks with one small
all-reduce per step; the numbers are read on the host only at the metrics flush.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from engine.model.moe import MoELayer, RouterMetrics, moe_layers


class RouterTracker:
    """The MoE layers of this rank's model (none: every method is a no-op)."""

    def __init__(self, module: nn.Module, dp_group: dist.ProcessGroup | None) -> None:
        self.layers: dict[int, MoELayer] = moe_layers(module)
        self.dp_group = dp_group
        self.num_experts = next(iter(self.layers.values())).num_experts if self.layers else 0

    def __bool__(self) -> bool:
        return bool(self.layers)

    def set_token_weight(self, weight: torch.Tensor | float) -> None:
        """Weight of one routed token's aux loss in backward (the LM loss's per-token weight)."""
        for layer in self.layers.values():
            layer.aux_loss_token_scale = weight

    def discard(self) -> None:
        """Forget what forwards counted so far (validation passes)."""
        for layer in self.layers.values():
            layer.stats = None

    def step_figures(self) -> torch.Tensor | None:
        """(layers, E + 3) global sums since the last call: tokens per expert, switch-loss sum, dropped assignments,
        forwards; None without MoE layers. One all-reduce over DP; stays on the device."""
        if not self.layers:
            return None
        rows = []
        for layer in self.layers.values():
            s = layer.stats
            if s is None:
                rows.append(torch.zeros(self.num_experts + 3, device=layer.router.weight.device))
                continue
            extra = torch.stack(
                [
                    s.balance_loss_sum.float(),
                    s.dropped.float(),
                    torch.tensor(float(s.forwards), device=s.dropped.device),
                ]
            )
            rows.append(torch.cat([s.tokens_per_expert.float(), extra]))
        self.discard()
        figures = torch.stack(rows).double()
        if dist.is_initialized():
            dist.all_reduce(figures, group=self.dp_group)
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
