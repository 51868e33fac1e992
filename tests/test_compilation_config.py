"""vLLM's CUDA-graph and compilation flags (``--compilation-config`` / ``-O`` / ``-cc``,
``--cudagraph-capture-sizes``, older vLLM's ``--cuda-graph-sizes``): parsed by the real
``vllm serve`` parser, folded into ``ModelConfig`` (``enforce_eager``,
``cudagraph_capture_sizes``, ``max_cudagraph_capture_size``), what this engine cannot do
refused, and explicit sizes reaching the capture ladder of the model runner."""

from __future__ import annotations

import dataclasses

import pytest

from tests.tiny_models import save_tiny_llama
from tests.v1.worker.test_cuda_graph import ReplayingGraph, make_runner, run_steps
from vllm.config import ModelConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints.cli.main import make_parser
from vllm.v1.worker.cuda_graph import cudagraph_capture_sizes


def _config(*argv: str):
    args = make_parser().parse_args(["serve", *argv])
    return EngineArgs.from_cli_args(args).create_engine_config()


def _model(*argv: str) -> ModelConfig:
    return _config(*argv).model_config


@pytest.mark.parametrize(
    "argv",
    [
        ["-O0"],
        ["-O", "0"],
        ["--compilation-config", "0"],
        ["-cc", '{"level": 0}'],
        ["-O", '{"mode": "NONE"}'],
        ["-O", '{"mode": 0}'],
        ["-O", '{"cudagraph_mode": "NONE"}'],
        ["-O", '{"cudagraph_mode": "none"}'],
        ["--compilation-config", '{"level": 0, "cudagraph_mode": "NONE"}'],
    ],
)
def test_no_compilation_without_a_graph_mode_runs_eagerly(argv):
    # vLLM: -O0 compiles nothing and captures nothing; level / mode 0 without a
    # cudagraph_mode leaves graphs off too; cudagraph_mode NONE is --enforce-eager.
    assert not _model().enforce_eager
    assert _model(*argv).enforce_eager


def test_full_decode_only_graphs_are_what_the_engine_does():
    mc = _model("-O", '{"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}')
    assert not mc.enforce_eager
    assert mc.compilation_config == {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
    assert not _model("-cc", '{"cudagraph_mode": "full_decode_only"}').enforce_eager
    with pytest.raises(ValueError, match="--enforce-eager and compilation_config.cudagraph_mode"):
        _model("--enforce-eager", "-O", '{"cudagraph_mode": "FULL_DECODE_ONLY"}')


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["-O3"], r"compilation_config.level 3 asks for torch.compile"),
        (["-O1"], r"compilation_config.level 1 asks for torch.compile"),
        (["-O", '{"level": 3}'], "-O1 to -O3"),
        (["-O", '{"mode": "VLLM_COMPILE"}'], "'VLLM_COMPILE' asks for torch.compile"),
        (["-O", '{"mode": true}'], "compilation_config.mode"),
        (["-O", '{"cudagraph_mode": "PIECEWISE"}'], "must be FULL_DECODE_ONLY"),
        (["-O", '{"cudagraph_mode": "FULL_AND_PIECEWISE"}'], "need torch.compile"),
        (["-O", '{"cudagraph_mode": "FULL"}'], "mixed prefill-decode"),
        (["-O", '{"splitting_ops": [], "level": 0}'], r"takes \['level', 'mode'"),
        (["-O", '{"cudagraph_capture_sizes": [0, 4]}'], "integers >= 1"),
        (["-O", '{"cudagraph_capture_sizes": 8}'], "non-empty list"),
        (["-O", '{"max_cudagraph_capture_size": 0}'], "max_cudagraph_capture_size must be >= 1"),
    ],
)
def test_what_the_engine_cannot_honour_is_refused_by_name(argv, needle):
    with pytest.raises(ValueError, match=needle):
        _model(*argv)


@pytest.mark.parametrize("text", ["{bad", "[1, 2]", "-1", "fast"])
def test_a_value_neither_level_nor_object_is_an_argparse_error(text, capsys):
    with pytest.raises(SystemExit):
        make_parser().parse_args(["serve", "-O", text])
    assert "--compilation-config/-O/-cc" in capsys.readouterr().err


