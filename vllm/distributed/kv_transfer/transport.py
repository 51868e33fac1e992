"""The wire between a producer's block server and a consumer's fetches (ZeroMQ over TCP).

A consumer opens a DEALER socket to the producer's ROUTER (``KVBlockServer``) and sends
two frames: ``MAGIC`` and a JSON header::

    {"op": "fetch", "request_id": R, "start": i, "hashes": ["<hex>", ...]}
    {"op": "release", "request_id": R}

``fetch`` asks for the KV of blocks ``i, i+1, ...`` of the producer's finished request
``R``, each named by its prefix hash; the producer answers the leading run whose hashes
match its own (a prompt rendered differently on the two sides matches less, never wrong
data) and then drops its hold on ``R``. ``release`` drops the hold without data (the
consumer had every block already). The reply is a JSON header, then one raw frame per
tensor, its shape and dtype in ``layers``::

    {"ok": true, "num_blocks": n, "runs": [...],
     "layers": [{"shape": [...], "dtype": "bfloat16"}, ...]}
    {"ok": false, "error": "..."}

The server's ``serve`` callback does the lookup and says which tensors to send: views of
the producer's tier, sent without a copy (ZeroMQ reads them while the callback's
``on_sent`` has not run; the producer keeps them held until then). The consumer's tensors
are views of the received frames. This module only moves frames.
"""

from __future__ import annotations

import json
import logging
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import zmq

logger = logging.getLogger(__name__)

MAGIC = b"vllm-continuum-kv/1"
POLL_MS = 100  # how often the server's thread looks at its stop flag

# serve(header) -> (reply header, tensors to send, on_sent): the producer's lookup;
# on_sent runs once ZeroMQ no longer reads the tensors (sent, or the send failed).
ServeFn = Callable[
    [dict[str, Any]], tuple[dict[str, Any], Sequence[torch.Tensor], Callable[[], None]]
]


class TransferError(RuntimeError):
    """A fetch failed: the peer is unreachable, answered an error, or sent bad frames."""


def tensor_frames(tensors: Sequence[torch.Tensor]) -> tuple[list[dict[str, Any]], list[memoryview]]:
    """Each tensor's layout and its bytes, for one reply: no copy of a contiguous tensor
    (the frame is its memory)."""
    layouts, frames = [], []
    for t in tensors:
        t = t.contiguous()
        layouts.append({"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")})
        frames.append(memoryview(t.view(torch.uint8).reshape(-1).numpy()))
    return layouts, frames


def frames_tensors(layouts: Sequence[dict[str, Any]], frames: Sequence[Any]) -> list[torch.Tensor]:
    """The tensors of a reply's frames (zero-copy views; TransferError on a mismatch)."""
    if len(layouts) != len(frames):
        raise TransferError(f"{len(layouts)} layer layouts but {len(frames)} data frames")
    tensors = []
    for layout, frame in zip(layouts, frames, strict=True):
        dtype = getattr(torch, str(layout.get("dtype")), None)
        if not isinstance(dtype, torch.dtype):
            raise TransferError(f"unknown dtype {layout.get('dtype')!r}")
        shape = [int(d) for d in layout["shape"]]
        with warnings.catch_warnings():  # ZeroMQ's frames are read-only; they are only read
            warnings.simplefilter("ignore", UserWarning)
            data = torch.frombuffer(frame, dtype=torch.uint8) if len(frame) else torch.empty(0)
        if data.numel() != torch.Size(shape).numel() * dtype.itemsize:
            raise TransferError(f"a layer of shape {shape} came with {data.numel()} bytes")
        if data.numel():
            tensors.append(data.view(dtype).reshape(shape))
        else:
            tensors.append(torch.empty(shape, dtype=dtype))
    return tensors


def _nothing() -> None:
    pass


class KVBlockServer:
    """A thread answering fetches on ``tcp://host:port`` (port 0: a free one, then
    ``self.port``). ``serve`` runs on that thread; an exception in it answers an error."""

    def __init__(self, ctx: zmq.Context, host: str, port: int, serve: ServeFn) -> None:
        self._serve = serve
        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            if port:
                self._sock.bind(f"tcp://{host}:{port}")
                self.port = port
            else:
                self.port = self._sock.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError as e:
            self._sock.close()
            raise ValueError(
                f"kv_transfer_config: cannot listen on {host}:{port or '(any port)'}: {e} "
                "(kv_ip, kv_port)"
            ) from None
        self.host = host
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-block-server", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._sock.poll(POLL_MS):
                    continue
                frames = self._sock.recv_multipart(copy=False)
                identity = frames[0].bytes
                reply, data, on_sent = self._answer(frames[1:])
                try:
                    tracker = self._sock.send_multipart(
                        [identity, json.dumps(reply).encode(), *data], copy=False, track=True
                    )
                    tracker.wait()  # ZeroMQ reads the tensors in place until this returns
                finally:
                    on_sent()
        except zmq.ZMQError as e:
            if not self._stop.is_set():
                logger.error("KV block server stopped: %s", e)
        finally:
            self._sock.close(linger=0)

    def _answer(
        self, frames: Sequence[Any]
    ) -> tuple[dict[str, Any], list[memoryview], Callable[[], None]]:
        on_sent: Callable[[], None] = _nothing
        try:
            if len(frames) != 2 or frames[0].bytes != MAGIC:
                raise TransferError("not a KV fetch of this engine's protocol")
            header = json.loads(frames[1].bytes)
            if not isinstance(header, dict):
                raise TransferError("the header is not a JSON object")
            reply, tensors, on_sent = self._serve(header)
            layouts, data = tensor_frames(tensors)
            return {**reply, "ok": True, "layers": layouts}, data, on_sent
        except Exception as e:  # noqa: BLE001 - the peer gets the error; the server goes on
            logger.warning("KV fetch refused: %s", e)
            on_sent()
            return {"ok": False, "error": f"{type(e).__name__}: {e}"}, [], _nothing

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * POLL_MS / 1000 + 1)


def request_blocks(
    ctx: zmq.Context, host: str, port: int, header: dict[str, Any], timeout_s: float
) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """Send one request to a block server and return its reply (header, layer tensors);
    TransferError when it fails or does not answer within ``timeout_s``."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://{host}:{port}")
        sock.send_multipart([MAGIC, json.dumps(header).encode()])
        if not sock.poll(int(timeout_s * 1000)):
            raise TransferError(f"no answer from {host}:{port} within {timeout_s:g} s")
        frames = sock.recv_multipart(copy=False)
    except zmq.ZMQError as e:
        raise TransferError(f"{host}:{port}: {e}") from None
    finally:
        sock.close(linger=0)
    try:
        reply = json.loads(frames[0].bytes)
    except (ValueError, IndexError) as e:
        raise TransferError(f"a reply that is not JSON: {e}") from None
    if not reply.get("ok"):
        raise TransferError(str(reply.get("error", "refused")))
    return reply, frames_tensors(reply.get("layers", []), [f.buffer for f in frames[1:]])
