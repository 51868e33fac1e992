"""Weight formats (``--quantization``): which implementation runs the linear layers.

``None`` / ``"fp32"``: dense weights in the model's dtype, dequantized from a GGUF at load
(the exactness reference). ``"gguf"``: a GGUF model's quantized blocks stay in memory and
the native kernels multiply by them (see ``gguf.py``).
"""

from __future__ import annotations

from typing import Literal

Quantization = Literal["fp32", "gguf"]
