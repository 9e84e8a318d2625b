"""Structured outputs at the door: every spelling of a constraint (OpenAI's ``response_format``,
vLLM's ``guided_*`` and ``structured_outputs``) becomes one ``StructuredOutput``; every wrong one is
a line error naming its field; the constraint survives the request row."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from sqlalchemy import select, update

from jobs import api
from jobs.hosting.database_ledger import JobsLedger
from jobs.lines.batch_format import LineError
from jobs.lines.structured_outputs import DEFAULT_LIMITS, StructuredLimits
from jobs.lines.validate import model_info
from jobs.records.db import open_database
from jobs.records.models import RequestRow
from tests.support.jobs_env import TINY_NAME, tiny_settings
from tests.support.structured import PERSON, PERSON_TEXT, structured_line, structured_of
from worker.config import Settings
from worker.engine.request import StructuredOutput
from worker.engine.structured.grammar import CompileRules
from worker.engine.structured.schema_bounds import SchemaBounds

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    return model_info(tiny_settings(tiny_llama_dir))


def _schema_format(schema, **more):
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, **more}}


@pytest.mark.parametrize("url, fields, expected", [
    (CHAT, {}, None),
    (CHAT, {"response_format": {"type": "text"}}, None),
    (CHAT, {"response_format": {"type": "json_object"}}, StructuredOutput("json_object")),
    (CHAT, {"response_format": _schema_format(PERSON, strict=True, description="a person")},
     StructuredOutput("json_schema", PERSON_TEXT)),
    (COMPLETIONS, {"guided_json": PERSON}, StructuredOutput("json_schema", PERSON_TEXT)),
    (CHAT, {"guided_json": json.dumps(PERSON, indent=2)}, StructuredOutput("json_schema", PERSON_TEXT)),
    (COMPLETIONS, {"guided_regex": r"\d{3}-\d{4}"}, StructuredOutput("regex", r"\d{3}-\d{4}")),
    (CHAT, {"guided_choice": ["yes", "no"]}, StructuredOutput("choice", '["yes","no"]')),
    (COMPLETIONS, {"guided_grammar": 'root ::= "a" | "b"'}, StructuredOutput("grammar", 'root ::= "a" | "b"')),
    (CHAT, {"structured_outputs": {"json": PERSON}}, StructuredOutput("json_schema", PERSON_TEXT)),
    (COMPLETIONS, {"structured_outputs": {"regex": "[a-z]+"}}, StructuredOutput("regex", "[a-z]+")),
    (CHAT, {"structured_outputs": {"choice": ["é", "b"]}}, StructuredOutput("choice", '["é","b"]')),
    (CHAT, {"structured_outputs": {"grammar": 'root ::= "x"'}}, StructuredOutput("grammar", 'root ::= "x"')),
    (CHAT, {"structured_outputs": {"json_object": True}}, StructuredOutput("json_object")),
    (CHAT, {"structured_outputs": {"json_object": False}}, None),
    (CHAT, {"guided_regex": None, "response_format": None}, None),
])
def test_each_spelling_becomes_one_constraint(model, url, fields, expected):
    assert structured_of(model, structured_line(url, **fields)) == expected


def _bad(param: str, says: str, **fields):
    return pytest.param(fields, param, says, id=param + ":" + says[:24])


@pytest.mark.parametrize("fields, param, says", [
    _bad("body.response_format.type", 'must be "text", "json_object" or "json_schema"',
         response_format={"type": "xml"}),
    _bad("body.response_format", "must be an object", response_format="json"),
    _bad("body.response_format.json_schema", "missing or not an object", response_format={"type": "json_schema"}),
    _bad("body.response_format.json_schema.name", "missing or not 1 to 64 letters",
         response_format={"type": "json_schema", "json_schema": {"schema": PERSON}}),
    _bad("body.response_format.json_schema.name", "missing or not 1 to 64 letters",
         response_format=_schema_format(PERSON) | {"json_schema": {"name": "a b", "schema": PERSON}}),
    _bad("body.response_format.json_schema.schema", "missing", response_format=_schema_format(None)),
    _bad("body.response_format.json_schema.strict", "true or false", response_format=_schema_format(PERSON, strict=1)),
    _bad("body.guided_regex", "one structured-output constraint, and this one comes with body.response_format",
         response_format={"type": "json_object"}, guided_regex="a+"),
    _bad("body.structured_outputs.regex", "comes with body.guided_json", guided_json=PERSON,
         structured_outputs={"regex": "a"}),
    _bad("body.structured_outputs.choice", "comes with body.structured_outputs.json",
         structured_outputs={"json": PERSON, "choice": ["a"]}),
    _bad("body.guided_regex", "the grammar library cannot compile it", guided_regex="(ab"),
    _bad("body.guided_grammar", "the grammar library cannot compile it", guided_grammar="root ::= undefined_rule"),
    _bad("body.guided_regex", "the regular expression matches no output", guided_regex="[^\\x00-\\U0010FFFF]"),
    _bad("body.guided_json", "not a valid JSON Schema: at $.type", guided_json={"type": "nope"}),
    _bad("body.response_format.json_schema.schema", "not a valid JSON Schema: at $.properties.age.minimum",
         response_format=_schema_format({"type": "object", "properties": {"age": {"minimum": "zero"}}})),
    _bad("body.guided_json", "not a valid JSON Schema: at $.properties.code.pattern",
         guided_json={"properties": {"code": {"type": "string", "pattern": "(unclosed"}}}),
    _bad("body.guided_json", "a string that is not JSON text", guided_json="{not json"),
    _bad("body.guided_json", "must be a JSON Schema object", guided_json=[1, 2]),
    _bad("body.guided_json", "the schema, as compact JSON, is 66,0", guided_json={"enum": ["x" * 66_000]}),
    _bad("body.guided_regex", "over the limit of 4,096 (BERTH_STRUCTURED_MAX_REGEX_BYTES)", guided_regex="a" * 4097),
    _bad("body.guided_choice", "257 choices, over the limit of 256 (BERTH_STRUCTURED_MAX_CHOICES)",
         guided_choice=[str(i) for i in range(257)]),
    _bad("body.guided_choice", "must be a non-empty list of non-empty strings", guided_choice="yes"),
    _bad("body.guided_choice", "must be a non-empty list of non-empty strings", guided_choice=["yes", 1]),
    _bad("body.guided_choice", "must be a non-empty list of non-empty strings", guided_choice=[]),
    _bad("body.guided_choice", "must be a non-empty list of non-empty strings", guided_choice=["yes", ""]),
    _bad("body.guided_regex", "must be a non-empty string", guided_regex=5),
    _bad("body.structured_outputs", "must be an object", structured_outputs=["json"]),
    _bad("body.structured_outputs.whitespace_pattern", "is not supported",
         structured_outputs={"whitespace_pattern": " ", "json": PERSON}),
    _bad("body.structured_outputs.json_object", "true or false", structured_outputs={"json_object": "yes"}),
    _bad("body.guided_json_object", 'response_format {"type": "json_object"}', guided_json_object=True),
    _bad("body.structural_tag", "is not supported", structural_tag={"structures": []}),
])
def test_a_bad_constraint_is_a_line_error_naming_its_field(model, fields, param, says):
    with pytest.raises(LineError) as e:
        structured_of(model, structured_line(**fields))
    error = e.value.to_error_line()["error"]
    assert (error["code"], error["param"]) == ("invalid_request", param), error
    assert error["message"].startswith(f"line 1: {param}: ") and says in error["message"], error


def test_the_limits_come_from_the_settings(model, monkeypatch):
    assert DEFAULT_LIMITS == StructuredLimits(64 << 10, 4 << 10, 64 << 10, 256, CompileRules(
        60.0, 2, 1, SchemaBounds(properties=2000, optional_properties=256, depth=32, enum_values=2000)))
    monkeypatch.setenv("BERTH_STRUCTURED_MAX_REGEX_BYTES", "1KiB")
    monkeypatch.setenv("BERTH_STRUCTURED_MAX_CHOICES", "2")
    small = replace(model, structured_limits=StructuredLimits.of(Settings()))
    assert structured_of(small, structured_line(guided_regex="a" * 1024)) == StructuredOutput("regex", "a" * 1024)
    with pytest.raises(LineError, match="over the limit of 1,024"):
        structured_of(small, structured_line(guided_regex="a" * 1025))
    with pytest.raises(LineError, match="3 choices, over the limit of 2"):
        structured_of(small, structured_line(guided_choice=["a", "b", "c"]))


def test_the_constraint_survives_the_request_row_and_old_rows_still_load(tmp_path, tiny_llama_dir, model):
    settings = tiny_settings(tiny_llama_dir, database_url=f"sqlite:///{tmp_path / 'berth.db'}",
                             storage_url=f"file://{tmp_path / 'store'}")
    lines = [structured_line(custom_id="choice", guided_choice=["yes", "no"]),
             structured_line(custom_id="schema", response_format=_schema_format(PERSON)),
             structured_line(custom_id="free")]
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    job = api.submit(path, settings, eager=True)
    db = open_database(settings.database_url)
    with db.session() as s:
        rows = s.scalars(select(RequestRow).where(RequestRow.job_id == job.id).order_by(RequestRow.line)).all()
        ids = [r.id for r in rows]
        assert [r.params["structured"] for r in rows] == [
            {"kind": "choice", "value": '["yes","no"]'}, {"kind": "json_schema", "value": PERSON_TEXT}, None]
    ledger = JobsLedger(settings, model.tokenizer, TINY_NAME, eager_tasks=True)
    claims = ledger.claim(ids, "w")
    assert [claims[i].params.structured for i in ids] == [
        StructuredOutput("choice", '["yes","no"]'), StructuredOutput("json_schema", PERSON_TEXT), None]

    with db.session() as s, s.begin():  # a row written before the field existed has no key
        old = {k: v for k, v in rows[2].params.items() if k != "structured"}
        s.execute(update(RequestRow).where(RequestRow.id == ids[2]).values(params=old))
        s.execute(update(RequestRow).where(RequestRow.id == ids[0]).values(
            params={**rows[0].params, "structured": {"kind": "xml", "value": ""}}))
    claims = ledger.claim(ids, "w")
    assert claims[ids[2]].params.structured is None
    assert claims[ids[2]].params.max_tokens == 8
    assert claims[ids[0]].params is None and "kind must be one of" in claims[ids[0]].unreadable