def test_capture_sizes_from_each_form():
    assert _model("--cudagraph-capture-sizes", "4", "1", "2", "2").cudagraph_capture_sizes == (
        1,
        2,
        4,
    )
    mc = _model("-O", '{"cudagraph_capture_sizes": [16, 8], "max_cudagraph_capture_size": 16}')
    assert mc.cudagraph_capture_sizes == (8, 16) and mc.max_cudagraph_capture_size == 16
    assert _model("-cc", '{"max_cudagraph_capture_size": 32}').max_cudagraph_capture_size == 32
    # Older vLLM's --cuda-graph-sizes: one value is the ladder's top, several the list.
    mc = _model("--cuda-graph-sizes", "64")
    assert mc.max_cudagraph_capture_size == 64 and mc.cudagraph_capture_sizes is None
    mc = _model("--cuda-graph-sizes", "8", "1", "2")
    assert mc.cudagraph_capture_sizes == (1, 2, 8) and mc.cuda_graph_sizes is None
    # The same value twice agrees; a replace (the draft model's config) folds nothing twice.
    mc = _model("--cuda-graph-sizes", "1", "2", "-O", '{"cudagraph_capture_sizes": [2, 1]}')
    assert mc.cudagraph_capture_sizes == (1, 2)
    assert dataclasses.replace(mc, seed=3).cudagraph_capture_sizes == (1, 2)
    # An offline LLM(compilation_config=0) takes a level too.
    assert EngineArgs(compilation_config=0).create_engine_config().model_config.enforce_eager


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--cuda-graph-sizes", "1", "2", "--cudagraph-capture-sizes", "1", "4"], "disagree"),
        (["--cuda-graph-sizes", "64", "--max-cudagraph-capture-size", "32"], "disagree"),
        (["--cudagraph-capture-sizes", "4", "-O", '{"cudagraph_capture_sizes": [8]}'], "disagree"),
        (["--cudagraph-capture-sizes", "1", "4", "--max-cudagraph-capture-size", "8"], "largest"),
        (["--cudagraph-capture-sizes", "256", "--max-num-seqs", "64"], "max_num_seqs=64"),
    ],
)
def test_capture_sizes_that_disagree_or_cannot_be_used_are_refused(argv, needle):
    with pytest.raises(ValueError, match=needle):
        _config(*argv)


def test_eager_needs_no_usable_capture_size():
    config = _config("--cudagraph-capture-sizes", "256", "--max-num-seqs", "64", "-O0")
    assert config.model_config.enforce_eager


def test_the_ladder_takes_explicit_sizes():
    assert cudagraph_capture_sizes(8, None, (1, 3, 16)) == [1, 3]  # 16 > max_num_seqs
    assert cudagraph_capture_sizes(100, 16, (2, 64, 64)) == [2, 64]
    assert cudagraph_capture_sizes(100, 16) == [1, 2, 4, 8, 16]  # the ladder as before
    with pytest.raises(ValueError, match="no size in"):
        cudagraph_capture_sizes(8, None, (16, 32))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-graph-sizes")
    save_tiny_llama(path)
    return path


def test_explicit_capture_sizes_reach_the_runner(checkpoint, monkeypatch):
    # run_steps: three decodes (steps 1-3), then two (steps 4-6); max_num_seqs 8.
    expected = run_steps(make_runner(checkpoint, monkeypatch))
    runner = make_runner(checkpoint, monkeypatch, cudagraph_capture_sizes=(1, 3, 16))
    runner.capture_model(graph_factory=ReplayingGraph)
    assert runner.decode_graphs.sizes == [1, 3]  # 16 is past max_num_seqs
    assert run_steps(runner) == expected
    assert runner.decode_graphs.num_replays == 6  # 3 replays size 3, 2 pads to 3
    runner = make_runner(
        checkpoint, monkeypatch, compilation_config={"cudagraph_capture_sizes": [2]}
    )
    runner.capture_model(graph_factory=ReplayingGraph)
    assert runner.decode_graphs.sizes == [2]
    assert run_steps(runner) == expected
    assert runner.decode_graphs.num_replays == 3  # three decodes run eagerly
