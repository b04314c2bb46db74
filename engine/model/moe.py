"""Qwen3-MoE sparse MLP, math only: router (softmax -> top-k, optional renormalisation), SwiGLU experts computed as
grouped matmuls, Megatron's load-balancing loss and token dropping.

References: transformers ``models/qwen3_moe/modeling_qwen3_moe.py`` (numerics: fp32 softmax over the router logits,
``topk``, ``norm_topk_prob``, weights cast back to the activation dtype and applied after ``down_proj``) and
Megatron-Core ``transformer/moe/router.py`` + ``moe_utils.py`` (``switch_load_balancing_loss_func``, its
``MoEAuxLossAutoScaler``, ``apply_router_token_dropping`` with the "probs" policy, ``get_capacity``).

Layout (native keys under ``decoder.layers.{i}.mlp.``; HF names in ``engine.model.moe_mapping``):
- ``router.weight`` (E, H)
- ``experts.linear_fc1.weight`` (E, 2 * ffn, H): per expert ``[gate; up]`` like the dense ``linear_fc1``
- ``experts.linear_fc2.weight`` (E, H, ffn)
Experts are stacked so that one grouped matmul runs all of them, and so that expert parallelism shards dim 0. The
expert count is read from the weight shapes: an EP shard holding E/EP experts runs unchanged on its tokens.

Computation: the (token, choice) pairs are sorted by expert once, each expert's rows are contiguous, and ONE grouped
matmul per projection runs every local expert (``torch.nn.functional.grouped_mm`` where this torch build and device have it for
the dtype; padded ``bmm`` on accelerators without it; on CPU one matmul per non-empty expert, which measured fastest
there — never a loop over all experts). The routing weight scales each row before ``linear_fc2``; outputs return
to (token, choice) order and are summed over the k choices without atomics (deterministic).

Load balancing (training): each MoE layer computes Megatron's switch loss ``E * sum_e f_e * P_e`` (f_e: fraction of
the top-k assignments that went to expert e, before dropping; P_e: mean router probability of e) and, when
``moe_aux_loss_coeff > 0``, attaches ``coeff * loss`` to its output with an autograd function whose backward feeds the
loss's gradient in (Megatron's ``MoEAuxLossAutoScaler``). So the gradient reaches every layer wherever the LM loss is
computed (a pipeline stage included) and the returned LM loss stays the LM loss. Under context parallelism the
assignment counts are completed over the CP ranks first (``_sequence_counts``). The values are kept per layer for
reporting (``router_metrics``); ``hf_load_balancing_loss`` gives transformers' (differently aggregated) figure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial

from engine.contract.model_config import ModelConfig
from engine.model.expert_loop import loop_expert_mlp
from engine.model.gathered_matmul import gathered_grouped_matmul
from engine.model.lean_ops import recompute_activation, softmax_fp32, swiglu
from engine.model.token_permute import combine_rows, dispatch_rows
from engine.torch_compat import in_backward


def local_weight(w: torch.Tensor) -> torch.Tensor:
    """An expert weight as the plain tensor the grouped matmuls take. Under tensor parallelism (applied from outside,
    ``engine.parallel.tensor_parallel.ExpertTensorParallel``) or expert parallelism (``engine.parallel.
    expert_parallel``: a ``Shard(0)`` over ``ep``, the local rows being this rank's experts) the experts' parameters
    are DTensors and the layer runs on their local pieces. One replicated over TP (LoRA's fc1 A and fc2 B; under EP
    × TP ``Shard(0)`` on ep and replicated on tp) meets each TP rank's own slice of the experts' activations, so each
    rank's gradient is a partial sum over those dimensions: declared ``Partial`` there, DTensor all-reduces it
    before it reaches the parameter."""
    if not isinstance(w, DTensor):
        return w
    if not any(p.is_replicate() for p in w.placements):
        return w.to_local()
    mine = DTensor.from_local(w.to_local(), w.device_mesh, w.placements, run_check=False)
    return mine.to_local(grad_placements=[Partial() if p.is_replicate() else p for p in w.placements])


class StackedWeight(nn.Module):
    """One (num_experts, out, in) parameter: the per-expert ``nn.Linear`` weights stacked on dim 0."""

    def __init__(self, num: int, out_features: int, in_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num, out_features, in_features))

    def project(self, x: torch.Tensor, counts: torch.Tensor, backend: str) -> torch.Tensor:
        """Expert-sorted rows (M, in) -> (M, out), row r through its expert's matrix (``expert_matmul``)."""
        return expert_matmul(x, local_weight(self.weight), counts, backend)


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts or 0, cfg.hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)  # (N, E) logits in the activation dtype, as transformers


