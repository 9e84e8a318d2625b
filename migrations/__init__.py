"""Alembic migrations of the jobs database; ``jobs.records.db.upgrade`` (``berth db upgrade``) applies them."""
