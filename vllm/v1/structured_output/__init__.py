"""Guided decoding (vLLM's "structured outputs"): a request's grammar, checked at the
front end, becomes a token mask applied to its logits before every sampling step.

The backend is llguidance (no dependencies, ~3 MB): a JSON-schema grammar compiles in
~20 ms and a mask over the 49,152-token vocabulary takes ~0.3 ms per step on one CPU
core. Its tokenizer table (~0.5 s for SmolLM2) is built by the first constrained request,
once in the front end and once in the engine. What a client sends is bounded
(``grammar.py``'s limits), compiled off the event loop with a time budget, and checked
with the real tokenizer before the request reaches the engine.
"""

from __future__ import annotations

from vllm.v1.structured_output.grammar import compile_grammar, validate_structured_outputs
from vllm.v1.structured_output.json_schema import strict_json_schema
from vllm.v1.structured_output.manager import StructuredOutputManager
from vllm.v1.structured_output.validator import StructuredOutputValidator

__all__ = [
    "StructuredOutputManager",
    "StructuredOutputValidator",
    "compile_grammar",
    "strict_json_schema",
    "validate_structured_outputs",
]
