"""Layer 3: command features, a model that learns a fast/slow split, the background
trainer (never blocks, survives errors), and loading a model file."""

from __future__ import annotations

import threading
import time

import pytest

from vllm_continuum.context_serve.config import ContextServeConfig
from vllm_continuum.context_serve.features import (
    FEATURE_NAMES,
    command_features,
    feature_matrix,
)
from vllm_continuum.context_serve.types import Layer, ToolSpeed
from vllm_continuum.context_serve.xgb import (
    FAST_CLASS,
    MIDDLE_CLASS,
    XGBoostLayer,
    XGBoostModel,
    train_model,
)


def feats(command: str) -> dict[str, float]:
    return dict(zip(FEATURE_NAMES, command_features(command), strict=True))


def test_about_25_features_on_real_commands():
    assert 25 <= len(FEATURE_NAMES) <= 32
    f = feats("cd /testbed && python -m pytest tests/ -x 2>&1 | tail -20")
    assert f["num_and"] == 1 and f["num_pipes"] == 1 and f["num_redirects"] == 1
    assert f["num_commands"] == 3 and f["kw_test"] == 1 and f["kw_python"] == 1
    assert f["has_slow_name"] == 1 and f["num_paths"] == 2  # /testbed, tests/
    f = feats("grep -rn 'TODO' src/ | head -5")
    assert f["has_recursive"] == 1 and f["kw_search"] == 1 and f["frac_fast_names"] == 1
    f = feats("for f in *.py; do timeout 30 wc -l $f; done")
    assert f["kw_loop"] == 1 and f["has_glob"] == 1 and f["timeout_s"] == 30
    f = feats("cat <<'EOF' > a.py\nx = $(date)\nEOF\nsudo pip install -e . && curl -O http://x")
    assert f["has_heredoc"] == 1 and f["has_subshell"] == 1 and f["has_sudo"] == 1
    assert f["kw_install"] == 1 and f["kw_network"] == 1 and f["num_lines"] == 2
    assert feats("")["length"] == 0  # degenerate input: zeros, no exception


FAST_CMDS = ["ls -la", "cat a.py", "git status", "head -5 x", "grep -n foo bar.py", "pwd"]
SLOW_CMDS = ["make -j8", "pytest tests/", "pip install -e .", "cargo build", "npm install"]


MIDDLE_CMDS = ["pytest -q tests/test_m{i}.py", "pytest tests/test_api.py::test_{i}"]


def synthetic(n: int = 120, middle: bool = False):
    """Fast and slow commands alternating (and every third one in between if ``middle``)."""
    commands, durations = [], []
    for i in range(n):
        if middle and i % 3 == 0:
            commands.append(MIDDLE_CMDS[i % len(MIDDLE_CMDS)].format(i=i))
            durations.append(3.0 + (i % 4) * 0.5)
        elif i % 2:
            commands.append(FAST_CMDS[i % len(FAST_CMDS)] + f" f{i}")
            durations.append(0.1 + 0.01 * (i % 7))
        else:
            commands.append(SLOW_CMDS[i % len(SLOW_CMDS)] + f" t{i}")
            durations.append(20.0 + i % 11)
    return commands, durations


def test_model_learns_a_fast_slow_split():
    config = ContextServeConfig()
    model = train_model(*synthetic(), config)
    for command in ("ls src/", "cat setup.cfg"):
        p_fast, p_slow = model.probabilities(command)
        assert p_fast > 0.8 and p_slow < 0.2
        assert model.predicted_class(command) == FAST_CLASS
    for command in ("make all", "pip install numpy"):
        p_fast, p_slow = model.probabilities(command)
        assert p_fast < 0.2 and p_slow > 0.8
    assert train_model(["ls"] * 10, [0.1] * 10, config) is None  # one class: nothing to learn


def test_model_learns_the_class_between_the_thresholds():
    """A targeted test run (3-4.5 s) is neither FAST nor SLOW: the layer says UNCERTAIN."""
    config = ContextServeConfig()
    xgb = XGBoostLayer(config, train_model(*synthetic(180, middle=True), config))
    assert xgb.model.predicted_class("pytest -q tests/test_models.py") == MIDDLE_CLASS
    assert xgb.predict("pytest -q tests/test_models.py").speed == ToolSpeed.UNCERTAIN
    assert xgb.predict("pytest tests/").speed == ToolSpeed.SLOW
    assert xgb.predict("ls -la").speed == ToolSpeed.FAST


def test_saved_model_loads_and_bad_files_are_one_line_errors(tmp_path):
    model = train_model(*synthetic(), ContextServeConfig())
    path = tmp_path / "model.json"
    model.save(str(path))
    loaded = XGBoostModel.load(str(path))
    assert loaded.probabilities("make test") == pytest.approx(model.probabilities("make test"))
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not a model")
    for bad in (tmp_path / "missing.json", garbage):
        with pytest.raises(ValueError, match="context_serve model: cannot load") as info:
            XGBoostModel.load(str(bad))
        assert "\n" not in str(info.value)


def test_a_binary_model_of_an_older_version_is_refused(tmp_path):
    import xgboost

    commands, durations = synthetic()
    data = xgboost.DMatrix(feature_matrix(commands), label=[d < 2 for d in durations],
                           feature_names=list(FEATURE_NAMES))  # fmt: skip
    path = tmp_path / "binary.json"
    xgboost.train({"objective": "binary:logistic"}, data, num_boost_round=2).save_model(path)
    with pytest.raises(ValueError, match="is not a 3-class model"):
        XGBoostModel.load(str(path))


def test_layer_trains_in_background_and_swaps_the_model():
    config = ContextServeConfig(min_train_samples=20, retrain_every=20)
    xgb = XGBoostLayer(config)
    assert xgb.predict("make") is None  # no model yet
    for c, d in zip(*synthetic(40), strict=True):
        xgb.observe(c, d)
    xgb.wait(timeout=30)
    assert xgb.trainings == 1 and xgb.model is not None
    verdict = xgb.predict("make install")
    assert verdict.layer == Layer.XGBOOST and verdict.speed == ToolSpeed.SLOW
    assert xgb.predict("ls -la docs").speed == ToolSpeed.FAST


def test_trainer_never_blocks_and_survives_an_error():
    started, release = threading.Event(), threading.Event()
    calls = []

    def slow_then_broken(commands, durations, config):
        calls.append(len(commands))
        started.set()
        release.wait(10)
        raise RuntimeError("boom")

    config = ContextServeConfig(min_train_samples=5, retrain_every=5)
    xgb = XGBoostLayer(config, None, slow_then_broken)
    t0 = time.perf_counter()
    for i in range(50):  # 10 trigger points while the first training hangs
        xgb.observe(f"cmd {i}", float(i))
    assert time.perf_counter() - t0 < 0.5 and started.wait(5)
    assert xgb.training and calls == [5]  # no second thread while one runs
    release.set()
    xgb.wait(timeout=5)
    assert xgb.failures == 1 and xgb.model is None
    xgb.trainer = train_model
    for c, d in zip(*synthetic(10), strict=True):
        xgb.observe(c, d)  # the next training works
    xgb.wait(timeout=30)
    assert xgb.trainings == 1 and xgb.model is not None
