"""The seed's training scripts (seed 004: tune_qwen3_4B_4K_full / _lora) run with paths changed and a tiny model,
on 1 process (the CLI's main in the test's process) and 2 (torchrun): flags accepted (MindSpeed-only ones reported
as ignored), loss falls, and the save directory has the seed's layout (latest_checkpointed_iteration.txt +
iter_XXXXXXX/mp_rank_00/model_optim_rng.pt).

Changed from the seed besides paths: the model shape (2 layers, hidden 64, the real 151,936 vocabulary and Qwen3
tokenizer), PP 2 -> 1 (pipeline parallelism is not in this engine yet; the loaded checkpoint is still tp1pp2),
fewer iterations and a smaller global batch, and a larger LR so that a few iterations show the loss falling.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.checkpoint.megatron_write import save_mcore
from engine.contract.model_config import preset
from engine.model.qwen3 import Qwen3Model
from torchrun_support import main_in_process

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
TRAIN_ITERS = 6

# The seed's flag lists, verbatim except the values noted in the module docstring ({...} are filled in).
FULL = """
--use-mcore-models --spec mindspeed_llm.tasks.models.spec.qwen3_spec layer_spec --kv-channels 16 --qk-layernorm
--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --num-layers 2 --hidden-size 64 --sequence-parallel
--use-distributed-optimizer --use-flash-attn --use-rotary-position-embeddings --num-attention-heads 4
--ffn-hidden-size 128 --max-position-embeddings 32768 --seq-length 800 --make-vocab-size-divisible-by 1
--padded-vocab-size 151936 --rotary-base 1000000 --micro-batch-size 4 --global-batch-size 16 --disable-bias-linear
--train-iters 2000 --swiglu --tokenizer-type PretrainedFromHF --tokenizer-name-or-path {tok} --normalization RMSNorm
--position-embedding-type rope --norm-epsilon 1e-6 --hidden-dropout 0 --attention-dropout 0
--no-gradient-accumulation-fusion --attention-softmax-in-fp32 --exit-on-missing-checkpoint --no-masked-softmax-fusion
--group-query-attention --num-query-groups 2 --min-lr 1.25e-7 --lr 2e-3 --weight-decay 1e-1 --clip-grad 1.0
--adam-beta1 0.9 --adam-beta2 0.95 --initial-loss-scale 4096 --no-load-optim --no-load-rng --seed 42
--train-iters {iters} --bf16
--data-path {data} --split 100,0,0
--log-interval 1 --save-interval {iters} --eval-interval {iters} --eval-iters 0
--finetune --stage sft --is-instruction-dataset --prompt-type qwen --variable-seq-lengths
--tensorboard-dir {tb} --distributed-backend nccl --load {load} --save {save}
"""

LORA = """
--use-flash-attn --use-fused-rotary-pos-emb --use-rotary-position-embeddings --use-fused-swiglu --use-fused-rmsnorm
--no-masked-softmax-fusion --use-distributed-optimizer
--micro-batch-size 4 --global-batch-size 16 --lr 2e-2 --lr-decay-style cosine --min-lr 1.25e-7 --weight-decay 1e-1
--lr-warmup-fraction 0.1 --attention-dropout 0.0 --init-method-std 0.01 --hidden-dropout 0.0 --clip-grad 1.0
--adam-beta1 0.9 --adam-beta2 0.999 --initial-loss-scale 4096 --seed 42 --bf16 --train-iters {iters}
--seq-length 2048 --no-shared-storage
--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1
--use-mcore-models --spec mindspeed_llm.tasks.models.spec.qwen3_spec layer_spec --kv-channels 16 --qk-layernorm
--tokenizer-name-or-path {tok} --max-position-embeddings 2048 --num-layers 2 --hidden-size 64 --ffn-hidden-size 128
--num-attention-heads 4 --tokenizer-type PretrainedFromHF --make-vocab-size-divisible-by 1 --padded-vocab-size 151936
--rotary-base 1000000 --disable-bias-linear --position-embedding-type rope --normalization RMSNorm --swiglu
--attention-softmax-in-fp32 --no-gradient-accumulation-fusion --group-query-attention --num-query-groups 2
--data-path {data} --split 100,0,0
--load {load} --save {save} --log-interval 1 --save-interval {iters} --eval-interval {iters} --eval-iters 0
--no-load-optim --no-load-rng
--finetune --stage sft --is-instruction-dataset --tokenizer-not-use-fast --prompt-type qwen --variable-seq-lengths
--lora-r 16 --lora-alpha 32 --lora-fusion --lora-target-modules linear_qkv linear_proj linear_fc1 linear_fc2
--tensorboard-dir {tb} --distributed-backend nccl
"""

INTENTS = ["闲聊百科_知识查询", "天气_查询天气", "音乐_播放音乐", "导航_路线规划", "设备控制_打开空调", "闹钟_设置闹钟"]
QUESTIONS = [
    "广州塔为什么也叫小蛮腰",
    "明天北京会下雨吗",
    "放一首周杰伦的歌",
    "去机场怎么走",
    "把空调打开",
    "明早七点叫我起床",
]
MAP_KEYS = (
    '{"messages":"messages", "tags":{"role_tag": "role","content_tag": "content","user_tag": "user",'
    '"assistant_tag": "assistant","system_tag": "system"}}'
)

# the module's assets (55 s at load ~15) land on whichever test runs first; the one-process full SFT took 109 s
pytestmark = pytest.mark.timeout(420)


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


# the assets by tokenizer directory, built once per test process: test_parallel_seed_scripts.py imports the fixture,
# and pytest would otherwise build them again for that module (a module fixture is per module)
_ASSETS: dict[Path, dict[str, Path]] = {}


@pytest.fixture(scope="module")
def seed_assets(tmp_path_factory: pytest.TempPathFactory, qwen_tokenizer_dir: Path) -> dict[str, Path]:
    if qwen_tokenizer_dir not in _ASSETS:
        _ASSETS[qwen_tokenizer_dir] = _build_assets(tmp_path_factory.mktemp("seed"), qwen_tokenizer_dir)
    return _ASSETS[qwen_tokenizer_dir]


def _build_assets(base: Path, qwen_tokenizer_dir: Path) -> dict[str, Path]:
    """The seed's raw intent data preprocessed as its script does, and a tiny tied Qwen3 saved as mcore TP1 PP2."""
    raw = base / "customed_train.jsonl"
    with raw.open("w", encoding="utf-8") as f:
        for i in range(64):
            k = (i * 7) % len(INTENTS)
            f.write(
                json.dumps(
                    {
                        "messages": [
                            {"role": "system", "content": "You are a helpful assistant."},
                            {
                                "role": "user",
                                "content": f"请你判读用户的意图。...交互历史：用户：{QUESTIONS[k]}\n用户最后一句话所属的技能和意图是：",
                            },
                            {"role": "assistant", "content": INTENTS[k]},
                        ]
                    },
                    ensure_ascii=False,
                )
                + "\n"
            )
    prefix = base / "finetune_dataset" / "customed"
    subprocess.run(
        [
            PY,
            "-m",
            "engine",
            "preprocess",
            "--input",
            str(raw),
            "--tokenizer-name-or-path",
            str(qwen_tokenizer_dir),
            "--output-prefix",
            str(prefix),
            "--handler-name",
            "SharegptStyleInstructionHandler",
            "--tokenizer-type",
            "PretrainedFromHF",
            "--enable-thinking",
            "true",
            "--workers",
            "1",
            "--log-interval",
            "1000",
            "--map-keys",
            MAP_KEYS,
            "--prompt-type",
            "qwen3",
            "--run-dir",
            str(base / "prep"),
        ],
        cwd=ROOT,
        env=_env(),
        check=True,
        capture_output=True,
    )
    cfg = preset("qwen3-tiny-tied")  # tied like Qwen3-4B, the real vocabulary
    model = Qwen3Model(cfg)
    model.init_weights(0)
    load = base / "mg_weights" / "qwen3_tiny_mcore_tp1pp2"
    save_mcore(model.state_dict(), cfg, load, tp=1, pp=2, dtype=torch.bfloat16)
    return {"tok": qwen_tokenizer_dir, "data": prefix, "load": load, "base": base}


