"""Alembic's entry point. ``jobs.records.db.alembic_config`` hands it an open connection; run from the
``alembic`` command line instead, it connects to ``BERTH_DATABASE_URL``."""

from alembic import context

from jobs.records.db import make_engine
from jobs.records.models import Base
from worker.config import Settings

config = context.config


def run(connection) -> None:
    # batch mode lets later migrations alter tables on SQLite, which has no ALTER COLUMN
    context.configure(connection=connection, target_metadata=Base.metadata,
                      render_as_batch=connection.dialect.name == "sqlite", compare_type=True)
    with context.begin_transaction():
        context.run_migrations()


connection = config.attributes.get("connection")
if connection is not None:
    run(connection)
else:
    engine = make_engine(Settings().database_url)
    with engine.begin() as conn:
        run(conn)
    engine.dispose()
