"""The start-up heap frozen out of collections (vllm/utils/gc_utils.py): holds, what a
frozen cycle waits for, VLLM_GC_DEBUG, and an in-process ``LLM`` taking and giving back
its hold (the server's two processes: tests/entrypoints/openai/test_gc_freeze_e2e.py)."""

from __future__ import annotations

import gc
import logging
import subprocess
import sys
import textwrap
import weakref

import pytest

from vllm.utils import gc_utils
from vllm.utils.gc_utils import GCDebugger, freeze_gc_heap, gc_debug_config


class Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


@pytest.fixture(autouse=True)
def thawed():
    """Each test starts with no hold and nothing frozen; holds from before (an engine of
    another test still alive) are put back after."""
    held, gc_utils._holds = gc_utils._holds, 0
    gc.unfreeze()
    yield
    left, gc_utils._holds = gc_utils._holds, held
    gc.unfreeze()
    if held:
        gc.freeze()
    assert left == 0, "a test left a hold"


def test_a_frozen_cycle_waits_for_the_last_hold():
    node = Node()
    alive = weakref.ref(node)
    first = freeze_gc_heap("test")
    assert first.num_frozen > 0 and gc.get_freeze_count() > 0
    assert not any(o is node for o in gc.get_objects())  # permanent: never examined
    second = freeze_gc_heap("test")  # a second engine in the process
    del node
    gc.collect()
    assert alive() is not None  # frozen: no collection examines it
    first.release()
    first.release()  # idempotent: the second hold is still held
    gc.collect()
    assert alive() is not None and gc.get_freeze_count() > 0
    second.release()
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert alive() is None


def test_freezing_collects_first():
    node = Node()
    alive = weakref.ref(node)
    del node  # garbage before the freeze: collected, not made permanent
    hold = freeze_gc_heap("test")
    try:
        assert alive() is None
    finally:
        hold.release()


def test_objects_made_after_the_freeze_are_collected_as_before():
    hold = freeze_gc_heap("test")
    try:
        node = Node()
        alive = weakref.ref(node)
        del node
        gc.collect()
        assert alive() is None
    finally:
        hold.release()


def test_a_hold_never_released_is_thawed_at_exit():
    """An ``LLM`` never shut down: the collection at exit still frees its cycles."""
    script = textwrap.dedent(
        """
        import sys
        from vllm.utils.gc_utils import freeze_gc_heap

        class Node:
            def __init__(self):
                self.me = self

            def __del__(self):
                sys.stdout.write("freed")

        node = Node()
        hold = freeze_gc_heap("test")
        del node
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "freed"


def test_a_hold_released_by_the_collection_of_a_freeze_does_not_deadlock():
    """An ``LLM`` dropped in a cycle (a constructor that failed) gives its hold back from
    a finalizer, which the collection of the next ``freeze_gc_heap`` runs, under its
    lock. A subprocess: a deadlock here would hang the test run."""
    script = textwrap.dedent(
        """
        import weakref
        from vllm.utils import gc_utils

        class Engine:
            def __init__(self):
                self.me = self  # a cycle: only the collector frees it
                self.hold = gc_utils.freeze_gc_heap("first")
                weakref.finalize(self, self.hold.release)

        Engine()
        gc_utils.gc.unfreeze()  # the dropped engine's cycle is collectable again
        second = gc_utils.freeze_gc_heap("second")  # its collection runs the finalizer
        assert gc_utils._holds == 1, gc_utils._holds
        second.release()
        assert gc_utils._holds == 0 and gc_utils.gc.get_freeze_count() == 0
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    "value, expected",
    [
        (None, None),
        ("0", None),
        ("false", None),
        ("1", {"top_objects": 0}),
        ("TRUE", {"top_objects": 0}),
        ('{"top_objects": 3}', {"top_objects": 3}),
        ("{}", {"top_objects": 0}),
    ],
)
def test_gc_debug_values(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("VLLM_GC_DEBUG", raising=False)
    else:
        monkeypatch.setenv("VLLM_GC_DEBUG", value)
    assert gc_debug_config() == expected


@pytest.mark.parametrize("value", ["yes", '{"top_objects": -1}', '{"top_objects": true}', "[3]"])
def test_bad_gc_debug_values_name_the_variable(monkeypatch, value):
    monkeypatch.setenv("VLLM_GC_DEBUG", value)
    with pytest.raises(ValueError, match="VLLM_GC_DEBUG"):
        gc_debug_config()


def test_the_debugger_logs_each_collection(caplog):
    debugger = GCDebugger(top_objects=2)
    gc.callbacks.append(debugger)
    try:
        nodes = [Node() for _ in range(50)]
        del nodes
        with caplog.at_level(logging.INFO, logger="vllm.utils.gc_utils"):
            gc.collect()
    finally:
        gc.callbacks.remove(debugger)
    lines = [r.getMessage() for r in caplog.records if "GC generation 2" in r.getMessage()]
    assert len(lines) == 1
    assert "ms, " in lines[0] and "collected" in lines[0] and "examined most: " in lines[0]
    assert int(lines[0].split("ms, ")[1].split(" collected")[0]) >= 50


def test_an_llm_holds_a_freeze_until_shutdown(monkeypatch):
    from vllm import LLM, SamplingParams

    monkeypatch.setenv("VLLM_GC_DEBUG", "1")
    llm = LLM(max_model_len=256, num_gpu_blocks_override=32)
    try:
        assert gc_utils._holds == 1 and gc.get_freeze_count() > 0
        # The model's modules are out of every collection's reach while the engine lives.
        model = llm.engine_core.model_runner.model
        assert not any(o is model for o in gc.get_objects())
        del model
        assert any(isinstance(c, GCDebugger) for c in gc.callbacks)
        assert llm.generate("Hi", SamplingParams(max_tokens=2))[0].outputs[0].token_ids
    finally:
        llm.shutdown()
        for callback in [c for c in gc.callbacks if isinstance(c, GCDebugger)]:
            gc.callbacks.remove(callback)
    assert gc_utils._holds == 0 and gc.get_freeze_count() == 0
    llm.shutdown()  # again: nothing more to give back


def test_an_llm_dropped_without_shutdown_gives_its_hold_back():
    """A notebook that rebuilds its ``LLM``: the old engine's cycles (and its device
    memory) are collected, not frozen for good."""
    from vllm import LLM

    llm = LLM(max_model_len=256, num_gpu_blocks_override=32)
    core = weakref.ref(llm.engine_core)
    assert gc_utils._holds == 1
    del llm
    assert gc_utils._holds == 0 and gc.get_freeze_count() == 0
    gc.collect()
    assert core() is None
