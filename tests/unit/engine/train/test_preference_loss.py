"""Preference losses against TRL's trainers on the same model, pairs and reference: DPO (sigmoid, hinge, ipo, with
TRL's SFT term as pref_ftx) equal ``DPOTrainer``'s loss and policy gradients; per-sequence log-probs from the chunked
head equal full-logit log-softmax, gradients included."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from dpo_support import unhashed_maps
from engine.contract.constants import IGNORE_INDEX
from engine.contract.model_config import ModelConfig
from engine.model import hf_mapping
from engine.model.qwen3 import Qwen3Model
from engine.train.preference import PairLogps, PreferenceConfig, preference_loss, sequence_logprobs

PAIRS = {
    "prompt": ["hello there", "what is 2+2", "name a colour"],
    "chosen": [" hi friend, how are you", " 4", " blue"],
    "rejected": [" go away", " 5 or maybe 6", " a fish that swims"],
}


def test_sequence_logprobs_equal_full_logits_with_gradients() -> None:
    torch.manual_seed(0)
    hidden = torch.randn(3, 7, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    labels = torch.randint(0, 50, (3, 7))
    labels[0, :3] = IGNORE_INDEX
    labels[2, :] = IGNORE_INDEX  # a sequence with no labelled token sums to 0
    sums, counts = sequence_logprobs(hidden, weight, labels, chunk_size=4)
    logp = F.log_softmax(hidden @ weight.t(), -1).gather(2, labels.clamp(min=0)[..., None])[..., 0]
    ref = (logp * (labels != IGNORE_INDEX)).sum(1)
    assert torch.allclose(sums, ref, atol=1e-5) and counts.tolist() == [4, 7, 0]
    upstream = torch.tensor([0.3, -1.2, 2.0])
    ours = torch.autograd.grad((sums * upstream).sum(), (hidden, weight))
    theirs = torch.autograd.grad((ref * upstream).sum(), (hidden, weight))
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(ours, theirs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_gradient_added_into_grad_equals_autograd_with_a_tied_embedding(dtype: torch.dtype) -> None:
    """``into_grad``: the head's gradient goes straight into ``weight.grad`` (not through autograd's buffer, where
    a tied embedding's would keep it waiting); over two micro-batches the accumulated ``.grad`` is autograd's."""
    torch.manual_seed(0)
    weight = torch.randn(50, 16, dtype=dtype)
    ids = [torch.randint(0, 50, (2, 6)) for _ in range(2)]
    labels = [torch.randint(0, 50, (2, 6)) for _ in range(2)]

    def backward(into_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        w = weight.clone().requires_grad_(True)
        hooked: list[torch.Tensor] = []
        w.register_hook(hooked.append)  # what reaches w through autograd
        for i, y in zip(ids, labels, strict=True):
            hidden = torch.tanh(F.embedding(i, w).float() * 3).to(dtype)  # the tied embedding, used first
            sums, _ = sequence_logprobs(hidden, w, y, chunk_size=5, into_grad=into_grad)
            (sums * torch.tensor([0.7, -1.3])).sum().backward()
        assert w.grad is not None
        return w.grad, hooked[-1]

    ours, through_autograd = backward(True)
    theirs, _ = backward(False)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert torch.allclose(ours.float(), theirs.float(), atol=tol, rtol=tol)
    # only the embedding's part went through autograd: rows of tokens never looked up got nothing there
    unused = sorted(set(range(50)) - set(torch.cat(ids).flatten().tolist()))
    assert unused and through_autograd[unused].abs().sum() == 0 and ours[unused].abs().sum() > 0


@pytest.fixture(scope="module")
def models() -> tuple[Any, Any]:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    config = Qwen3Config(vocab_size=151936, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False, **shape)
    ref = Qwen3ForCausalLM(config)
    policy = copy.deepcopy(ref)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return policy, ref


@pytest.fixture(scope="module")
def tokenizer(qwen_tokenizer_dir: Path) -> Any:
    """Loaded once: DPOTrainer only sets its pad token to the one it has."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen_tokenizer_dir)


