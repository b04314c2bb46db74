"""Qwen3-MoE <-> MindSpeed-LLM's Megatron mcore layout: SequentialMLP and GroupedMLP experts, TP/PP/EP rank files.

The expected stored tensors are rebuilt here from the HF tensors with MindSpeed's own recipe
(``mindspeed_llm/tasks/checkpoint/convert_hf2mg.py::set_model_layer_mlp``, restated), independently of
``engine.checkpoint.layout``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from moe_support import hf_config

from engine.checkpoint.hf import HFCheckpoint, save_hf
from engine.checkpoint.megatron_read import MegatronCheckpoint
from engine.checkpoint.megatron_write import save_mcore
from engine.cli import main
from engine.contract.runfiles import EXIT_OK, BadInput

E, H, F = 8, 32, 16  # moe_support.hf_config: 8 experts, hidden 32, expert width 16; layer 1 is dense


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import Qwen3MoeForCausalLM

    path = tmp_path_factory.mktemp("moe") / "hf"
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(hf_config()).to(torch.bfloat16).save_pretrained(path)
    return path


def _names(ckpt: HFCheckpoint) -> list[str]:
    return ckpt.keys()  # a checkpoint object, not a dict


def _model(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path / "model_optim_rng.pt", weights_only=False)["model"]


def _mindspeed_experts(
    hf: HFCheckpoint, layer: int, tp: int, ep: int
) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
    """(tp rank, ep rank) -> MindSpeed's expert tensors of one layer, both layouts, by its recipe."""
    fc1s, fc2s = [], []
    for e in range(E):
        p = f"model.layers.{layer}.mlp.experts.{e}."
        gate, up = hf.get(p + "gate_proj.weight").chunk(tp), hf.get(p + "up_proj.weight").chunk(tp)
        fc1s.append(torch.cat([torch.cat(w) for w in zip(gate, up, strict=True)]).t())  # (H, 2F) per expert
        fc2s.append(hf.get(p + "down_proj.weight").t())  # (F, H)
    gemm1 = torch.cat(fc1s).view(H, -1).view(E, H, -1).chunk(ep)
    gemm2 = torch.cat(fc2s).view(-1, H).view(E, -1, H).chunk(ep)
    out: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    per = E // ep
    for e in range(ep):
        w1, w2 = gemm1[e].chunk(tp, dim=2), gemm2[e].chunk(tp, dim=1)
        for t in range(tp):
            tensors = {"weight1": w1[t].reshape(H, -1), "weight2": w2[t].reshape(-1, H)}
            for i in range(per):
                tensors[f"local_experts.{i}.linear_fc1.weight"] = fc1s[e * per + i].t().chunk(tp)[t]
                tensors[f"local_experts.{i}.linear_fc2.weight"] = fc2s[e * per + i].t().chunk(tp, dim=1)[t]
            out[(t, e)] = tensors
    return out


@pytest.mark.parametrize(
    ("tp", "pp", "ep", "grouped"),
    [(1, 1, 1, False), (1, 1, 1, True), (2, 1, 2, False), (2, 3, 4, True), (1, 3, 2, False), (2, 1, 8, True)],
)
def test_hf_mcore_hf_is_bit_exact_and_mindspeeds_layout(
    hf_dir: Path, tmp_path: Path, tp: int, pp: int, ep: int, grouped: bool
) -> None:
    src = HFCheckpoint(hf_dir)
    files = save_mcore(src, src.config, tmp_path / "mg", tp=tp, pp=pp, ep=ep, grouped=grouped)
    # Megatron's get_checkpoint_name: mp_rank_TT, _PPP when PP > 1, _EEE when EP > 1
    names = sorted(f.parent.name for f in files)
    assert len(names) == tp * pp * ep
    assert names[-1] == f"mp_rank_{tp - 1:02d}" + (f"_{pp - 1:03d}" if pp > 1 else "") + (
        f"_{ep - 1:03d}" if ep > 1 else ""
    )
    it = tmp_path / "mg" / "iter_0000001"

    def stage0(t: int, e: int) -> Path:
        return it / (f"mp_rank_{t:02d}" + ("_000" if pp > 1 else "") + (f"_{e:03d}" if ep > 1 else ""))

    expected = _mindspeed_experts(src, 0, tp, ep)
    for (t, e), tensors in expected.items():
        stored = _model(stage0(t, e))
        experts = {
            k.removeprefix("decoder.layers.0.mlp.experts."): v for k, v in stored.items() if ".0.mlp.experts." in k
        }
        assert set(experts) == {k for k in tensors if (k.startswith("weight")) == grouped}
        assert all(torch.equal(v, tensors[k]) for k, v in experts.items())
        assert torch.equal(stored["decoder.layers.0.mlp.router.weight"], src.get("model.layers.0.mlp.gate.weight"))
        assert "decoder.layers.1.mlp.linear_fc1.weight" in stored or pp > 1  # the dense layer keeps the dense MLP
        args = torch.load(stage0(t, e) / "model_optim_rng.pt", weights_only=False)["args"]
        assert (args.expert_model_parallel_size, args.num_experts, args.moe_grouped_gemm) == (ep, E, grouped)
        assert (args.moe_ffn_hidden_size, args.model_type_hf, args.moe_layer_freq) == (F, "qwen3-moe", [1, 0, 1])
    mc = MegatronCheckpoint(tmp_path / "mg")
    assert mc.config == src.config
    save_hf(mc, mc.config, tmp_path / "back")
    back = HFCheckpoint(tmp_path / "back")
    assert set(back.keys()) == set(src.keys())
    assert all(torch.equal(back.get(k), src.get(k)) for k in _names(src))


