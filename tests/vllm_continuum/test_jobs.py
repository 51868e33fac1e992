"""The one job-key rule: our engine's request, SamplingParams and the server's request
models follow it, and so does the upstream plugin (tests_upstream/test_plugin.py)."""

from __future__ import annotations

import pytest

from vllm.entrypoints.openai.protocol import ChatCompletionRequest
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request
from vllm_continuum.jobs import job_key, validate_job_id


def test_a_job_id_names_the_job_and_none_makes_the_request_its_own():
    assert job_key("j1", "r7") == "j1"
    assert job_key(None, "r7") == "request:r7"
    assert validate_job_id(None) is None and validate_job_id("j1") == "j1"


@pytest.mark.parametrize("bad", ["", 5, ["x"], True])
def test_an_empty_or_non_string_job_id_is_refused(bad):
    with pytest.raises(ValueError, match="job_id"):
        validate_job_id(bad)


def test_offline_an_empty_job_id_is_a_value_error_naming_it():
    with pytest.raises(VLLMValidationError, match="job_id must not be empty") as info:
        SamplingParams(extra_args={"job_id": ""})
    assert info.value.param == "job_id"


@pytest.mark.parametrize(
    "fields", [{"job_id": ""}, {"vllm_xargs": {"job_id": ""}}, {"extra_body": {"job_id": ""}}]
)
def test_on_the_server_an_empty_job_id_is_refused_from_each_place(fields):
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], **fields}
    )
    with pytest.raises(VLLMValidationError, match="job_id") as info:
        req.to_sampling_params(max_tokens=8, logprobs=None, stream=False)
    assert info.value.param == "job_id"  # the server's 400 names it


def test_the_engine_request_keys_its_job_by_the_same_rule():
    named = Request("r1", [1, 2], SamplingParams(extra_args={"job_id": "j1"}))
    alone = Request("r2", [1, 2], SamplingParams())
    assert (named.job_key, alone.job_key) == (job_key("j1", "r1"), job_key(None, "r2"))
