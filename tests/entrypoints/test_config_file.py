"""``vllm serve --config FILE.yaml`` (vLLM's): flags from a YAML file, the command line
winning; bad files are clear errors naming the file and the key."""

from __future__ import annotations

import pytest

from vllm.entrypoints.cli.config_file import expand
from vllm.entrypoints.cli.main import make_parser
from vllm.entrypoints.openai.cli_args import FrontendArgs


def parse(argv: list[str]):
    return make_parser().parse_args(["serve", *expand(argv, serve_parser())])


def serve_parser():
    return make_parser().serve_parser


def write(tmp_path, text: str, name: str = "config.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


CONFIG = """
port: 8123
max_model_len: 2048
scheduling-policy: continuum
enable-prefix-caching: false
allow-credentials: true
allowed-origins: [https://a.example, https://b.example]
speculative-config:
  method: ngram
  num_speculative_tokens: 3
served-model-name: [agent-model]
"""


def test_the_file_s_flags_are_taken_and_the_command_line_wins(tmp_path):
    path = write(tmp_path, CONFIG)
    args = parse(["--config", path])
    assert (args.port, args.max_model_len, args.scheduling_policy) == (8123, 2048, "continuum")
    assert args.enable_prefix_caching is False and args.allow_credentials is True
    origins = FrontendArgs.from_cli_args(args).allowed_origins
    assert list(origins) == ["https://a.example", "https://b.example"]
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 3}
    over = parse(["my-model", "--config", path, "--port", "9000", "--enable-prefix-caching"])
    assert (over.port, over.max_model_len, over.model_tag) == (9000, 2048, "my-model")
    assert over.enable_prefix_caching is True
    # The positional model is not swallowed by a flag of several values from the file.
    assert parse([f"--config={path}", "m"]).model_tag == "m"
    assert list(parse(["m", "--config", path]).served_model_name) == ["agent-model"]


def test_the_file_may_name_the_model(tmp_path):
    args = parse(["--config", write(tmp_path, "model: SmolLM2-135M-Instruct\n")])
    assert args.model == "SmolLM2-135M-Instruct" and args.model_tag is None


@pytest.mark.parametrize(
    "text, name, message",
    [
        ("port: 1\n", "config.json", "must be YAML"),
        ("- port\n", "config.yaml", "mapping"),
        ("no-such-flag: 3\n", "config.yaml", "unknown flag 'no-such-flag'"),
        ("port: [1\n", "config.yaml", "not valid YAML"),
        ("port:\n", "config.yaml", "port has no value"),
        ("config: other.yaml\n", "config.yaml", "unknown flag 'config'"),
    ],
)
def test_a_bad_file_is_an_error_naming_it(tmp_path, text, name, message):
    path = write(tmp_path, text, name)
    with pytest.raises(ValueError, match=message) as info:
        expand(["--config", path], serve_parser())
    assert path in str(info.value)


def test_a_missing_file_or_value_and_two_files_are_errors(tmp_path):
    with pytest.raises(ValueError, match="No such file"):
        expand(["--config", str(tmp_path / "absent.yaml")], serve_parser())
    with pytest.raises(ValueError, match="needs a YAML file"):
        expand(["--config"], serve_parser())
    path = write(tmp_path, "port: 1\n")
    with pytest.raises(ValueError, match="more than once"):
        expand(["--config", path, f"--config={path}"], serve_parser())


def test_the_cli_reports_a_bad_file_as_a_usage_error(tmp_path, capsys):
    from vllm.entrypoints.cli.main import main

    with pytest.raises(SystemExit) as info:
        main(["serve", "--config", write(tmp_path, "bogus: 1\n")])
    assert info.value.code == 2
    assert "unknown flag 'bogus'" in capsys.readouterr().err
