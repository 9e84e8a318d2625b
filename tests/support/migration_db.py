"""A migration's test: a database made at the revision before, holding rows, upgraded to the head."""

from __future__ import annotations

from sqlalchemy import MetaData, insert, select

from jobs.records.db import head_revision, make_engine, upgrade


def dump(engine, tables) -> dict:
    """The rows of ``tables``, by id, as dicts."""
    meta = MetaData()
    meta.reflect(engine)
    with engine.connect() as conn:
        return {name: [dict(r._mapping) for r in conn.execute(select(meta.tables[name]).order_by(
            meta.tables[name].c.id))] for name in tables}


def upgraded(url: str, revision: str, rows: dict[str, list[dict]]) -> dict:
    """Make the database at ``revision``, insert ``rows`` (table -> rows), upgrade it to the head and
    check that every value inserted is kept; the tables' rows after, as ``dump`` gives them."""
    assert upgrade(url, revision) == revision
    engine = make_engine(url)
    meta = MetaData()
    meta.reflect(engine)
    with engine.begin() as conn:
        for name, table_rows in rows.items():
            conn.execute(insert(meta.tables[name]), table_rows)
    before = dump(engine, rows)
    assert upgrade(url) == head_revision()
    after = dump(engine, rows)
    engine.dispose()
    for name, table_rows in before.items():
        assert [{k: r[k] for k in table_rows[0]} for r in after[name]] == table_rows, name
    return after
