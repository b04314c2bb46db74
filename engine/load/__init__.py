"""Model loading: what train, eval, serve and the trace build a model through (one floor below them).

- ``weights``: what ``load`` holds (format, shape, reader), the spec's shape flags checked against it, rank views.
- ``rank_model``: one training rank's part of the model (PP split, TP, recompute, FSDP), filled with its slices.
- ``adapters``: LoRA adapters of ``lora_load`` read, checked against the spec and wrapped onto the model.
- ``inference``: the model eval and serve run (meta build, adapters, TP without SP, filled in its dtype).
- ``tokenizer``: the tokenizer of a job that loads a model, and the ids that end an assistant turn.
The model itself is ``engine.model`` (seen through ``engine.model.decoder_lm.DecoderLM``); the readers are
``engine.checkpoint``; the transforms ``engine.parallel``.
"""
