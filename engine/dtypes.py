"""The names dtypes go by in specs, Megatron args, safetensors headers and HF config.json, mapped to torch dtypes once
(converters, evaluation and the checkpoint readers/writers all use these tables).
"""

from __future__ import annotations

import torch

# Spec / Megatron precision names (``params_dtype``, ``--bf16`` / ``--fp16``).
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}

# safetensors header ``dtype`` strings.
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
SAFETENSORS_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}

# HF ``config.json`` ``torch_dtype`` strings.
HF_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
}
