"""Schema fuzzing (schemathesis) against a live server: no 5xx, and every response as
/openapi.json describes it (status, content type, body), for a bounded number of
examples per operation and generation mode, with a fixed seed (issue 16).

Schema-valid requests may still be refused (400) for what a schema cannot say: a prompt
longer than max_model_len in tokens, max_tokens past the context. So "valid data must be
accepted" is not checked; the constraints the schema can state are (test_openapi.py).

The server's limits are small so that every generated request is cheap: a short context
(few tokens to generate) and n at most 2.
"""

from __future__ import annotations

import pytest

from ...utils import RemoteServer

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, seed, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.specs.openapi.checks import positive_data_acceptance  # noqa: E402

pytestmark = pytest.mark.slow
MAX_EXAMPLES = 20


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer(
        "--num-gpu-blocks-override", "64", "--max-model-len", "64", "--max-n-sequences", "2",
        "--enable-scale-out",  # the tokens routes, /render and /derender too
    )  # fmt: skip
    try:
        yield srv
    finally:
        srv.stop()


def _operations(server):
    schema = schemathesis.openapi.from_url(server.base + "/openapi.json")
    schema.config.base_url = server.base
    return [result.ok() for result in schema.get_all_operations()]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_api_conforms_to_its_schema(server, mode):
    failures = []
    operations = _operations(server)
    assert {op.label for op in operations} >= {
        "GET /health",
        "GET /metrics",
        "POST /v1/chat/completions",
        "POST /v1/completions",
    }
    for operation in operations:
        if mode is GenerationMode.NEGATIVE and (
            operation.method.upper() != "POST" or not len(operation.body)
        ):
            continue  # nothing to get wrong in a GET, or a POST without a body (/ping)

        @seed(16)
        @settings(
            max_examples=MAX_EXAMPLES,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy(generation_mode=mode))
        def run(case):
            case.call_and_validate(
                base_url=server.base, timeout=60, excluded_checks=[positive_data_acceptance]
            )

        try:
            run()
        except Exception as e:  # one report per operation, then the next operation
            failures.append(f"{operation.label}: {e}")
    assert not failures, "\n\n".join(failures)
