"""The seed's whole loop in miniature: a generated intent-classification set (a handful of labels, the seed's prompt
wording) -> preprocess -> full-SFT training of a tiny Qwen3 with the engine -> ``python -m engine eval`` on the
trained checkpoint: accuracy clearly above the untrained model's. Then LoRA on top of it: the adapters applied
unmerged on their base decode exactly what the merged HF export decodes.

Budget: about 110 CPU-seconds on 2 threads (preprocess, 100 full iterations, 10 LoRA iterations, four evals)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from engine.checkpoint.hf import save_hf
from engine.cli import main
from engine.contract.model_config import preset
from engine.contract.runfiles import EXIT_OK
from engine.model.qwen3 import Qwen3Model

# the module's fixture (two trainings) lands on whichever test runs first: 86 s under CI load
pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

SYSTEM = "You are a helpful assistant."
INTENTS = {
    "天气_查询": ["{city}明天天气怎么样", "{city}会下雨吗", "查一下{city}的天气", "{city}今天冷不冷"],
    "音乐_播放": ["播放{singer}的歌", "我想听{singer}", "来一首{singer}的音乐", "放点{singer}的歌曲"],
    "闹钟_设置": ["{time}叫我起床", "设置{time}的闹钟", "定个{time}的闹钟", "{time}提醒我起床"],
    "电话_拨打": ["打电话给{person}", "帮我呼叫{person}", "给{person}打个电话", "拨打{person}的号码"],
}
SLOTS = {
    "city": ["北京", "上海", "广州", "深圳", "杭州", "成都"],
    "singer": ["周杰伦", "王菲", "陈奕迅", "邓紫棋", "林俊杰"],
    "time": ["早上七点", "六点半", "明早八点", "中午十二点"],
    "person": ["妈妈", "爸爸", "老板", "张三", "李四"],
}


def _line(rng: random.Random) -> dict:
    label = rng.choice(sorted(INTENTS))
    text = rng.choice(INTENTS[label]).format(**{k: rng.choice(v) for k, v in SLOTS.items()})
    user = f"请你判读用户的意图。交互历史：用户：{text}\n用户最后一句话所属的技能和意图是："
    return {
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": user},
            {"role": "assistant", "content": label},
        ]
    }


def _write(path: Path, n: int, seed: int) -> Path:
    rng = random.Random(seed)
    path.write_text("".join(json.dumps(_line(rng), ensure_ascii=False) + "\n" for _ in range(n)))
    return path


def _job(kind: str, spec: dict, run_dir: Path) -> dict:
    spec_file = run_dir.parent / f"{run_dir.name}.json"
    spec_file.write_text(json.dumps({"kind": kind, **spec}))
    assert main([kind, "--spec", str(spec_file), "--run-dir", str(run_dir)]) == EXIT_OK
    return json.loads((run_dir / "result.json").read_text())


def _eval(load: Path, tok: str, data: Path, run_dir: Path, *extra: str) -> dict:
    argv = [
        "eval",
        "--load",
        str(load),
        "--tokenizer-name-or-path",
        tok,
        "--eval-data-path",
        str(data),
        "--max-new-tokens",
        "8",
        "--temperature",
        "0.00001",
        "--eval-batch-size",
        "16",
        "--run-dir",
        str(run_dir),
        *extra,
    ]
    assert main(argv) == EXIT_OK
    return json.loads((run_dir / "result.json").read_text())["summary"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, qwen_tokenizer_dir: Path) -> dict:
    root = tmp_path_factory.mktemp("e2e")
    tok = str(qwen_tokenizer_dir)
    cfg = preset("qwen3-tiny-tied")  # tied: half the vocabulary-sized parameters to update
    base = Qwen3Model(cfg)
    base.init_weights(seed=0)
    save_hf(base.state_dict(), cfg, root / "base", dtype=torch.float32)
    data = _job(
        "preprocess",
        {
            "input": str(_write(root / "train.jsonl", 256, seed=1)),
            "tokenizer_name_or_path": tok,
            "output_prefix": str(root / "data" / "intent"),
            "prompt_type": "qwen3",
            "handler_name": "SharegptStyleInstructionHandler",
            "enable_thinking": "none",
        },
        root / "preprocess",
    )["outputs"]["data_path"]
    common = {
        "data_path": [data],
        "load": str(root / "base"),
        "finetune": True,
        "split": "100,0,0",
        "seq_length": 128,
        "micro_batch_size": 16,
        "global_batch_size": 16,
        "lr_warmup_iters": 5,
        "lr_decay_style": "cosine",
        "weight_decay": 0.0,
        "log_interval": 50,
        "seed": 3,
        "tokenizer_name_or_path": tok,
    }
    full = _job(
        "train",
        {**common, "train_iters": 100, "lr": 5e-3, "min_lr": 5e-4, "save": str(root / "full")},
        root / "train_full",
    )["outputs"]["checkpoint"]
    lora = _job(
        "train",
        {
            **common,
            "load": full,
            "train_iters": 10,
            "lr": 1e-2,
            "min_lr": 1e-3,
            "save": str(root / "lora"),
            "lora_r": 8,
            "lora_alpha": 16,
            "save_hf": True,
        },
        root / "train_lora",
    )["outputs"]
    return {"root": root, "tok": tok, "test": _write(root / "test.jsonl", 48, seed=2), "full": Path(full), "lora": lora}


def test_full_sft_checkpoint_beats_the_untrained_model(trained: dict) -> None:
    root, tok, test = trained["root"], trained["tok"], trained["test"]
    before = _eval(root / "base", tok, test, root / "eval_base")
    after = _eval(trained["full"], tok, test, root / "eval_full")
    assert before["accuracy"] <= 0.25
    assert after["accuracy"] >= 0.75, after["confusion"]
    assert after["total"] == 48 and set(after["per_label"]) == set(INTENTS)


def test_lora_adapters_unmerged_decode_what_the_merged_export_decodes(trained: dict) -> None:
    root, tok, test = trained["root"], trained["tok"], trained["test"]
    unmerged = _eval(trained["full"], tok, test, root / "eval_lora", "--lora-load", trained["lora"]["checkpoint"])
    merged = _eval(Path(trained["lora"]["hf"]), tok, test, root / "eval_merged")
    assert unmerged["model"]["lora_r"] == 8 and unmerged["model"]["lora_alpha"] == 16
    assert unmerged["model"]["lora_tensors"] == 2 * 4 * 2  # A and B of 4 modules in 2 layers
    assert unmerged["accuracy"] >= 0.75 and unmerged["accuracy"] == merged["accuracy"]
    lines = [(root / d / "predictions.jsonl").read_text() for d in ("eval_lora", "eval_merged")]
    assert lines[0] == lines[1]
