"""chunked_cross_entropy equals F.cross_entropy and never holds (N, V) logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model.loss import chunked_cross_entropy


def _inputs(n_rows: int = 50, hidden: int = 16, vocab: int = 700, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(2, n_rows // 2, hidden, generator=g, requires_grad=True)
    w = torch.randn(vocab, hidden, generator=g, requires_grad=True)
    y = torch.randint(0, vocab, (2, n_rows // 2), generator=g)
    y[0, :4] = -100
    y[1, -3:] = -100
    return h, w, y


@pytest.mark.parametrize("chunk_size", [3, 64])
def test_equals_cross_entropy_loss_and_grads(chunk_size: int) -> None:
    h, w, y = _inputs()
    loss, n = chunked_cross_entropy(h, w, y, chunk_size=chunk_size)
    gh, gw = torch.autograd.grad(loss / n, [h, w])
    ref = F.cross_entropy((h @ w.t()).flatten(0, 1), y.flatten(), ignore_index=-100)
    rh, rw = torch.autograd.grad(ref, [h, w])
    assert loss.dtype == torch.float32 and n.item() == 43
    torch.testing.assert_close(loss / n, ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(gh, rh, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(gw, rw, atol=1e-6, rtol=1e-5)
    assert torch.all(gh[0, :4] == 0)  # ignored rows get no gradient


def test_bf16_inputs_give_fp32_loss_close_to_fp32() -> None:
    h, w, y = _inputs(seed=1)
    loss16, _ = chunked_cross_entropy(h.bfloat16(), w.bfloat16(), y, chunk_size=16)
    loss32, _ = chunked_cross_entropy(h, w, y)
    assert loss16.dtype == torch.float32
    assert abs(loss16.item() - loss32.item()) / loss32.item() < 2e-2


def test_frozen_head_and_all_ignored() -> None:
    h, w, y = _inputs(seed=2)
    loss, _ = chunked_cross_entropy(h, w.detach(), y, chunk_size=8)
    (gh,) = torch.autograd.grad(loss, [h])
    ref = F.cross_entropy((h @ w.detach().t()).flatten(0, 1), y.flatten(), reduction="sum")
    torch.testing.assert_close(gh, torch.autograd.grad(ref, [h])[0], atol=1e-5, rtol=1e-5)
    loss, n = chunked_cross_entropy(h, w, torch.full_like(y, -100))
    loss.backward()
    assert loss.item() == 0.0 and n.item() == 0 and torch.all(h.grad == 0)


def _largest_saved_and_allocated(fn) -> tuple[int, int]:
    """Elements of the largest tensor autograd saves, and the most bytes a single op allocates."""
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel())
        return t

    with (
        torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof,
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
    ):
        fn()
    biggest_alloc = max(e.self_cpu_memory_usage for e in prof.events())
    return max(saved, default=0), biggest_alloc


def test_no_full_logits_in_forward_or_backward() -> None:
    n_rows, vocab = 256, 2048
    h, w, y = _inputs(n_rows=n_rows, vocab=vocab, hidden=16)
    full_bytes = n_rows * vocab * 4

    def chunked() -> None:
        loss, n = chunked_cross_entropy(h, w, y, chunk_size=16)
        (loss / n).backward()

    def naive() -> None:
        F.cross_entropy((h @ w.t()).flatten(0, 1), y.flatten()).backward()

    saved, alloc = _largest_saved_and_allocated(chunked)
    assert saved < n_rows * vocab and alloc < full_bytes / 4
    saved, alloc = _largest_saved_and_allocated(naive)  # the check itself sees the naive version's logits
    assert saved >= n_rows * vocab and alloc >= full_bytes
