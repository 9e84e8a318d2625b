"""The schema comes from the migrations alone, the same on SQLite and PostgreSQL."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from click.testing import CliRunner
from sqlalchemy import text

from jobs.cli import main
from jobs.records.db import SchemaError, close_database, head_revision, make_engine, open_database
from jobs.records.models import Base


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_berth_db_upgrade_makes_exactly_the_models_schema(backend, tmp_path, request):
    url = f"sqlite:///{tmp_path / 'berth.db'}" if backend == "sqlite" else request.getfixturevalue("pg_url")
    result = CliRunner().invoke(main, ["db", "upgrade", "--database-url", url])
    assert result.exit_code == 0 and f"database at migration {head_revision()}" in result.output, result.output
    engine = make_engine(url)
    with engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"compare_type": True})
        assert compare_metadata(context, Base.metadata) == []
    engine.dispose()
    open_database(url)  # at head: opens
    close_database(url)


def test_a_database_not_made_by_berth_is_refused_with_what_to_run(tmp_path):
    url = f"sqlite:///{tmp_path / 'other.db'}"
    engine = make_engine(url)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE something_else (id INTEGER)"))
    engine.dispose()
    with pytest.raises(SchemaError, match="run `berth db upgrade`"):
        open_database(url)


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_the_schema_check_without_alembic_agrees_with_alembic(backend, tmp_path, request):
    """``open_database`` reads the head and the database's revision itself (Alembic costs a read-only
    command more than the command); Alembic must read the same."""
    from alembic.script import ScriptDirectory

    from jobs.records.db import alembic_config, schema_revision, upgrade

    assert head_revision() == ScriptDirectory.from_config(alembic_config()).get_current_head()
    url = f"sqlite:///{tmp_path / 'berth.db'}" if backend == "sqlite" else request.getfixturevalue("pg_url")
    engine = make_engine(url)
    assert schema_revision(engine) is None
    for revision in ("0001", "head"):
        upgrade(engine, revision)
        with engine.connect() as conn:
            assert schema_revision(engine) == MigrationContext.configure(conn).get_current_revision()
    assert schema_revision(engine) == head_revision()
    engine.dispose()


def test_the_default_relative_database_is_the_one_in_the_current_directory(tmp_path, monkeypatch):
    """``sqlite:///./berth.db`` means the directory the process is in when it opens it: a process
    that opened it in one directory and moved to another (a test run, `berth` driven as a library)
    must not go on writing the first one's file."""
    url = "sqlite:///./berth.db"
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    monkeypatch.chdir(first)
    a = open_database(url)
    monkeypatch.chdir(second)
    b = open_database(url)
    try:
        assert a is not b and (second / "berth.db").exists()
        assert a.url == f"sqlite:///{first / 'berth.db'}"
    finally:
        close_database(a.url)
        close_database(b.url)
