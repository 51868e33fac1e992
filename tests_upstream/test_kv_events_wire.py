"""Our engine's KV cache events decode with upstream vLLM's own event classes: the bytes
come from our `vllm` (the repository's .venv, a subprocess), the decoding from upstream's
`vllm.distributed.kv_events.KVEventBatch` in this environment."""

from __future__ import annotations

import subprocess
from pathlib import Path

import msgspec
import pytest

from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

ROOT = Path(__file__).resolve().parents[1]
OUR_PYTHON = ROOT / ".venv" / "bin" / "python"

# Run by our engine's Python: a pool and its tier record a prompt's blocks, a save to the
# tier, an eviction and a reset; the batch goes out as our publisher encodes it.
PRODUCE = """
import sys, msgspec
from vllm.distributed.kv_events import KVEventBatch, KVEventLog
from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.request import Request

log = KVEventLog()
m = KVCacheManager(4, 4, 64, num_cpu_blocks=2, kv_events=log)
params = SamplingParams(max_tokens=1, extra_args={"job_id": "agent-1"})
req = Request("a", list(range(10)), params, eos_token_id=None,
              block_hasher=get_request_block_hasher(4), lora_request=LoRARequest("sql", 3, "/x"))
m.allocate_slots(req, 10)
req.num_computed_tokens = 10
m.free(req, offload=True)
m.take_kv_transfers()
other = Request("b", list(range(100, 112)), SamplingParams(max_tokens=1), eos_token_id=None,
                block_hasher=get_request_block_hasher(4))
m.allocate_slots(other, 12)  # evicts the first request's blocks from the KV cache
other.num_computed_tokens = 12
m.free(other)
m.reset_prefix_cache()
batch = KVEventBatch(ts=12.5, events=log.take(), data_parallel_rank=0)
sys.stdout.buffer.write(msgspec.msgpack.encode(batch))
"""


@pytest.mark.skipif(not OUR_PYTHON.exists(), reason="needs our engine's .venv (make setup)")
def test_our_events_decode_with_upstreams_classes():
    payload = subprocess.run(
        [str(OUR_PYTHON), "-c", PRODUCE], cwd=ROOT, capture_output=True, check=True, timeout=120
    ).stdout
    batch = msgspec.msgpack.Decoder(KVEventBatch).decode(payload)
    assert batch.ts == 12.5 and batch.data_parallel_rank == 0
    kinds = [(type(e).__name__, getattr(e, "medium", None)) for e in batch.events]
    assert kinds == [
        ("BlockStored", "GPU"),  # the prompt's two full blocks
        ("BlockStored", "CPU"),  # saved to the tier as it was freed
        ("BlockStored", "CPU"),
        ("BlockRemoved", "GPU"),  # evicted for the second request...
        ("BlockStored", "GPU"),  # ...whose three blocks are stored
        ("AllBlocksCleared", None),
    ]
    first = batch.events[0]
    assert isinstance(first, BlockStored)
    assert first.token_ids == list(range(8)) and first.block_size == 4
    assert first.parent_block_hash is None and len(first.block_hashes) == 2
    assert all(isinstance(h, int) and 0 <= h < 2**64 for h in first.block_hashes)
    assert (first.lora_id, first.lora_name, first.session_id) == (3, "sql", "agent-1")
    assert first.extra_keys == [("sql",), None] and first.group_idx == 0
    saved = {e.block_hashes[0] for e in batch.events[1:3]}
    assert saved == set(first.block_hashes)  # the tier names a block as the cache did
    removed = batch.events[3]
    assert isinstance(removed, BlockRemoved) and set(removed.block_hashes) <= saved
    assert isinstance(batch.events[-1], AllBlocksCleared)
