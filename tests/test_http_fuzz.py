"""The HTTP API fuzzed from its own OpenAPI document (schemathesis): whatever a client sends to any
route, with a valid key or without, the answer is never a 500, and every answer is what the
document says (status codes, and bodies against their schemas)."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,
                                              status_code_conformance)

from jobs.http.app import create_app
from jobs.http.tasks import Tasks
from tests.http_support import embedded_settings, key_for
from tests.jobs_support import write_requests

MAX_EXAMPLES = 25


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory, tiny_llama_dir):
    tmp = tmp_path_factory.mktemp("fuzz")
    s = embedded_settings(tiny_llama_dir, tmp, max_file_bytes="256KiB")
    key = key_for(s, "fuzzer")
    tasks = Tasks(s)
    app = create_app(s, tasks=tasks)
    from starlette.testclient import TestClient

    with TestClient(app, raise_server_exceptions=False) as c:  # a real file and batch for the ids to find
        auth = {"Authorization": f"Bearer {key}"}
        body = write_requests(tmp / "r.jsonl", 2).read_bytes()
        file_id = c.post("/v1/files", headers=auth, files={"file": ("r.jsonl", body)},
                         data={"purpose": "batch"}).json()["id"]
        batch = c.post("/v1/batches", headers=auth, json={"input_file_id": file_id, "endpoint": "/v1/completions",
                                                          "completion_window": "24h"})
    known = {"file_id": file_id, "batch_id": batch.json()["id"], "model_id": "tiny-llama"}
    yield app, key, known
    tasks.close()


@pytest.fixture(scope="module")
def operations(fuzzed):
    app, _, _ = fuzzed
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    found = [result.ok() for result in schema.get_all_operations()]
    assert len(found) >= 12, [f"{op.method} {op.path}" for op in found]
    return found


def _fuzz(operation, mode: GenerationMode, examples: int, headers: dict, check, known: dict | None = None) -> None:
    """Run ``examples`` cases of the operation; with ``known``, half of them name ids that exist."""
    @given(case=operation.as_strategy(generation_mode=mode), real=st.booleans())
    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def run(case, real):
        if known and real and case.path_parameters:
            case.path_parameters = {k: known.get(k, v) for k, v in case.path_parameters.items()}
        response = case.call(headers=headers)
        assert response.status_code < 500, (case.method, case.formatted_path, case.query, case.body,
                                            response.status_code, response.text[:500])
        check(case, response)

    run()


@pytest.mark.parametrize("mode", list(GenerationMode), ids=lambda m: m.value)
def test_no_answer_is_a_server_error(operations, fuzzed, mode):
    """Valid and invalid requests (schemathesis's positive and negative modes) with a valid key, to
    every operation: never a 500, and a valid request's answer conforms to the document."""
    _, key, known = fuzzed

    def conforms(case, response):
        if mode is GenerationMode.POSITIVE:
            case.validate_response(response, checks=[not_a_server_error, status_code_conformance,
                                                     content_type_conformance, response_schema_conformance])

    for operation in operations:
        _fuzz(operation, mode, MAX_EXAMPLES, {"Authorization": f"Bearer {key}"}, conforms, known)


def test_without_a_key_every_route_is_401(operations):
    def unauthorized(case, response):
        if case.path != "/openapi.json":
            assert response.status_code == 401, (case.method, case.formatted_path, response.text[:300])
            assert response.json()["error"]["code"] == "invalid_api_key"

    for operation in operations:
        _fuzz(operation, GenerationMode.POSITIVE, 5, {}, unauthorized)
