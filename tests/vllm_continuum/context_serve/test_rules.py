"""Layer 1: the rule table on real agent commands (mini-swe-agent / SWE-agent style)."""

from __future__ import annotations

import json

import pytest

from vllm_continuum.context_serve.config import ContextServeConfig
from vllm_continuum.context_serve.predictor import ContextAwarePredictor
from vllm_continuum.context_serve.rules import RuleTable, learning_key
from vllm_continuum.context_serve.shell import command_names
from vllm_continuum.context_serve.types import Layer, ToolSpeed
from vllm_continuum.tool_calls import ToolCallParser

F, S, U = ToolSpeed.FAST, ToolSpeed.SLOW, None

COMMANDS = [
    ("ls", F),
    ("ls -la /testbed", F),
    ("pwd", F),
    ("cat setup.py", F),
    ("cat -n src/flask/app.py | sed -n '100,140p'", F),
    ("head -50 README.rst", F),
    ("tail -n 20 /tmp/log.txt", F),
    ("grep -n 'def get_response' django/core/handlers/base.py", F),
    ("grep -rn 'TODO' . | head -20", F),
    ("find . -name '*.py' -path '*migrations*' | head", F),
    ("sed -n '1,80p' sympy/core/numbers.py", F),
    ("sed -i 's/foo/bar/g' src/utils.py", F),
    ("wc -l astropy/io/fits/*.py", F),
    ("git status", F),
    ("git diff", F),
    ("git log --oneline -5", F),
    ("cd /testbed && git diff HEAD -- src/", F),
    ("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && git add -A && git diff --cached", F),
    ("cd /testbed; ls tests/ | head -30", F),
    ("cat <<'EOF' > /testbed/reproduce.py\nimport make\nprint('pytest')\nEOF", F),
    ("mkdir -p tests/fixtures && touch tests/fixtures/__init__.py", F),
    ("for f in src/*.py; do wc -l $f; done", F),
    ("if [ -f setup.cfg ]; then cat setup.cfg; fi", F),
    ("ls > /dev/null 2>&1 && echo ok", F),
    ("pip show requests", F),
    ("pytest", S),
    ("python -m pytest tests/ -x -q", S),
    ("cd /testbed && python -m pytest tests/test_ext.py -k regression 2>&1 | tail -30", U),
    ("python -m pytest -x -q tests/test_cache.py", U),  # one file, not a suite
    ("pytest tests/test_api.py::TestClient::test_get -q", U),
    ("go test ./pkg/... -run TestParse", U),
    ("pytest tests/test_a.py && make", S),  # a targeted run next to a build
    ("cd /repo && pytest -q tests/unit | tail -5", S),
    ("make", S),
    ("timeout 30 make", S),
    ("timeout 600 make -j4 test 2>&1 | tail", S),
    ("pip install -e .", S),
    ("pip install -r requirements.txt && pytest", S),
    ("sudo apt-get install -y libxml2-dev", S),
    ("npm install", S),
    ("npm test -- --watchAll=false", S),
    ("docker build -t app .", S),
    ("cargo build --release", S),
    ("go test ./...", S),
    ("mvn -q package", S),
    ("./gradlew test", S),
    ("python tests/runtests.py admin_views --parallel 1", S),
    ("python setup.py build_ext --inplace", S),
    ("git clone https://github.com/psf/requests.git", S),
    ("cat <<'EOF' > patch.py\nx = 1\nEOF\npip install -e . && python patch.py", S),
    ("ls && make", S),  # the slowest part decides
    ("python reproduce.py", U),
    ("python -c 'import django; print(django.VERSION)'", U),
    ("./run_experiment.sh --fast", U),
    ("curl -s http://localhost:8000/health", U),
    ("ls && python reproduce.py", U),  # one unknown part: not surely fast
]


@pytest.mark.parametrize(("command", "expected"), COMMANDS)
def test_rule_table_on_agent_commands(command, expected):
    table = RuleTable.default()
    call = ToolCallParser().parse(f"Let me check.\n```bash\n{command}\n```")
    assert call is not None
    assert table.classify(call.name, call.command) == expected


def test_there_are_forty_commands_or_more():
    assert len(COMMANDS) >= 40


def test_heredoc_bodies_and_redirections_are_not_commands():
    snippet = "cat > t.py <<EOF\nmake all\npytest\nEOF\npython t.py 2>&1 | tail -3"
    assert command_names(snippet) == ("cat", "t.py", "tail")


def test_targeted_test_runs_learn_under_their_own_name():
    assert learning_key("pytest", "python -m pytest -x -q tests/test_cache.py") == "pytest <target>"
    assert learning_key("pytest", "cd /r && pytest -k 'cache and not slow'") == "pytest <target>"
    assert learning_key("pytest", "python -m pytest tests/") == "pytest"
    assert learning_key("make", "make -j2 && pytest a.py") == "make"  # the call's own tool


def test_the_predictor_keeps_suites_and_targeted_runs_apart():
    predictor = ContextAwarePredictor(ContextServeConfig(min_observations=3))
    for _ in range(5):
        predictor.observe("pytest", "python -m pytest tests/test_cache.py", 0.5)
    assert predictor.predict("pytest", "python -m pytest tests/").speed == S  # rules: a suite
    fast = predictor.predict("pytest", "python -m pytest tests/test_io.py")
    assert fast.speed == F and fast.layer == Layer.BAYES


def test_function_call_tools_are_judged_by_name():
    table = RuleTable.default()
    args = json.dumps({"path": "/testbed/x.py", "command": None})
    assert table.classify("str_replace_editor", args) == F
    assert table.classify("web_search", args) is None


def test_user_file_extends_and_overrides(tmp_path):
    path = tmp_path / "rules.yaml"
    path.write_text("fast:\n  - make\n  - jq\nslow_prefixes:\n  - python reproduce.py\n  - ls\n")
    table = RuleTable.from_file(str(path))
    assert table.classify_name("make") == F and table.classify_name("jq") == F
    assert table.classify_name("ls") == S and table.classify_name("pytest") == S
    js = tmp_path / "rules.json"
    js.write_text(json.dumps({"fast": ["python"]}))
    assert RuleTable.from_file(str(js)).classify_name("python") == F


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (None, "cannot read"),
        ("fast: [unclosed", "cannot read"),
        ("- just a list", "mapping"),
        ("fast: 3", "lists of strings"),
        ("other: []", "mapping"),
    ],
)
def test_bad_rule_files_are_one_line_errors(tmp_path, content, match):
    path = tmp_path / "rules.yaml"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=f"context_serve rules.*{match}") as info:
        RuleTable.from_file(str(path))
    assert "\n" not in str(info.value)
