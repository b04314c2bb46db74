"""Micro-batches: padding-free packing vs padding (same loss and gradients), label shift, data order per DP rank,
activation checkpointing leaves the loss and gradients unchanged."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[2]))
from engine.contract.constants import IGNORE_INDEX  # noqa: E402
from engine.contract.model_config import preset  # noqa: E402
from engine.model.qwen3 import Qwen3Model  # noqa: E402
from engine.parallel.activation_checkpoint import apply_ac  # noqa: E402
from engine.train.batches import Sample, collate, pack, pad  # noqa: E402
from engine.train.data import TrainData, rank_micro_batches  # noqa: E402
from engine.train.step_runner import micro_batch_loss  # noqa: E402
from train_support import write_instruction_data  # noqa: E402


def _samples(seed: int = 0, n: int = 3) -> list[Sample]:
    rng = np.random.default_rng(seed)
    out = []
    for length in rng.integers(5, 20, n):
        ids = rng.integers(1, 500, length)
        labels = ids.copy()
        labels[: length // 2] = IGNORE_INDEX
        out.append(Sample(ids, labels))
    return out


def test_pack_restarts_positions_and_shifts_labels_per_sample():
    a = Sample(np.array([10, 11, 12, 13]), np.array([-100, -100, 12, 13]))
    b = Sample(np.array([20, 21, 22]), np.array([-100, 21, 22]))
    mb = pack([a, b], seq_length=64)
    assert mb.input_ids.tolist() == [[10, 11, 12, 20, 21]]
    assert mb.labels.tolist() == [[-100, 12, 13, 21, 22]]  # never a's last token predicting b's first
    assert mb.position_ids.tolist() == [[0, 1, 2, 0, 1]]
    assert mb.segment_ids.tolist() == [[0, 0, 0, 1, 1]]
    assert mb.loss_index.tolist() == [1, 2, 3, 4] and mb.loss_labels.tolist() == [12, 13, 21, 22]
    assert mb.num_tokens == 5 and mb.num_loss_tokens == 4


def test_truncation_and_padding_shapes():
    s = _samples(n=2)
    assert pad(s, seq_length=8, to_longest=False).input_ids.shape == (2, 7)
    longest = max(min(len(x.input_ids), 8) for x in s) - 1
    assert pad(s, seq_length=8, to_longest=True).input_ids.shape == (2, longest)
    assert pack(s, seq_length=8).seq_lens == [7, 7]


@pytest.mark.parametrize("to_longest", [True, False])
def test_packed_and_padded_give_same_loss_and_grads(to_longest: bool):
    torch.manual_seed(0)
    model = Qwen3Model(preset("qwen3-tiny").replace(vocab_size=512))
    model.init_weights(0)
    samples = _samples(seed=1, n=4)

    def run(mb):
        model.zero_grad()
        loss = micro_batch_loss(model, mb, chunk_size=7)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    loss_packed, grads_packed = run(collate(samples, 32, padding_free=True, variable_seq_lengths=False))
    loss_padded, grads_padded = run(pad(samples, 32, to_longest))
    torch.testing.assert_close(loss_packed, loss_padded, rtol=1e-5, atol=1e-5)
    for gp, gq in zip(grads_packed, grads_padded):
        torch.testing.assert_close(gp, gq, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("granularity,method", [("full", "uniform"), ("full", "block"), ("selective", None)])
def test_activation_checkpointing_keeps_loss_and_grads(granularity: str, method: str | None):
    torch.manual_seed(0)
    cfg = preset("qwen3-tiny").replace(vocab_size=512)
    plain, wrapped = Qwen3Model(cfg), Qwen3Model(cfg)
    plain.init_weights(0)
    wrapped.load_state_dict(plain.state_dict())
    assert apply_ac(wrapped, granularity, method, 1) == ([0] if method == "block" else [0, 1])
    assert set(wrapped.state_dict()) == set(plain.state_dict())  # checkpoint keys unchanged
    mb = pack(_samples(seed=2), 32)
    losses = []
    for m in (plain, wrapped):
        loss = micro_batch_loss(m, mb, chunk_size=16)
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1])
    grads = dict(plain.named_parameters())
    for name, p in wrapped.named_parameters():
        torch.testing.assert_close(p.grad, grads[name.replace("._checkpoint_wrapped_module", "")].grad)


def test_global_batch_is_the_same_for_any_dp_size(tmp_path: Path):
    data = TrainData.open([write_instruction_data(tmp_path / "d", n=20)], "100,0,0", seed=3, seq_length=64)
    lengths = lambda groups: sorted(len(s.input_ids) for g in groups for s in g)  # noqa: E731
    for iteration in (1, 3):  # iteration 3 crosses into the second epoch (20 samples, 8 per iteration)
        one = rank_micro_batches(data, iteration, 8, 2, dp=1, dp_rank=0)
        two = [g for r in (0, 1) for g in rank_micro_batches(data, iteration, 8, 2, dp=2, dp_rank=r)]
        assert len(one) == 4 and len(two) == 4
        assert lengths(one) == lengths(two)
    again = TrainData.open([str(tmp_path / "d")], "100,0,0", seed=3, seq_length=64)  # a restarted job: same order
    first = rank_micro_batches(again, 2, 8, 2, dp=1, dp_rank=0)
    assert [len(s.input_ids) for g in first for s in g] == [
        len(s.input_ids) for g in rank_micro_batches(data, 2, 8, 2, dp=1, dp_rank=0) for s in g
    ]


def test_long_pretraining_documents_become_windows_that_train_every_target_once(tmp_path: Path):
    from engine.contract.indexed import IndexedDatasetWriter

    docs = [np.arange(1, 6), np.arange(100, 140), np.arange(200, 217), np.arange(300, 316)]  # 5, 40, 17, 16 tokens
    writer = IndexedDatasetWriter(tmp_path / "text_document")
    for doc in docs:
        writer.add_document(doc)
    writer.finalize()
    data = TrainData.open([str(tmp_path / "text_document")], "100,0,0", seed=1, seq_length=16)
    # windows of 16 tokens, 15 apart: 1 + ceil(39/15) + ceil(16/15) + 1
    assert data.num_samples == 1 + 3 + 2 + 1
    windows = [s.input_ids for k in range(data.num_samples) for s in data.sample_at(k)]
    assert all(len(w) <= 16 for w in windows)
    targets = sorted(int(t) for w in windows for t in w[1:])  # what the shifted labels ask the model to predict
    assert targets == sorted(int(t) for doc in docs for t in doc[1:])  # every next token exactly once
    whole = TrainData.open([str(tmp_path / "text_document")], "100,0,0", seed=1, seq_length=40)
    assert whole.num_samples == 4  # nothing longer than 40 tokens: one sample per document, as before
