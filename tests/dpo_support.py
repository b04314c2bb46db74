"""TRL's side of the DPO exactness tests: its trainers run on a pair set, and its tokenized batch written in
MindSpeed's pairwise layout so our jobs train on exactly TRL's tokens."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import torch

from engine.contract.indexed import PAIRWISE_FIELDS, IndexedDatasetWriter, instruction_prefix


@contextlib.contextmanager
def unhashed_maps() -> Iterator[None]:
    """``datasets``' ``map`` names its result by hashing its function's arguments with dill, and TRL's tokenizing map
    passes the tokenizer: pickling Qwen3's vocabulary was 85 s of a DPOTrainer's 124 s start (load 20).
    Inside this block every map takes the random fingerprint ``datasets`` itself falls back to for an unhashable
    transform: a fingerprint only names cache files, which in-memory datasets do not write, so TRL computes the same."""
    from datasets import arrow_dataset, fingerprint

    def random(*_: Any) -> str:
        return fingerprint.generate_random_fingerprint()

    with (
        mock.patch.object(arrow_dataset, "update_fingerprint", random),
        mock.patch.object(fingerprint, "update_fingerprint", random),
    ):
        yield


def trl_run(
    model: Any,
    tokenizer_dir: Path,
    tmp_path: Path,
    pairs: dict[str, list[Any]],
    steps: int,
    lr: float,
    ref: Any = None,
    **args: Any,
) -> tuple[list[dict[str, float]], Any]:
    """TRL's log history over ``steps`` steps of the whole pair set (one batch of all of it, so no shuffle can
    differ), and its first batch (``ref``: the reference, default the model). SimPO is TRL's ``CPOTrainer`` with ``cpo_alpha`` 0 (its ``DPOTrainer`` has no
    reference-free loss)."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    simpo = args.get("loss_type") == "simpo"
    common = dict(
        output_dir=str(tmp_path / "trl"),
        per_device_train_batch_size=len(pairs["chosen"]),
        max_steps=steps,
        learning_rate=lr,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        bf16=False,  # TRL defaults to bf16 autocast, on CPU too
        **args,
    )
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    data = Dataset.from_dict(pairs)
    with unhashed_maps():
        trainer = _trainer(model, ref, tokenizer, data, common, simpo)
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h], batch


def _trainer(model: Any, ref: Any, tokenizer: Any, data: Any, common: dict[str, Any], simpo: bool) -> Any:
    """TRL's DPOTrainer (the reference ``ref``, default the model) or, for SimPO, its CPOTrainer."""
    from trl import DPOConfig, DPOTrainer
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    if simpo:
        trainer: Any = CPOTrainer(
            model=copy.deepcopy(model),
            args=CPOConfig(cpo_alpha=0.0, **common),
            train_dataset=data,
            processing_class=tokenizer,
        )
    else:
        trainer = DPOTrainer(
            model=copy.deepcopy(model),
            ref_model=copy.deepcopy(model if ref is None else ref),
            args=DPOConfig(**common),
            train_dataset=data,
            processing_class=tokenizer,
        )
    return trainer


def trl_rows(batch: dict[str, torch.Tensor]) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(side, ids, labels) of each answer of TRL's batch: DPOTrainer's padded [chosen; rejected] with a
    completion mask, or CPOTrainer's chosen_* / rejected_* with labels."""
    if "completion_mask" in batch:
        n = batch["input_ids"].shape[0] // 2
        out = []
        for row in range(2 * n):
            real = batch["attention_mask"][row].bool()
            ids = batch["input_ids"][row][real].numpy()
            labels = np.where(batch["completion_mask"][row][real].numpy() == 1, ids, -100)
            out.append(("chosen" if row < n else "rejected", ids, labels))
        return out
    return [
        (side, batch[f"{side}_input_ids"][row][real].numpy(), batch[f"{side}_labels"][row][real].numpy())
        for side in ("chosen", "rejected")
        for row in range(batch[f"{side}_input_ids"].shape[0])
        for real in [batch[f"{side}_attention_mask"][row].bool()]
    ]


def write_trl_pairs(batch: dict[str, torch.Tensor], prefix: Path) -> str:
    """TRL's tokenized pairs in MindSpeed's pairwise layout (prompt tokens masked from the labels)."""
    writers = {f: IndexedDatasetWriter(instruction_prefix(prefix, f)) for f in PAIRWISE_FIELDS}
    for side, ids, labels in trl_rows(batch):
        writers[f"{side}_input_ids"].add_document(ids)
        writers[f"{side}_labels"].add_document(labels)
    for w in writers.values():
        w.finalize()
    return str(prefix)


def trl_matched_spec(data: str, load: str, steps: int, lr: float, pairs: int, seq_length: int, **extra: Any) -> dict:
    """Our stage-dpo train spec doing what ``trl_run`` does: every pair in one step, constant lr, no weight decay,
    gradients clipped at 1.0, rows padded to the longest answer."""
    return {
        "kind": "train",
        "data_path": [data],
        "load": load,
        "split": "100,0,0",
        "stage": "dpo",
        "is_pairwise_dataset": True,
        "train_iters": steps,
        "lr": lr,
        "lr_decay_style": "constant",
        "weight_decay": 0.0,
        "clip_grad": 1.0,
        "seq_length": seq_length,
        "variable_seq_lengths": True,
        "micro_batch_size": pairs,
        "global_batch_size": pairs,
        "log_interval": 1,
        "eval_iters": 0,
        **extra,
    }
