"""Checkpoints: HF safetensors (``hf``), Megatron legacy torch layout (``megatron``), format detection (``load``),
LoRA merge/export (``lora_merge``), the convert job (``job``) and the trainer's own checkpoints (``dcp``)."""
