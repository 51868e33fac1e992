"""Weight formats (``--quantization``): which implementation runs the linear layers.

``"fp32"``: dense weights in the model's dtype, dequantized from a GGUF at load (the
exactness reference). ``"gguf"``: a GGUF model's quantized blocks stay in memory and the
native kernels multiply by them (see ``gguf.py``). ``None`` (the default) chooses at load
(``model_loader.resolve_quantization``): gguf for a GGUF model on CPU in float32 when the
native kernels are built, fp32 for anything else.
"""

from __future__ import annotations

from typing import Literal

Quantization = Literal["fp32", "gguf"]
