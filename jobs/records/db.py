"""The jobs database: one engine per URL and process, and its schema through Alembic.

    db = open_database(settings.database_url)   # applies the migrations when the database is empty
    with db.session() as s, s.begin():
        ...

The schema comes only from ``migrations/`` (``upgrade(url)``, ``berth db upgrade``).
"""

from __future__ import annotations

import ast
import functools
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import ColumnElement, Engine, any_, bindparam, create_engine, event, inspect, make_url, text
from sqlalchemy.exc import DBAPIError

if TYPE_CHECKING:
    from sqlalchemy.orm import Session, sessionmaker

MIGRATION_WAIT = 60.0  # seconds to wait for another process migrating the same empty database
VERSION_TABLE = "alembic_version"  # Alembic's default name, which migrations/env.py keeps


class SchemaError(RuntimeError):
    """The database's schema is not the one this code needs; the message says what to run."""


@dataclass(frozen=True)
class Database:
    url: str
    engine: Engine

    @functools.cached_property
    def session(self) -> sessionmaker[Session]:
        """ORM sessions of this database (``with db.session() as s``); SQLAlchemy's ORM is imported here."""
        from sqlalchemy.orm import sessionmaker

        return sessionmaker(self.engine, expire_on_commit=False)


def normalize_url(url: str) -> str:
    """``postgresql://`` means psycopg 3 here (the driver berth installs), not psycopg2; and a SQLite
    file named relative to the working directory (the default ``sqlite:///./berth.db``) is made
    absolute, so the engine kept for it is never reused after the process changes directory."""
    for plain in ("postgresql://", "postgres://"):
        if url.startswith(plain):
            return "postgresql+psycopg://" + url[len(plain):]
    if url.startswith("sqlite"):
        parsed = make_url(url)
        path = parsed.database
        if path and path != ":memory:" and not path.startswith("file:") and not os.path.isabs(path):
            return parsed.set(database=os.path.abspath(path)).render_as_string(hide_password=False)
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


def one_of(column, values, dialect: str) -> ColumnElement[bool]:
    """``column IN values``; on PostgreSQL as ``column = ANY(array)``, one parameter. An IN list is a
    placeholder a value, and psycopg splits a query it has not seen in Python: for the few hundred ids
    of a worker's step that cost about a millisecond a statement, every statement, as their count varies."""
    values = list(values)
    if dialect != "postgresql":
        return column.in_(values)
    from sqlalchemy.dialects.postgresql import ARRAY

    return column == any_(bindparam(None, values, type_=ARRAY(column.type)))


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
    _open[url] = db = Database(url, engine)
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
    """The newest migration: the one revision of ``migrations/versions`` that no other revises."""
    import migrations

    return _head_of(Path(migrations.__file__).parent / "versions")


@functools.cache
def _head_of(folder: Path) -> str:
    revisions, revised = set(), set()
    for path in sorted(folder.glob("*.py")):
        fields = _literal_assignments(path)
        if "revision" in fields:
            revisions.add(fields["revision"])
            down = fields.get("down_revision")
            revised.update(down if isinstance(down, (tuple, list)) else [down] if down else [])
    heads = revisions - revised
    if len(heads) != 1:
        raise SchemaError(f"the migrations in {folder} have {len(heads)} heads ({sorted(heads)}), not one")
    return heads.pop()


def _literal_assignments(path: Path) -> dict:
    """The module-level ``name = literal`` (and ``name: type = literal``) lines of a Python file."""
    fields = {}
    for node in ast.parse(path.read_text(), str(path)).body:
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else \
            node.target if isinstance(node, ast.AnnAssign) and node.value is not None else None
        if isinstance(target, ast.Name):
            try:
                fields[target.id] = ast.literal_eval(node.value)
            except ValueError:
                pass
    return fields


def schema_revision(engine: Engine) -> str | None:
    """The revision the database is at; None when it has none (no version table, or an empty one)."""
    with engine.connect() as conn:
        if not inspect(conn).has_table(VERSION_TABLE):
            return None
        versions = conn.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).scalars().all()
    if len(versions) > 1:
        raise SchemaError(f"the database is at {len(versions)} migrations at once ({sorted(versions)}): "
                          "it was migrated by something other than `berth db upgrade`")
    return versions[0] if versions else None


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
