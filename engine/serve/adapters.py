"""Several LoRA adapters over one base, chosen per sequence (vLLM's multi-LoRA serving, exact rather than merged).

A serve job's ``lora_adapters`` (``{name: checkpoint}``) are read with the shared loader (``engine.load.adapters``:
our training checkpoints or MindSpeed's, checked the same way as one ``lora_load``) and kept apart from the base:
each targeted ``nn.Linear`` becomes a ``MultiLoRALinear`` holding every adapter's (A, B, alpha/r). Adapter index 0
is the base itself (no delta), adapter ``i`` is the i-th name.

Before each forward the batcher sets ``AdapterRows``: one adapter index per token of the flat batch
(``engine.serve.slots.SlotView``), grouped into each present adapter's token indices once for all modules. A module then
adds, for each adapter present in the batch, ``scaling_i · B_i(A_i(x))`` to that adapter's rows only, computed as
``engine.model.lora.LoRALinear`` computes it (fp32 low-rank path, cast back): a sequence's tokens are those of the
single-adapter model, whoever shares its batch. The adapters stay fp32 as in training; ``lora_load`` (eval's
loader) casts them to the run's dtype, so in a bf16 deployment the two paths differ by that rounding. Grouping by adapter costs one small matmul pair per adapter present
per module, not a gathered (B, r, in) copy per row.

Not served per request: adapters that also override base tensors (MindSpeed's "independent" mode), HF PEFT
directories (separate q/k/v A matrices) and adapters on MoE experts; each is refused naming the adapter.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from engine.checkpoint.lora_merge import is_peft_adapter
from engine.contract.runfiles import BadInput
from engine.contract.spec import ServeSpec
from engine.load.adapters import Adapters, check_adapters, read_adapters


@dataclasses.dataclass
class AdapterRows:
    """The tokens of the next forward that each adapter present in the batch owns (empty: every one is the base)."""

    size: int = 0
    groups: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)  # adapter index -> its row indices

    def set(self, adapters: list[int], device: torch.device | str) -> None:
        """One adapter index per token of the flat batch; grouped once per forward rather than in every module."""
        self.size = len(adapters)
        rows: dict[int, list[int]] = {}
        for row, index in enumerate(adapters):
            if index:
                rows.setdefault(index, []).append(row)
        self.groups = {i: torch.tensor(r, device=device) for i, r in rows.items()}


class MultiLoRALinear(nn.Module):
    """A base ``nn.Linear`` plus per-adapter low-rank updates, applied to the rows ``selector`` assigns them."""

    def __init__(self, base: nn.Linear, selector: AdapterRows) -> None:
        super().__init__()
        self.weight, self.bias = base.weight, base.bias  # the base's own tensors: state-dict keys stay the same
        self.selector = selector
        self.deltas: dict[int, tuple[torch.Tensor, torch.Tensor, float]] = {}  # index -> (A, B, scaling)

    def add(self, index: int, a: torch.Tensor, b: torch.Tensor, scaling: float) -> None:
        self.deltas[index] = (a, b, scaling)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        groups = self.selector.groups
        if not groups:
            return out
        # rows: the tokens of the flat serving batch (every leading dim flattened)
        flat_x, flat_out = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])
        if self.selector.size != flat_x.shape[0]:
            raise RuntimeError(f"adapter rows: {self.selector.size} for {flat_x.shape[0]} tokens")
        for index, mine in groups.items():
            if index not in self.deltas:
                continue  # an adapter that leaves this module alone
            a, b, scaling = self.deltas[index]
            low = F.linear(F.linear(flat_x[mine].to(a.dtype), a), b) * scaling
            flat_out[mine] = flat_out[mine] + low.to(out.dtype)
        return out


def read_adapter(spec: ServeSpec, name: str, path: str) -> Adapters:
    """Adapter ``name`` of ``lora_adapters``, read and checked as ``lora_load`` is (its own recorded r and alpha),
    from a private copy made without following links (``engine.load.adapters.read_adapters``)."""
    field = f"lora_adapters.{name}"
    if is_peft_adapter(path):
        raise BadInput(f"{field}: an HF PEFT adapter is merged at load, so it cannot be chosen per request", field)
    one = spec.model_copy(update={"lora_load": path, "lora_r": None, "lora_alpha": None, "lora_target_modules": []})
    try:
        adapters = check_adapters(one, *read_adapters(one))
    except BadInput as err:
        raise BadInput(str(err).replace("lora_load", field, 1), field) from err
    if adapters.base:
        raise BadInput(
            f"{field}: the checkpoint also overrides base tensors ({sorted(adapters.base)[:3]}); only pure adapters "
            "share a base",
            field,
        )
    return adapters


def apply_adapters(
    model: nn.Module, named: dict[str, Adapters], device: torch.device | str = "cpu"
) -> tuple[AdapterRows, dict[str, int]]:
    """Wrap the modules the adapters target; returns the shared row selector and each name's adapter index."""
    selector, indices = AdapterRows(), {}
    for index, (name, adapters) in enumerate(named.items(), start=1):
        indices[name] = index
        add_adapter(model, selector, index, name, adapters, device)
    return selector, indices


def add_adapter(
    model: nn.Module, selector: AdapterRows, index: int, name: str, adapters: Adapters, device: torch.device | str
) -> None:
    """Adapter ``index`` (``name``'s) added to the modules it targets, wrapping those not wrapped yet; every module
    is checked before any is changed, so a misfit (BadInput naming ``lora_adapters.<name>``) leaves the model as it
    was (a load into a running deployment)."""
    field = f"lora_adapters.{name}"
    planned = []
    for module_path in sorted({k.rsplit(".lora_", 1)[0] for k in adapters.lora}):
        layer = _target(model, module_path, field)
        a = adapters.lora[f"{module_path}.lora_A.weight"].to(device=device, dtype=torch.float32)
        b = adapters.lora[f"{module_path}.lora_B.weight"].to(device=device, dtype=torch.float32)
        if a.shape != (adapters.r, layer.weight.shape[1]) or b.shape != (layer.weight.shape[0], adapters.r):
            raise BadInput(
                f"{field}: {module_path} adapters {tuple(a.shape)}, {tuple(b.shape)} do not fit its "
                f"weight {tuple(layer.weight.shape)}",
                field,
            )
        planned.append((module_path, a, b))
    for module_path, a, b in planned:
        _wrapped(model, module_path, selector).add(index, a, b, adapters.alpha / adapters.r)


def remove_adapter(model: nn.Module, index: int) -> None:
    """Adapter ``index`` dropped from every module (its modules stay wrapped: the base rows pass through)."""
    for module in model.modules():
        if isinstance(module, MultiLoRALinear):
            module.deltas.pop(index, None)


def _target(model: nn.Module, path: str, field: str) -> nn.Linear | MultiLoRALinear:
    try:
        module = model.get_submodule(path)
    except AttributeError as err:
        raise BadInput(f"{field}: the model has no module {path}", field) from err
    if type(module) is not nn.Linear and not isinstance(module, MultiLoRALinear):
        raise BadInput(f"{field}: {path} is not a plain linear layer (adapters on MoE experts are not served)", field)
    return module


def _wrapped(model: nn.Module, path: str, selector: AdapterRows) -> MultiLoRALinear:
    module = model.get_submodule(path)
    if isinstance(module, MultiLoRALinear):
        return module
    assert isinstance(module, nn.Linear)  # checked by _target
    wrapped = MultiLoRALinear(module, selector)
    parent_path, _, leaf = path.rpartition(".")
    setattr(model.get_submodule(parent_path) if parent_path else model, leaf, wrapped)
    return wrapped