def _trl(policy: Any, ref: Any, tokenizer: Any, tmp_path: Path, **args: Any) -> tuple[Any, torch.Tensor, Any]:
    """TRL's batch, its loss (backward run) and its trainer."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    # bf16 off: TRL's default bf16 (on CPU too) runs its reference forward in bf16 (3.8e-3 off a summed log-prob)
    config = DPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=3, report_to=[], use_cpu=True, bf16=False, **args
    )
    with unhashed_maps():
        trainer = DPOTrainer(
            model=copy.deepcopy(policy),
            ref_model=copy.deepcopy(ref),
            args=config,
            train_dataset=Dataset.from_dict(PAIRS),
            processing_class=tokenizer,
        )
    batch = next(iter(trainer.get_train_dataloader()))
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    return batch, loss.detach(), trainer


def _ours(hf_model: Any) -> Qwen3Model:
    cfg = ModelConfig.from_hf(hf_model.config.to_dict())
    model = Qwen3Model(cfg).to(next(hf_model.parameters()).dtype)
    state = hf_model.state_dict()
    model.load_state_dict(dict(hf_mapping.native_from_hf(state.__getitem__, cfg)), strict=True)
    return model


def _pair_logps(model: Qwen3Model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    ids, completion = batch["input_ids"], batch["completion_mask"]
    labels = ids[:, 1:].masked_fill(completion[:, 1:] == 0, IGNORE_INDEX)
    hidden = model(ids, return_hidden=True)[:, :-1]
    return sequence_logprobs(hidden, model.output_weight(), labels, chunk_size=5)


def test_sequence_logprobs_of_the_model_equal_transformers_in_fp64(models: tuple[Any, Any]) -> None:
    policy = copy.deepcopy(models[0]).double()
    ids = torch.randint(0, 151936, (2, 12), generator=torch.Generator().manual_seed(0))
    completion = torch.ones_like(ids)
    completion[:, :5] = 0  # the prompt
    labels = ids[:, 1:].masked_fill(completion[:, 1:] == 0, IGNORE_INDEX)
    sums, _ = _pair_logps(_ours(policy), {"input_ids": ids, "completion_mask": completion})
    with torch.no_grad():
        logp = policy(ids).logits[:, :-1].log_softmax(-1).gather(2, ids[:, 1:, None])[..., 0]
    assert (sums - (logp * (labels != IGNORE_INDEX)).sum(1)).abs().max().item() < 1e-6


@pytest.mark.parametrize(
    ("loss_types", "weights", "cfg"),
    [
        (["sigmoid"], [1.0], PreferenceConfig("sigmoid", beta=0.1)),
        (["hinge"], [1.0], PreferenceConfig("hinge", beta=0.5)),
        (["ipo"], [1.0], PreferenceConfig("ipo", beta=0.1)),
        (["sigmoid", "sft"], [1.0, 0.7], PreferenceConfig("sigmoid", beta=0.1, pref_ftx=0.7)),
    ],
    ids=["sigmoid", "hinge", "ipo", "sigmoid+pref_ftx"],
)
def test_dpo_equals_trl(
    models: tuple[Any, Any],
    tokenizer: Any,
    tmp_path: Path,
    loss_types: list[str],
    weights: list[float],
    cfg: PreferenceConfig,
) -> None:
    policy, ref = models
    batch, trl_loss, trainer = _trl(
        policy, ref, tokenizer, tmp_path, beta=cfg.beta, loss_type=loss_types, loss_weights=weights
    )
    ours = _ours(policy)
    sums, counts = _pair_logps(ours, batch)
    with torch.no_grad():  # our reference forward, as the trainer computes it (TRL's equals it in fp32)
        ref_sums = _pair_logps(_ours(ref), batch)[0]
    n = sums.shape[0] // 2  # TRL's batch is [chosen..., rejected...]
    logps = PairLogps(sums[:n], sums[n:], counts[:n], counts[n:], ref_sums[:n], ref_sums[n:])
    loss = preference_loss(cfg, logps)[0].mean()
    assert loss.item() == pytest.approx(trl_loss.item(), rel=1e-5)
    loss.backward()
    trl_model = trainer.model
    theirs = trl_model.lm_head.weight.grad
    grad = ours.output_weight().grad
    assert grad is not None and ((grad - theirs).norm() / theirs.norm()).item() < 1e-4
    q_theirs = trl_model.model.layers[0].self_attn.q_proj.weight.grad
    assert q_theirs.abs().max() > 0 and ours.decoder.layers["0"].self_attention.linear_qkv.weight.grad.abs().max() > 0


def test_reference_free_losses_need_no_reference_and_dpo_does() -> None:
    logps = PairLogps(torch.tensor([-4.0]), torch.tensor([-9.0]), torch.tensor([4]), torch.tensor([3]))
    simpo, _ = preference_loss(PreferenceConfig("simpo", beta=2.0, simpo_gamma=0.5), logps)
    assert simpo.item() == pytest.approx(-F.logsigmoid(torch.tensor(2.0 * (-1.0 + 3.0) - 0.5)).item())
    orpo, _ = preference_loss(PreferenceConfig("orpo", beta=0.1), logps)
    c, r = torch.tensor(-1.0), torch.tensor(-3.0)
    odds = (c - r) - (torch.log1p(-c.exp()) - torch.log1p(-r.exp()))
    assert orpo.item() == pytest.approx((-c - 0.1 * F.logsigmoid(odds)).item())
    with pytest.raises(ValueError, match="reference model"):
        preference_loss(PreferenceConfig("sigmoid"), logps)