def test_mcore_relayout_between_expert_layouts(hf_dir: Path, tmp_path: Path) -> None:
    """grouped TP2 EP2 PP3 -> sequential TP1 EP4 -> grouped TP2 EP1: every HF tensor back bit for bit."""
    src = HFCheckpoint(hf_dir)
    save_mcore(src, src.config, tmp_path / "a", tp=2, pp=3, ep=2, grouped=True)
    a = MegatronCheckpoint(tmp_path / "a")
    save_mcore(a, a.config, tmp_path / "b", tp=1, ep=4)
    b = MegatronCheckpoint(tmp_path / "b")
    assert "decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight" in _model(
        tmp_path / "b" / "iter_0000001" / "mp_rank_00_003"
    )
    save_mcore(b, b.config, tmp_path / "c", tp=2, grouped=True)
    c = MegatronCheckpoint(tmp_path / "c")
    save_hf(c, c.config, tmp_path / "back")
    back = HFCheckpoint(tmp_path / "back")
    assert all(torch.equal(back.get(k), src.get(k)) for k in _names(src))


def test_bad_expert_parallel_sizes_are_refused(hf_dir: Path, tmp_path: Path) -> None:
    src = HFCheckpoint(hf_dir)
    with pytest.raises(BadInput, match="does not divide the model's 8 experts"):
        save_mcore(src, src.config, tmp_path / "mg", ep=3)
    save_mcore(src, src.config, tmp_path / "ok", ep=2)
    (tmp_path / "ok" / "iter_0000001" / "mp_rank_00_001" / "model_optim_rng.pt").unlink()
    with pytest.raises(BadInput, match="missing"):
        MegatronCheckpoint(tmp_path / "ok")


def test_convert_job_with_mindspeeds_moe_flags(hf_dir: Path, tmp_path: Path) -> None:
    """MindSpeed's ckpt_convert_qwen3_moe_hf2mcore.sh / _mcore2hf.sh flags, paths changed."""
    common = ["--use-mcore-models", "--model-type", "GPT", "--model-type-hf", "qwen3-moe", "--moe-grouped-gemm"]

    def run(name: str, *flags: str) -> dict:
        run_dir = tmp_path / "runs" / name
        assert main(["convert", *common, *flags, "--run-dir", str(run_dir)]) == EXIT_OK, (
            run_dir / "events.jsonl"
        ).read_text()
        return json.loads((run_dir / "result.json").read_text())

    result = run(
        "hf2mg",
        *("--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", str(hf_dir)),
        *("--save-dir", str(tmp_path / "mg"), "--target-tensor-parallel-size", "1"),
        *("--target-pipeline-parallel-size", "3", "--target-expert-parallel-size", "2"),
    )
    assert result["summary"]["expert_parallel"] == 2 and result["summary"]["files"] == 6
    assert (tmp_path / "mg" / "iter_0000001" / "mp_rank_00_002_001" / "model_optim_rng.pt").is_file()
    run(
        "mg2hf",
        *("--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", str(tmp_path / "mg")),
        *("--save-dir", str(tmp_path / "hf_out"), "--hf-cfg-dir", str(hf_dir)),
    )
    src, back = HFCheckpoint(hf_dir), HFCheckpoint(tmp_path / "hf_out")
    assert all(torch.equal(back.get(k), src.get(k)) for k in _names(src))


def test_expert_tp_pieces_follow_the_dense_rule(hf_dir: Path) -> None:
    """``layout.split_rule`` on stacked experts = the dense rule per expert (fc1 [gate_k; up_k], fc2 on its input
    dim), and an HF source reads those pieces directly."""
    from engine.checkpoint.layout import shard, split_rule

    src = HFCheckpoint(hf_dir)
    for suffix in ("mlp.experts.linear_fc1.weight", "mlp.experts.linear_fc2.weight"):
        key = "decoder.layers.2." + suffix
        full = src.get_native(key)
        dense = "mlp.linear_fc1.weight" if "fc1" in suffix else "mlp.linear_fc2.weight"
        assert split_rule(key) == split_rule("decoder.layers.1." + dense)
        for rank in range(2):
            piece = src.get_native_shard(key, 2, rank)
            per_expert = [shard(full[e], split_rule("decoder.layers.1." + dense), 2, rank) for e in range(E)]
            assert torch.equal(piece, torch.stack(per_expert))