def _run(flags: str, assets: dict[str, Path], name: str, nproc: int) -> tuple[Path, Path]:
    out = assets["base"] / f"{name}_{nproc}"
    values = {
        "tok": assets["tok"],
        "data": assets["data"],
        "load": assets["load"],
        "save": out / "save",
        "tb": out / "tb",
        "iters": TRAIN_ITERS,
    }
    argv = ["train", *shlex.split(flags.format(**values)), "--run-dir", str(out / "run")]
    if nproc == 1:
        main_in_process(argv, out / "run")
        return out / "save", out / "run"
    launcher = [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m", "engine"]
    proc = subprocess.run([*launcher, *argv], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out / "save", out / "run"


def _check_run(save: Path, run_dir: Path, nproc: int) -> list[dict]:
    rows = [json.loads(line)["metrics"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == list(range(1, TRAIN_ITERS + 1))
    assert rows[-1]["lm_loss"] < rows[0]["lm_loss"] - 0.5, [r["lm_loss"] for r in rows]
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == str(TRAIN_ITERS)
    rank_file = save / f"iter_{TRAIN_ITERS:07d}" / "mp_rank_00" / "model_optim_rng.pt"
    assert rank_file.is_file()
    result = json.loads((run_dir / "result.json").read_text())
    assert result["outputs"]["checkpoint"] == str(save) and result["summary"]["world_size"] == nproc
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    ignored = next(e for e in events if e["type"] == "warning")["data"]["ignored"]
    assert "--use-flash-attn" in ignored and "--distributed-backend" in ignored
    log = (run_dir / "logs" / "rank0.log").read_text()
    assert f"iteration 1/ {TRAIN_ITERS} | consumed samples: 16 | elapsed time per iteration (ms): " in log
    assert "| global batch size: 16 | lm loss: " in log and "| number of nan iterations: 0 |" in log
    for rank in range(nproc):
        rank_log = (run_dir / "logs" / f"rank{rank}.log").read_text()
        assert f"[Rank {rank}] (after 1 iterations) memory (MB) | allocated: " in rank_log
    return rows


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_seed_full_sft_flags(seed_assets: dict[str, Path], nproc: int):
    save, run_dir = _run(FULL, seed_assets, "full", nproc)
    rows = _check_run(save, run_dir, nproc)
    state = torch.load(save / f"iter_{TRAIN_ITERS:07d}" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    assert state["model"]["embedding.word_embeddings.weight"].shape == (151936, 64)
    assert state["model"]["embedding.word_embeddings.weight"].dtype == torch.bfloat16
    assert rows[0]["lr"] == pytest.approx(2e-3 - (2e-3 - 1.25e-7) / TRAIN_ITERS)  # linear decay, logged after step


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_seed_lora_flags(seed_assets: dict[str, Path], nproc: int):
    save, run_dir = _run(LORA, seed_assets, "lora", nproc)
    _check_run(save, run_dir, nproc)
    state = torch.load(save / f"iter_{TRAIN_ITERS:07d}" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    assert {k.rsplit(".lora_", 1)[0] for k in state["model"]} == {
        f"decoder.layers.{i}.{m}"
        for i in range(2)
        for m in ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
    }
    assert state["args"].lora_r == 16 and state["args"].lora_alpha == 32
    assert any((save.parent / "tb").iterdir())
