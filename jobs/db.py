"""The jobs database: one engine per URL and process, and its schema through Alembic.

    db = open_database(settings.database_url)   # applies the migrations when the database is empty
    with db.session() as s, s.begin():
        ...

The schema comes only from ``migrations/``; ``upgrade(url)`` (``berth db upgrade``) applies them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import Engine, create_engine, event, inspect
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

MIGRATION_WAIT = 60.0  # seconds to wait for another process migrating the same empty database


class SchemaError(RuntimeError):
    """The database's schema is not the one this code needs; the message says what to run."""


@dataclass(frozen=True)
class Database:
    url: str
    engine: Engine
    session: sessionmaker[Session]


def normalize_url(url: str) -> str:
    """``postgresql://`` means psycopg 3 here (the driver berth installs), not psycopg2."""
    for plain in ("postgresql://", "postgres://"):
        if url.startswith(plain):
            return "postgresql+psycopg://" + url[len(plain):]
    return url


def make_engine(url: str) -> Engine:
    url = normalize_url(url)
    if not url.startswith("sqlite"):
        return create_engine(url, pool_pre_ping=True)
    engine = create_engine(url, connect_args={"timeout": 60})

    @event.listens_for(engine, "connect")
    def _sqlite_pragmas(dbapi_connection, _record):  # several processes share the file: WAL, FKs on
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    return engine


_open: dict[str, Database] = {}


def open_database(url: str, migrate_if_empty: bool = True) -> Database:
    """The database at ``url`` (one engine per process), checked to be at the newest migration;
    an empty database gets the migrations applied."""
    url = normalize_url(url)
    if url in _open:
        return _open[url]
    engine = make_engine(url)
    current, head = schema_revision(engine), head_revision()
    if current is None and migrate_if_empty:
        if inspect(engine).get_table_names():  # another process may have just committed the migrations
            current = schema_revision(engine)
        else:
            current = _migrate_empty(engine, head)
    if current != head:
        engine.dispose()
        raise SchemaError(f"the database {engine.url.render_as_string(hide_password=True)} is at migration "
                          f"{current or 'none'}, this berth needs {head}: run `berth db upgrade`")
    _open[url] = db = Database(url, engine, sessionmaker(engine, expire_on_commit=False))
    return db


def _migrate_empty(engine: Engine, head: str) -> str | None:
    """Apply the migrations to an empty database; if another process does at the same moment
    (workers starting together), wait for it to finish instead."""
    try:
        return upgrade(engine)
    except DBAPIError:
        deadline = time.monotonic() + MIGRATION_WAIT
        while (current := schema_revision(engine)) != head and time.monotonic() < deadline:
            time.sleep(0.5)
        if current != head:
            raise
        return current


def close_database(url: str) -> None:
    """Close this process's connections to ``url`` (before the database itself is dropped)."""
    db = _open.pop(normalize_url(url), None)
    if db is not None:
        db.engine.dispose()


def alembic_config(connection=None):
    from alembic.config import Config

    import migrations

    cfg = Config()
    cfg.set_main_option("script_location", str(Path(migrations.__file__).parent))
    cfg.attributes["connection"] = connection
    return cfg


def head_revision() -> str:
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def schema_revision(engine: Engine) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def upgrade(target: str | Engine, revision: str = "head") -> str:
    """Apply the migrations up to ``revision``; returns the revision the database is at."""
    from alembic import command

    engine = make_engine(target) if isinstance(target, str) else target
    with engine.connect() as conn:
        sqlite = conn.dialect.name == "sqlite"
        if sqlite:
            # A batch migration on SQLite recreates a table (copy, drop the old, rename): with foreign keys
            # enforced, dropping the old table cascades to every row referencing it (0002 recreating
            # ``requests`` deleted every result). Off for the migration (only possible outside a
            # transaction), and every reference checked before it commits.
            conn.exec_driver_sql("PRAGMA foreign_keys=OFF")
            conn.commit()
        try:
            with conn.begin():
                command.upgrade(alembic_config(conn), revision)
                if sqlite and (broken := conn.exec_driver_sql("PRAGMA foreign_key_check").all()):
                    raise SchemaError(f"the migration to {revision} would leave rows referencing nothing "
                                      f"({broken[:5]}); nothing was changed")
        finally:
            if sqlite:
                conn.exec_driver_sql("PRAGMA foreign_keys=ON")
                conn.commit()
    current = schema_revision(engine)
    if isinstance(target, str):
        engine.dispose()
    return current
