"""Which tests take the services lock (``tests.support.services_lock``): those that may reach PostgreSQL or
RabbitMQ, by a fixture anywhere under them or by their module's text; the others run on beside a test that
has a service down."""

from __future__ import annotations

from tests.support.paths import ROOT
from tests.support.services_lock import needs_services, services_named


def test_a_service_is_found_where_a_test_names_one():
    assert services_named("def test_x(pg_url, tmp_path):") == {"pg_url"}
    assert services_named('url = "postgresql+psycopg://127.0.0.1:5432/x"') == {"postgresql+psycopg://", ":5432"}
    assert services_named("from tests.support.rabbitmq import publish") == {"tests.support.rabbitmq"}
    assert services_named('request.getfixturevalue("queue_prefix")') == {"queue_prefix"}
    assert not services_named('database_url=f"sqlite:///{tmp_path}", queue="embedded"')


def test_a_test_needs_the_services_by_its_fixtures_closure_or_its_modules_text():
    embedded = ROOT / "tests" / "system" / "test_embedded_crash.py"  # SQLite, the embedded queue, a folder
    outages = ROOT / "tests" / "system" / "test_outages.py"
    assert not needs_services({"tmp_path", "tiny_llama_dir", "_services_lock"}, embedded)
    assert needs_services({"tmp_path", "tiny_llama_dir", "pg_url"}, embedded)  # through a fixture it uses
    assert needs_services({"tmp_path"}, outages)  # its module names a service


def test_a_case_parametrized_onto_sqlite_runs_without_the_services():
    migration = ROOT / "tests" / "migrations" / "test_migration_0009.py"  # names PostgreSQL for its other case
    assert not needs_services({"tmp_path", "request"}, migration, {"backend": "sqlite"})
    assert needs_services({"tmp_path", "request"}, migration, {"backend": "postgresql"})
    assert not needs_services({"any_settings", "tmp_path"}, migration, {"any_settings": "sqlite"})
    assert needs_services({"any_settings", "pg_url"}, migration, {"any_settings": "postgresql"})
    assert needs_services({"pg_url", "tmp_path"}, migration, {"backend": "sqlite"})  # a fixture it holds counts
