"""Data: raw files -> conversations -> token ids and labels -> Megatron indexed datasets -> training samples.

Modules, in pipeline order (each has one job; the docstrings are the interface documentation):

- ``readers``   read records from .jsonl/.json/.parquet/.csv/.txt/.arrow files or a directory of one format.
- ``formats``   turn records into normalized conversations (OpenAI messages, ShareGPT, Alpaca) with ``map_keys``;
                ``iter_conversations(path, map_keys, handler_name)`` is shared with evaluation.
- ``templates`` render conversations to ``(input_ids, labels)`` with a chat template (``qwen3`` with MindSpeed's
                ``enable_thinking`` true/false/none, ``qwen``, or ``hf`` = the tokenizer's own chat template);
                ``encode_conversation`` / ``encode_prompt`` are shared with evaluation.
- ``truncation`` over-long samples: MindSpeed's proportional prompt/answer cut, head cut or drop; ``append_eod``.
- ``tokenizer`` load a ``transformers`` fast tokenizer from a local directory.
- (pairwise) ``encode`` also writes MindSpeed's preference pairs: ``<prefix>_packed_{chosen,rejected}_{input_ids,labels}_document``.
- ``packing``   greedy knapsack packing of samples into ``seq_length`` rows, with per-sample boundaries.
- ``job``       the ``preprocess`` job kind: ``run(spec, run) -> (outputs, summary)``.

Torch-free and shared with the service's admission and planner, in ``engine.contract``: ``indexed`` (Megatron
``.bin``/``.idx`` writer and memory-mapped reader, MindSpeed instruction datasets), ``sampler`` (seeded, resumable,
data-parallel sample order) and ``lengths`` (how the trainer cuts and pads rows).
"""
