"""The folders whose tests take no services lock (``tests.support.services_lock.SERVICELESS``) use no shared
service: while an exclusive test has PostgreSQL or RabbitMQ down, they run on beside it."""

from __future__ import annotations

import re

from tests.support.paths import ROOT
from tests.support.services_lock import SERVICELESS

# the fixtures that hand out the shared services, their addresses, and the modules that reach them
SERVICE = re.compile(r"\b(pg_url|queue_prefix|any_settings|broker_users|s3_endpoint|s3_url|AMQP_URL|PG_ADMIN_URL)\b"
                     r"|postgresql(\+\w+)?://|amqp://|:5432\b|:5672\b|tests\.support\.(rabbitmq|s3_server)")


def services_named(text: str) -> set[str]:
    return {m.group(0) for m in SERVICE.finditer(text)}


def test_a_service_is_found_where_a_test_names_one():
    assert services_named("def test_x(pg_url, tmp_path):") == {"pg_url"}
    assert services_named('url = "postgresql+psycopg://127.0.0.1:5432/x"') == {"postgresql+psycopg://", ":5432"}
    assert services_named("from tests.support.rabbitmq import publish") == {"tests.support.rabbitmq"}
    assert not services_named('database_url=f"sqlite:///{tmp_path}", queue="embedded"')


def test_the_folders_without_the_services_lock_name_no_service():
    named = {str(path.relative_to(ROOT)): found for folder in SERVICELESS for path in folder.rglob("*.py")
             if (found := services_named(path.read_text()))}
    assert not named, f"these tests use a shared service: take their folder out of SERVICELESS or move them: {named}"
