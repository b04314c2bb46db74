"""Checkpoints: HF safetensors (``hf``), Megatron legacy torch layout (``megatron``), TP/PP cutting rules
(``layout``), lazy pread readers (``reader``), streaming torch.save writer (``torchfile``), format detection
(``load``), LoRA overlay/PEFT export (``lora_merge``), the convert job (``job``) and the trainer's own checkpoints
(``dcp``, owned by the trainer)."""
