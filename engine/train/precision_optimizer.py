"""AdamW with Megatron-Core's precision-aware state and optimizer CPU offload (``--use-precision-aware-optimizer``,
``--main-params-dtype``, ``--exp-avg-dtype``, ``--exp-avg-sq-dtype``, ``--optimizer-cpu-offload``,
``--optimizer-offload-fraction``).

Each parameter's state is held in the dtypes the spec names: ``exp_avg`` and ``exp_avg_sq`` always, and
``main_param`` (the master weights) where the parameter itself is not the master: when it is stored narrower than
``main_params_dtype`` (``main_grads_dtype`` bf16 stores the trainable weights, hence their gradients, in bf16) or when
its state lives on the host. The update is torch's AdamW (single-tensor order: decoupled decay, ``lerp`` for the first
moment, ``sqrt(v) / sqrt(bias2) + eps``) computed in fp32, in slices of at most ``SLICE_NUMEL`` elements so the
temporaries stay bounded, and stored back with ``copy_`` (round to nearest even); the weights the model computes with
are the master rounded to their own dtype.

Offload: the first parameters (model order) holding ``offload_fraction`` of the elements keep master and moments on
the host and are stepped there: each slice of the gradient is copied down, the fp32 arithmetic runs on the host, the
updated slice is copied back into the parameter. The arithmetic is the device path's, so on one device kind the two
are bit-identical. State tensors are DTensors wherever the parameter is one (DCP reshards them) and keep their dtype
through ``load_state_dict`` (torch's would cast every state tensor to the parameter's dtype and device). A replicated
parameter's gradient still ``Partial`` over TP (a norm weight under sequence parallelism) is reduced first: torch's
AdamW does that implicitly through DTensor dispatch, the local arithmetic here must ask for it.

The gradient norm with bf16 main grads (``main_grads_dtype`` bf16): ``engine.train.optim.total_grad_norm`` takes each
gradient's L2 norm accumulated and returned in fp32 (``torch._foreach_norm(..., dtype=float32)``), then combines the
per-tensor norms, the DP/TP shards (DTensor) and the pipeline stages in fp32. Megatron does the same:
``get_grad_norm_fp32`` runs ``multi_tensor_l2norm`` (fp32 accumulation and output) over the grads, bf16 ones included,
and all-reduces the fp32 sum of squares. Clipping then scales the bf16 gradients in place (rounded to bf16), as
Megatron's ``clip_grad_by_total_norm_fp32`` scales its grads before the optimizer reads them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SLICE_NUMEL = 16 * 2**20  # elements per slice of the fp32 arithmetic (at most six fp32 temporaries: 384 MiB)
HOST = torch.device("cpu")
STATE_KEYS = ("exp_avg", "exp_avg_sq", "main_param")


@dataclasses.dataclass(frozen=True)
class StateDtypes:
    """The optimizer's storage dtypes (Megatron's ``main_params_dtype``, ``exp_avg_dtype``, ``exp_avg_sq_dtype``)."""

    main_param: torch.dtype = torch.float32
    exp_avg: torch.dtype = torch.float32
    exp_avg_sq: torch.dtype = torch.float32

    @classmethod
    def from_names(cls, main_params: str, exp_avg: str, exp_avg_sq: str) -> StateDtypes:
        return cls(DTYPES[main_params], DTYPES[exp_avg], DTYPES[exp_avg_sq])


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as the state of ``param``: a DTensor with the parameter's mesh and placements when it is one, its
    local tensor left where it is. ``DTensor.from_local`` would move a host tensor to the mesh's device type, so on an
    accelerator the offloaded state of every sharded parameter landed back on the device (the device trace showed it);
    FSDP2's own CPU offload wraps its host shards the same way (``_from_local_no_grad``)."""
    if isinstance(param, DTensor):
        meta = TensorMeta(param.shape, param.stride(), local.dtype)
        return DTensor(local, DTensorSpec(param.device_mesh, param.placements, tensor_meta=meta), requires_grad=False)
    return local