@functools.cache
def _grouped_mm_works(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch.nn.functional.grouped_mm`` runs here (it is missing or dtype-limited on some builds and devices); probed
    once per (device type, dtype) on the three products forward and backward use, without autograd (so a probe
    inside an activation-checkpointed forward saves nothing)."""
    if not hasattr(F, "grouped_mm"):
        return False
    try:
        with torch.no_grad():
            x = torch.ones(4, 16, device=device_type, dtype=dtype)
            w = torch.ones(2, 16, 16, device=device_type, dtype=dtype)
            offs = torch.tensor([1, 4], device=device_type, dtype=torch.int32)
            y = F.grouped_mm(x, w.transpose(-2, -1), offs=offs)  # forward: rows @ w_e^T
            dx = F.grouped_mm(y, w, offs=offs)  # grad of the rows
            dw = F.grouped_mm(y.t(), x, offs=offs)  # grad of the stacked weights (E, out, in)
            return bool(torch.isfinite(dx).all() and torch.isfinite(dw).all())
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def grouped_backend(x: torch.Tensor, *dims: int) -> str:
    """The expert-matmul backend for rows like ``x`` (``dims``: the matmul widths).

    Accelerators: "grouped_mm" where this torch build runs ``torch.nn.functional.grouped_mm`` for the dtype (rows 16-byte
    aligned: one kernel, no host sync), else "padded" (one ``bmm`` pair over experts padded to the busiest one, or
    the loop when padding would more than double the rows). CPU: "loop" over the non-empty experts — CPU's
    grouped_mm loops internally too, and the plain loop measured fastest there (bench/moe_step.py:
    loop 5918, grouped_mm 3949, padded bmm 3308 tokens/s for 4096 tokens, 64 experts, top-8, one thread).
    """
    if x.device.type == "cpu":
        return "loop"
    return "grouped_mm" if _grouped_mm_fits(x, *dims) else "padded"


def _grouped_mm_fits(x: torch.Tensor, *dims: int) -> bool:
    aligned = all(d * x.element_size() % 16 == 0 for d in dims)
    return aligned and _grouped_mm_works(x.device.type, x.dtype)


def expert_matmul(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, backend: str) -> torch.Tensor:
    """Rows of ``x`` (M, in) sorted by expert, ``counts[e]`` rows for expert e: row @ weight[e].T -> (M, out).

    ``grouped_mm``: one kernel over all experts (offsets stay on the device, no host sync). ``loop``: one matmul per
    non-empty expert (a host sync for the counts).
    """
    weight = local_weight(weight)
    if backend == "grouped_mm":
        offs = counts.cumsum(0).to(torch.int32)
        return F.grouped_mm(x, weight.transpose(-2, -1), offs=offs)
    if backend != "loop":
        raise ValueError(f"expert matmul backend: unknown {backend!r} (grouped_mm, loop)")
    sizes = counts.tolist()
    # unbind once: indexing weight[e] per expert would give each its own weight-sized zero gradient in backward
    parts = [chunk @ w.t() for chunk, w, n in zip(torch.split(x, sizes), weight.unbind(0), sizes, strict=True) if n]
    return torch.cat(parts) if parts else x.new_zeros(0, weight.shape[1])


def padded_mlp(
    x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, counts: torch.Tensor, row_weight: torch.Tensor
) -> torch.Tensor:
    """The whole expert MLP as two ``bmm`` over (E, busiest count, ·) blocks: rows are scattered into their
    expert's block once and gathered back once; padding rows are zero and stay zero (silu(0) * 0 = 0)."""
    e = counts.shape[0]
    cap = int(counts.max()) if e else 0  # host sync
    start = (counts.cumsum(0) - counts).repeat_interleave(counts, output_size=x.shape[0])
    slot = torch.arange(x.shape[0], device=x.device) - start
    slot += torch.repeat_interleave(torch.arange(e, device=x.device), counts, output_size=x.shape[0]) * cap
    blocks = x.new_zeros(e * cap, x.shape[1]).index_copy(0, slot, x).view(e, cap, -1)
    w = row_weight.new_zeros(e * cap, 1).index_copy(0, slot, row_weight).view(e, cap, 1)
    act = swiglu(torch.bmm(blocks, w1.transpose(-2, -1)), w)
    return torch.bmm(act, w2.transpose(-2, -1)).flatten(0, 1).index_select(0, slot)


def _plain(*tensors: torch.Tensor) -> bool:
    """Whether these are ordinary local tensors (not DTensors or other subclasses, whose ops the fused loop's
    ``out=`` slices would bypass)."""
    return all(type(t) in (torch.Tensor, nn.Parameter) for t in tensors)


class GroupedExperts(nn.Module):
    """SwiGLU experts over expert-sorted rows: fc2_e(silu(gate_e) * up_e) with ``linear_fc1`` = [gate; up]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e, h, f = cfg.num_experts or 0, cfg.hidden_size, cfg.expert_ffn_hidden_size
        self.linear_fc1 = StackedWeight(e, 2 * f, h)
        self.linear_fc2 = StackedWeight(e, h, f)
        self.backend: str | None = None  # grouped_mm | padded | bmm | loop; None: ``grouped_backend`` decides
        self.free_activation = True  # as the dense MLP (``engine.model.qwen3.MLP``)
        self.gathers_rows = True  # False: the caller passes gathered rows (expert parallelism's hooks move them)
        # CP ranks whose gradients of these experts ``engine.parallel.expert_parallel.reduce_over_context`` sums
        self.context_group: dist.ProcessGroup | None = None

    def forward(
        self,
        x: torch.Tensor,
        counts: torch.Tensor,
        row_weight: torch.Tensor,
        *,
        gather: tuple[torch.Tensor, int] | None = None,
    ) -> torch.Tensor:
        """x (M, H) expert-sorted rows, counts (E,), row_weight (M, 1): the routing weight of each row, applied
        before ``linear_fc2`` (the same as after it: the projection is linear; half the elements to scale).

        ``gather=(order, k)``: x is the (N, H) tokens and row r is token ``order[r] // k``. The unadapted
        grouped-matmul and loop paths then gather inside fc1's autograd function, which keeps x and order for
        backward instead of the k-times-larger gathered rows (``engine.model.gathered_matmul``)."""
        w1, w2 = local_weight(self.linear_fc1.weight), local_weight(self.linear_fc2.weight)
        dims = [w1.shape[-1], w1.shape[-2], w2.shape[-1]]
        adapted = hasattr(self.linear_fc1, "lora_A") or hasattr(self.linear_fc2, "lora_A")
        if adapted:  # LoRA (engine.model.lora.LoRAStacked): the adapters' widths are matmul widths too
            dims.append(getattr(self.linear_fc1, "r", None) or self.linear_fc2.r)  # type: ignore[arg-type]
        backend = self.backend or grouped_backend(x, *dims)
        if backend == "padded":
            fits = int(counts.max()) * counts.shape[0] <= 2 * max(row_weight.shape[0], 1) and not adapted
            backend = "bmm" if fits else "grouped_mm" if _grouped_mm_fits(x, *dims) else "loop"
        if backend == "loop" and not adapted and _plain(w1, w2):
            return loop_expert_mlp(x, w1, w2, counts, row_weight, *(gather or (None, 1)))
        if backend == "grouped_mm" and not adapted and gather is not None:
            h = gathered_grouped_matmul(x, *gather, w1, counts)
        else:
            rows = x if gather is None else dispatch_rows(x, *gather)
            if backend == "bmm":
                return padded_mlp(rows, w1, w2, counts, row_weight)
            h = self.linear_fc1.project(rows, counts, backend)
        act = swiglu(h, row_weight)
        out = self.linear_fc2.project(act, counts, backend)
        if self.free_activation:
            recompute_activation(h, act, out, row_weight)
        return out


class AuxLossScaler(torch.autograd.Function):
    """Identity on ``out``; in backward, the gradient of ``aux`` is 1 (Megatron's MoEAuxLossAutoScaler), so
    ``aux`` (already multiplied by its coefficient and scale) joins the loss without being added to it."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (aux,) = ctx.saved_tensors
        return grad, torch.ones_like(aux)


def switch_balance_loss(
    probs_sum: torch.Tensor, tokens_per_expert: torch.Tensor, num_tokens: int | torch.Tensor, topk: int
) -> torch.Tensor:
    """Megatron's ``switch_load_balancing_loss_func`` without the coefficient: E / (k T^2) * sum_e(sum_t p_te * n_e)
    = E * sum_e f_e P_e; 1.0 for a perfectly balanced router."""
    e = probs_sum.shape[-1]
    return (probs_sum * tokens_per_expert).sum(-1) * (e / (topk * num_tokens * num_tokens))


def hf_load_balancing_loss(probs_sums: torch.Tensor, tokens_per_expert: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """transformers' ``load_balancing_loss_func`` (no attention mask) from per-layer sums (L, E) of one forward:
    the layers' rows are pooled before the product, and f counts every top-k choice (k at perfect balance)."""
    rows = probs_sums.shape[0] * num_tokens
    e = probs_sums.shape[-1]
    return (tokens_per_expert.sum(0) / rows * (probs_sums.sum(0) / rows)).sum() * e


def expert_capacity(num_tokens: int, num_experts: int, topk: int, capacity_factor: float) -> int:
    """Megatron ``get_capacity(num_tokens * topk, num_experts, capacity_factor)``."""
    return math.ceil(num_tokens * topk / num_experts * capacity_factor)


def capacity_keep(expert: torch.Tensor, weight: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """(N*k,) bool: Megatron's "probs" drop policy — each expert keeps its ``capacity`` highest-probability
    assignments (``topk`` over the (tokens, experts) prob matrix along tokens); nothing drops when capacity >= N."""
    by_prob = torch.argsort(weight, descending=True, stable=True)
    order = by_prob[torch.argsort(expert[by_prob], stable=True)]  # by expert, then by descending prob
    counts = torch.bincount(expert, minlength=num_experts)
    start = (counts.cumsum(0) - counts).repeat_interleave(counts)
    rank = torch.arange(expert.numel(), device=expert.device) - start
    keep = torch.empty_like(expert, dtype=torch.bool)
    keep[order] = rank < capacity
    return keep


@dataclasses.dataclass
class RouterStats:
    """Per-layer router figures summed over the forwards since the last ``router_metrics(reset=True)``."""

    tokens_per_expert: torch.Tensor  # (E,) top-k assignments before dropping
    balance_loss_sum: torch.Tensor  # sum of the per-forward switch loss (no coefficient)
    dropped: torch.Tensor  # assignments dropped by the expert capacity
    forwards: int = 0
    last_probs_sum: torch.Tensor | None = None  # (E,) of the latest forward, for ``hf_load_balancing_loss``
    last_tokens: torch.Tensor | None = None
    last_num_tokens: int = 0


class MoELayer(nn.Module):
    """Routed SwiGLU experts replacing the dense MLP of a decoder layer: (B, T, H) -> (B, T, H)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_experts = cfg.num_experts or 0
        self.topk = cfg.moe_router_topk
        self.norm_topk_prob = cfg.norm_topk_prob
        self.aux_loss_coeff = cfg.moe_aux_loss_coeff
        self.capacity_factor = cfg.moe_expert_capacity_factor
        self.router = Router(cfg)
        self.experts = GroupedExperts(cfg)
        # Backward weight of the aux loss per routed token (set by the trainer to its LM-loss scale / token count);
        # None: weight 1, i.e. the plain sum ``lm_loss + coeff * sum_layers aux``.
        self.aux_loss_token_scale: torch.Tensor | float | None = None
        self.stats: RouterStats | None = None
        # context parallelism (``engine.parallel.context_parallel``): the ranks holding the rest of these sequences
        self.context_group: dist.ProcessGroup | None = None
        self.record_stats = True  # False: forwards are not counted (``paused_router_stats``)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (N, H) -> (probs (N, E), top-k weights (N, k), top-k expert ids (N, k)); probabilities in fp32."""
        probs = softmax_fp32(self.router(x))  # saves the bf16 logits, not the fp32 probabilities
        top_w, top_i = torch.topk(probs, self.topk, dim=-1)
        if self.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        return probs, top_w, top_i

    def forward(
        self, hidden: torch.Tensor, counted: torch.Tensor | None = None, counted_tokens: int = 0
    ) -> torch.Tensor:
        """hidden (B, T, H) -> (B, T, H). ``counted`` (T,) or (B, T) bool with ``counted_tokens`` of the batch:
        the tokens the load-balancing loss and the router figures count (context parallelism's own padding is routed
        but not counted); None: every token."""
        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])  # (N, H)
        n, k = x.shape[0], self.topk
        probs, top_w, top_i = self.route(x)
        expert, weight = top_i.reshape(-1), top_w.reshape(-1).to(x.dtype)  # (N*k,) in (token, choice) order
        tokens_per_expert = torch.bincount(expert, minlength=self.num_experts)
        keep = None
        if self.capacity_factor is not None:
            cap = expert_capacity(n, self.num_experts, k, self.capacity_factor)
            if cap < n:
                keep = capacity_keep(expert, top_w.detach().reshape(-1), self.num_experts, cap)
                expert = torch.where(keep, expert, self.num_experts)  # dropped pairs sort after every expert
        order = torch.argsort(expert, stable=True)
        counts = tokens_per_expert if keep is None else torch.bincount(expert, minlength=self.num_experts + 1)[:-1]
        if keep is not None:
            order = order[: int(counts.sum())]  # host sync only in the (non-default) token-dropping mode
        row_weight = weight.index_select(0, order)[:, None]
        if self.experts.gathers_rows:
            y = self.experts(x, counts, row_weight, gather=(order, k))  # (M, H), expert-sorted
        else:  # expert parallelism exchanges the rows themselves (``engine.parallel.expert_parallel``)
            y = self.experts(dispatch_rows(x, order, k), counts, row_weight)
        out = combine_rows(y, order, n, k).view(shape)  # back to tokens, summed over the k choices; dropped = 0
        tokens, probs_sum, n_counted = tokens_per_expert, probs.sum(0), n
        if counted is not None:
            m = counted.expand(shape[0], -1).reshape(-1).to(probs.dtype)  # (N,)
            tokens = torch.bincount(top_i.reshape(-1), m.repeat_interleave(k), minlength=self.num_experts)
            probs_sum, n_counted = (probs * m[:, None]).sum(0), counted_tokens
        routed, n_routed = self._sequence_counts(tokens, n_counted)
        balance = switch_balance_loss(probs_sum, routed.to(probs.dtype), n_routed, k)
        self._record(probs, tokens, balance, keep, n)
        if self.aux_loss_coeff > 0 and self.training and torch.is_grad_enabled():
            scale = 1.0 if self.aux_loss_token_scale is None else self.aux_loss_token_scale * n_routed
            out = AuxLossScaler.apply(out, balance * (self.aux_loss_coeff * scale))
        return out

    @torch.no_grad()
    def _sequence_counts(self, tokens_per_expert: torch.Tensor, n: int) -> tuple[torch.Tensor, int | torch.Tensor]:
        """The whole sequences' assignments per expert and counted tokens. Under context parallelism this rank
        holds part of each sequence: both are summed over the CP ranks (one all-reduce), so each rank's switch loss is
        its own probabilities against the sequences' counts, and the CP ranks' losses (and gradients, summed with the
        rest over DP × CP) add up to the one-process loss — Megatron's ``switch_load_balancing_loss_func`` with the
        TP × CP ``sequence_partition_group``."""
        if self.context_group is None:
            return tokens_per_expert, n
        whole = torch.cat([tokens_per_expert.to(torch.float64), torch.tensor([n], dtype=torch.float64)])
        dist.all_reduce(whole, group=self.context_group)
        return whole[:-1], whole[-1].float()

    @torch.no_grad()
    def _record(
        self, probs: torch.Tensor, tokens: torch.Tensor, balance: torch.Tensor, keep: torch.Tensor | None, n: int
    ) -> None:
        if in_backward() or not self.record_stats:
            return  # activation-checkpoint recompute inside backward: this forward was counted already
        if self.stats is None:
            z = torch.zeros((), device=probs.device)
            self.stats = RouterStats(torch.zeros(self.num_experts, device=probs.device), z.clone(), z.clone())
        s = self.stats
        s.tokens_per_expert += tokens
        s.balance_loss_sum += balance.detach()
        if keep is not None:
            s.dropped += (~keep).sum()
        s.forwards += 1
        s.last_probs_sum, s.last_tokens, s.last_num_tokens = probs.sum(0), tokens.float(), n


def moe_layers(model: nn.Module) -> dict[int, MoELayer]:
    """The MoE layers this model (or pipeline stage) holds, by global layer index (0 for a lone MoELayer)."""
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, MoELayer):
            parts = name.split(".")
            found[int(parts[parts.index("layers") + 1]) if "layers" in parts else 0] = module
    return dict(sorted(found.items()))


@contextlib.contextmanager
def paused_router_stats(model: nn.Module) -> Iterator[None]:
    """Forwards inside are not counted in the router figures (a pipeline stage's shape-inference forward)."""
    layers = list(moe_layers(model).values())
    for layer in layers:
        layer.record_stats = False
    try:
        yield
    finally:
        for layer in layers:
            layer.record_stats = True


def set_aux_loss_token_scale(model: nn.Module, scale: torch.Tensor | float | None) -> None:
    """Weight of the aux-loss gradient per routed token, matching how the trainer scales the LM loss: with the LM
    loss summed over tokens and divided by the global labelled-token count D (times a loss scale s), pass s / D — each
    micro-batch's aux loss then counts in proportion to its tokens (Megatron with ``calculate_per_token_loss``)."""
    for layer in moe_layers(model).values():
        layer.aux_loss_token_scale = scale


@dataclasses.dataclass
class RouterMetrics:
    """Per MoE layer (rows in ``layers`` order), summed over the forwards since the last reset."""

    layers: list[int]
    tokens_per_expert: torch.Tensor  # (L, E)
    balance_loss_sum: torch.Tensor  # (L,)
    dropped: torch.Tensor  # (L,)
    forwards: int

    def summary(self) -> dict[str, float | list[float]]:
        """``load_balancing_loss`` (Megatron's logged value: the switch loss without coefficient, mean over layers
        and forwards) and per-layer expert load imbalance max/mean tokens per expert (1.0 = perfectly even)."""
        if not self.layers or not self.forwards:
            return {}
        tokens = self.tokens_per_expert.double()
        imbalance = tokens.max(-1).values / tokens.mean(-1).clamp(min=1e-12)
        return {
            "load_balancing_loss": float(self.balance_loss_sum.sum() / (len(self.layers) * self.forwards)),
            "expert_load_imbalance": [float(v) for v in imbalance],
            "expert_load_imbalance_max": float(imbalance.max()),
            "dropped_token_fraction": float(self.dropped.sum() / tokens.sum().clamp(min=1)),
        }


def router_metrics(model: nn.Module, reset: bool = True) -> RouterMetrics | None:
    """This rank's router figures (None for a dense model). Sum ``tokens_per_expert``/``dropped`` and
    ``balance_loss_sum`` over DP ranks (and concatenate over pipeline stages) before ``summary`` for global ones."""
    layers = {i: m for i, m in moe_layers(model).items() if m.stats is not None}
    if not layers:
        return None
    stats = [m.stats for m in layers.values()]
    metrics = RouterMetrics(
        layers=list(layers),
        tokens_per_expert=torch.stack([s.tokens_per_expert for s in stats]),  # type: ignore[union-attr]
        balance_loss_sum=torch.stack([s.balance_loss_sum for s in stats]),  # type: ignore[union-attr]
        dropped=torch.stack([s.dropped for s in stats]).float(),  # type: ignore[union-attr]
        forwards=stats[0].forwards,  # type: ignore[union-attr]
    )
    if reset:
        for m in layers.values():
            m.stats = None
    return metrics


def last_forward_hf_aux_loss(model: nn.Module) -> torch.Tensor:
    """transformers' ``aux_loss`` (``output_router_logits=True``, no attention mask) of the latest forward."""
    stats = [m.stats for m in moe_layers(model).values() if m.stats is not None and m.stats.last_probs_sum is not None]
    if not stats:
        raise RuntimeError("no MoE layer has run a forward since the last reset")
    return hf_load_balancing_loss(
        torch.stack([s.last_probs_sum for s in stats]),  # type: ignore[misc]
        torch.stack([s.last_tokens for s in stats]),  # type: ignore[misc]
        stats[0].last_num_tokens,
    )
