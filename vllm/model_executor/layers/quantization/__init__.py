"""Weight formats (``--quantization``): which implementation runs the linear layers.

``"fp32"``: dense weights in the model's dtype, dequantized from a GGUF, an FP8 or an
integer-weight (AWQ, GPTQ, compressed-tensors pack-quantized: ``wna16_checkpoint.py``)
checkpoint at load (the exactness reference). ``"gguf"``: a GGUF model's quantized blocks
stay in memory and the native kernels multiply by them (see ``gguf.py``). ``"fp8"``:
float8_e4m3fn weights with per-channel scales, multiplied in FP8 (``fp8.py``): an FP8
checkpoint's own (``fp8_checkpoint.py``) or a dense model's quantized at load. ``None``
(the default) chooses at load (``model_loader.resolve_quantization``): fp8 for an FP8
checkpoint on a GPU with FP8 GEMMs, gguf for a GGUF model on CPU in float32 when the
native kernels are built, fp32 for anything else. ``"awq"`` / ``"gptq"`` (vLLM's names:
the checkpoint's own method, an error for any other checkpoint): serve an AWQ / GPTQ
checkpoint as auto does, its 4-bit layers packed (``int4.py``) where the W4A16 kernel runs
and dequantized elsewhere; auto picks the same for them (and for compressed-tensors int
checkpoints).
"""

from __future__ import annotations

from typing import Literal

Quantization = Literal["fp32", "gguf", "fp8", "awq", "gptq"]