def _placed_like(param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``grad`` in ``param``'s placements: a replicated weight's gradient may still be ``Partial`` (a norm under
    sequence parallelism: each TP rank holds its tokens' share), and its local piece is not the gradient until
    reduced. torch's AdamW reduces it implicitly (DTensor dispatch); this step works on local tensors, so here."""
    if isinstance(param, DTensor) and isinstance(grad, DTensor) and grad.placements != param.placements:
        return grad.redistribute(param.device_mesh, param.placements)
    return grad


def offloaded_params(params: list[torch.Tensor], fraction: float) -> set[int]:
    """ids of the leading parameters whose elements (this rank's shards) add up to at most ``fraction`` of all
    (Megatron's ``HybridDeviceOptimizer`` splits the same way, in parameter order)."""
    total = sum(_local(p).numel() for p in params)
    budget, used, out = fraction * total, 0, set()
    for p in params:
        n = _local(p).numel()
        if used + n > budget + 0.5:
            break
        out.add(id(p))
        used += n
    return out


class PrecisionAwareAdamW(torch.optim.Optimizer):
    """AdamW whose master weights and moments are stored in ``dtypes`` (and, for ``offload_fraction`` of the
    parameters, on the host); the module docstring says how."""

    def __init__(
        self,
        params: Iterable[Any],
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        dtypes: StateDtypes = StateDtypes(),
        offload_fraction: float = 0.0,
    ) -> None:
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.dtypes = dtypes
        self.offload_fraction = offload_fraction
        self._host = offloaded_params(self._params(), offload_fraction) if offload_fraction > 0 else set()

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def on_host(self, param: torch.Tensor) -> bool:
        return id(param) in self._host

    def _needs_master(self, param: torch.Tensor) -> bool:
        return self.on_host(param) or param.dtype != self.dtypes.main_param

    def _where(self, param: torch.Tensor, key: str) -> tuple[torch.dtype, torch.device]:
        dtype = getattr(self.dtypes, key)
        return dtype, HOST if self.on_host(param) else _local(param).device

    def _init_state(self, param: torch.Tensor) -> dict[str, Any]:
        state = self.state[param]
        local = _local(param)
        for key in ("exp_avg", "exp_avg_sq"):
            dtype, device = self._where(param, key)
            state[key] = _like(param, torch.zeros(local.shape, dtype=dtype, device=device))
        if self._needs_master(param):
            dtype, device = self._where(param, "main_param")
            state["main_param"] = _like(param, local.detach().to(device=device, dtype=dtype, copy=True))
        state["step"] = torch.tensor(0.0)
        return state

    # Any: closure and result as torch's overloaded Optimizer.step takes them (one signature cannot match both)
    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # noqa: ARG002 - torch's signature; no closure is taken
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param] if self.state.get(param) else self._init_state(param)
                state["step"] += 1
                self._update(param, state, group, int(state["step"].item()))
        return None

    def _update(self, param: torch.Tensor, state: dict[str, Any], group: dict[str, Any], step: int) -> None:
        lr, wd, eps = float(group["lr"]), float(group["weight_decay"]), float(group["eps"])
        beta1, beta2 = group["betas"]
        step_size = lr / (1 - beta1**step)
        bias2_sqrt = math.sqrt(1 - beta2**step)
        assert param.grad is not None  # step() skips parameters without one
        flat = {
            "param": _local(param).view(-1),
            "grad": _local(_placed_like(param, param.grad)).view(-1),
            **{k: _local(state[k]).view(-1) for k in STATE_KEYS if k in state},
        }
        master = flat.get("main_param", flat["param"])
        compute = master.device
        for start in range(0, master.numel(), SLICE_NUMEL):
            piece = slice(start, start + SLICE_NUMEL)
            g = flat["grad"][piece].to(device=compute, dtype=torch.float32)
            p = master[piece].float()
            m = flat["exp_avg"][piece].float()
            v = flat["exp_avg_sq"][piece].float()
            p.mul_(1 - lr * wd)
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            denom = (v.sqrt() / bias2_sqrt).add_(eps)
            p.addcdiv_(m, denom, value=-step_size)
            # copy_ rounds to nearest even where the storage is narrower (a no-op where p/m/v are the storage)
            flat["exp_avg"][piece].copy_(m)
            flat["exp_avg_sq"][piece].copy_(v)
            master[piece].copy_(p)
            if master is not flat["param"]:  # the weights are the stored master rounded (Megatron's copy back)
                flat["param"][piece].copy_(master[piece])
            del g, p, m, v, denom  # freed before the next slice allocates its own (the trace saw one slice more)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, then each state tensor put back in this optimizer's dtype and place from the saved value
        itself (torch's casts it to the parameter's dtype first: a bf16 parameter would round an fp32 master)."""
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        saved = [state_dict["state"].get(i, {}) for i in saved_ids]
        super().load_state_dict(state_dict)
        for param, entries in zip(self._params(), saved, strict=True):
            for key in STATE_KEYS:
                value = entries.get(key)
                if isinstance(value, torch.Tensor):
                    dtype, device = self._where(param, key)
                    local = _local(value).to(device=device, dtype=dtype, copy=True)
                    self.state[param][key] = _like(param, local)
