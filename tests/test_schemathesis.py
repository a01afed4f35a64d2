"""Property-based requests generated from the server's own OpenAPI document (schemathesis): any
request the schema admits, and many it does not, gets an answer below 500, in time, in OpenAI's
error shape when refused; afterwards nothing is left running and no KV block is held."""

from __future__ import annotations

import time

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from tests.server_util import ServerProcess

KEY = "schema-key"
EXAMPLES = 15  # per operation in CI; the slow run below takes many more


@pytest.fixture(scope="module")
def api_server():
    # a short context bounds the work any generated request can ask for
    limits = ("--max-model-len", "64", "--max-num-seqs", "8", "--max-waiting-requests", "64")
    srv = ServerProcess("--api-key", KEY, *limits)
    yield srv
    if srv.proc.poll() is None:
        assert srv.terminate() == 0


def _operations(api_server):
    schema = schemathesis.openapi.from_url(f"{api_server.base_url}/openapi.json")
    ops = [result.ok() for result in schema.get_all_operations()]
    ours = {"POST /v1/completions", "POST /v1/chat/completions", "POST /v1/responses"}
    assert {f"{op.method.upper()} {op.path}" for op in ops} >= ours
    return ops


def _check(case, api_server) -> None:
    response = case.call(base_url=api_server.base_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["code"] == response.status_code and isinstance(error["message"], str)


def _run(api_server, examples: int) -> None:
    for op in _operations(api_server):

        @given(case=op.as_strategy(GenerationMode.POSITIVE) | op.as_strategy(GenerationMode.NEGATIVE))
        @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def each(case):
            _check(case, api_server)

        each()


def test_generated_requests_never_get_a_5xx(api_server):
    _run(api_server, EXAMPLES)


@pytest.mark.slow
def test_generated_requests_never_get_a_5xx_many(api_server):
    _run(api_server, 300)


def test_after_the_generated_requests_nothing_is_held(api_server):
    deadline = time.time() + 60
    while time.time() < deadline:
        if api_server.metric("baton_num_requests_running") == 0 and api_server.metric("baton_kv_blocks_used") == 0:
            break
        time.sleep(0.2)
    assert api_server.metric("baton_kv_blocks_used") == 0
    assert api_server.metric("baton_engine_step_failures_total") == 0
