"""Token-by-token forwards through a pipeline's stages (stage grpo's rollouts under PP): no schedule, one forward of
the whole batch at a time, each stage running its own layers on its own KV cache and handing its hidden states to the
next stage's rank with point-to-point ops; the last stage's hidden states stay there (it samples), and the sampled
tokens go back to every PP rank by broadcast, so the next forward starts on the first stage with them.

Stage s lives on PP rank s mod PP (the training split, ``pipeline_parallel.build_pipeline``: virtual stages
interleaved), so consecutive stages are always on different ranks and every rank walks the stages in one order.
A hidden state travels as this rank's local tensor, as the schedule's activations do; the receiver learns its dtype
once per boundary (a stage may compute in another dtype than its neighbour's parameters suggest, e.g. under FSDP's
mixed precision). Sequence parallelism (each TP rank a sequence shard) is not run so: the spec refuses it for grpo.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from engine.model.kv_cache import KVCache
from engine.parallel.pipeline_parallel import Pipeline

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class PipelineDecode:
    """This rank's stages of ``pipe`` run as one decoder: ``forward`` passes a batch through every stage (the last
    stage's rank gets the final-norm hidden states, the others None); ``from_last`` broadcasts the last stage's
    tensor (the sampled tokens) to every PP rank."""

    def __init__(self, pipe: Pipeline, hidden_size: int) -> None:
        self.parts, self.hidden_size = pipe.parts, hidden_size
        mesh = pipe.pp_mesh
        self.pp, self.rank, self.group = mesh.size(), mesh.get_local_rank(), mesh.get_group()
        self.stages = len(self.parts) * self.pp  # every rank holds as many chunks (the split's layout check)
        self.last_rank = dist.get_global_rank(self.group, (self.stages - 1) % self.pp)
        self.is_last = pipe.is_last
        # the global layer indices this rank holds: its KV cache's layers
        self.layers = sorted(int(i) for part in self.parts for i in part.decoder.layers)
        self._dtypes: dict[int, torch.dtype] = {}  # boundary (the receiving stage) -> the hidden states' dtype

    def forward(
        self, ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor, kv_cache: KVCache
    ) -> torch.Tensor | None:
        """(B, T) ids through every stage; the last stage's (B, T, H) final-norm hidden states, None elsewhere."""
        x: torch.Tensor = ids
        for stage in range(self.rank, self.stages, self.pp):
            if stage > 0:
                x = self._recv(stage, ids.shape, ids.device)
            out = self.parts[stage // self.pp](
                x, position_ids=position_ids, attention_mask=attention_mask, kv_cache=kv_cache, return_hidden=True
            )
            if stage == self.stages - 1:
                return out
            self._send(stage + 1, out.to_local() if isinstance(out, DTensor) else out)
        return None

    def from_last(self, tensor: torch.Tensor) -> torch.Tensor:
        """The last stage's ``tensor`` on every PP rank (the others pass one of its shape and dtype)."""
        dist.broadcast(tensor, src=self.last_rank, group=self.group)
        return tensor

    def _peer(self, stage: int) -> int:
        return dist.get_global_rank(self.group, stage % self.pp)

    def _send(self, stage: int, hidden: torch.Tensor) -> None:
        peer = self._peer(stage)
        if stage not in self._dtypes:
            self._dtypes[stage] = hidden.dtype
            code = torch.tensor([_DTYPES.index(hidden.dtype)], dtype=torch.long, device=hidden.device)
            dist.send(code, dst=peer, group=self.group)
        dist.send(hidden.contiguous(), dst=peer, group=self.group)

    def _recv(self, stage: int, shape: torch.Size, device: torch.device) -> torch.Tensor:
        peer = self._peer(stage - 1)
        if stage not in self._dtypes:
            code = torch.empty(1, dtype=torch.long, device=device)
            dist.recv(code, src=peer, group=self.group)
            self._dtypes[stage] = _DTYPES[int(code)]
        out = torch.empty((*shape, self.hidden_size), dtype=self._dtypes[stage], device=device)
        dist.recv(out, src=peer, group=self.group)
        return out
