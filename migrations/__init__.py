"""Alembic migrations of the jobs database; ``jobs.db.upgrade`` (``berth db upgrade``) applies them."""
