"""jobs submitted through the queue, job events, the status view: jobs.submit_message_id (unique per
tenant) and webhook_url, tenants.webhook_secret, broker_users, the job_events outbox and the
triggers on jobs that fill it, and the view berth_jobs

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02

Two things here live outside the tables, so a later migration must keep them in mind:

- The triggers ``berth_job_event_insert`` and ``berth_job_event_update`` on ``jobs`` (an insert, and
  an update that changes ``status``, add a ``job_events`` row). On SQLite a batch operation that
  recreates ``jobs`` (``batch_alter_table`` with anything but added columns) drops them with the old
  table: create them again after it (``_create_triggers`` below is what to copy).
- The view ``berth_jobs`` reads ``jobs`` and ``tenants``. On SQLite, recreating either of them under
  the view fails ("error in view berth_jobs"): drop the view first and create it again after.

``tests/jobs/records/test_status_view.py`` checks at head that both triggers exist and the view reads every job.
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
STATUS = sa.Enum("validating", "in_progress", "finalizing", "completed", "failed", "cancelling", "cancelled",
                 "expired", name="jobstatus", native_enum=False, length=16)

EVENT_COLUMNS = ("job_id, status, total, completed, failed, prompt_tokens, completion_tokens, output_key, errors_key, "
                 "error, webhook_url, created_at, webhook_due_at, webhook_attempts")
EVENT_VALUES = ("NEW.id, NEW.status, NEW.total, NEW.completed, NEW.failed, NEW.prompt_tokens, NEW.completion_tokens, "
                "NEW.output_key, NEW.errors_key, NEW.error, NEW.webhook_url, {now}, "
                "CASE WHEN NEW.webhook_url IS NULL THEN NULL ELSE {now} END, 0")
SQLITE_NOW = "((julianday('now') - 2440587.5) * 86400.0)"
PG_NOW = "extract(epoch FROM clock_timestamp())"


def _dialect() -> str:
    return op.get_bind().dialect.name


def upgrade() -> None:
    with op.batch_alter_table("jobs") as t:
        t.add_column(sa.Column("submit_message_id", sa.String(255), nullable=True))
        t.add_column(sa.Column("webhook_url", sa.Text(), nullable=True))
    op.create_index("ix_jobs_tenant_message_id", "jobs", ["tenant_id", "submit_message_id"], unique=True)
    with op.batch_alter_table("tenants") as t:
        t.add_column(sa.Column("webhook_secret", sa.String(128), nullable=True))
    op.create_table(
        "broker_users",
        sa.Column("name", sa.String(255), primary_key=True),
        sa.Column("tenant_id", sa.Integer(), sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
    )
    op.create_index("ix_broker_users_tenant_id", "broker_users", ["tenant_id"])
    op.create_table(
        "job_events",
        sa.Column("id", BIG_ID, primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(40), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("status", STATUS, nullable=False),
        sa.Column("total", sa.Integer(), nullable=False),
        sa.Column("completed", sa.Integer(), nullable=False),
        sa.Column("failed", sa.Integer(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.Column("output_key", sa.Text()),
        sa.Column("errors_key", sa.Text()),
        sa.Column("error", sa.Text()),
        sa.Column("webhook_url", sa.Text()),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("published_at", sa.Float()),
        sa.Column("webhook_due_at", sa.Float()),
        sa.Column("webhook_attempts", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("webhook_sent_at", sa.Float()),
        sa.Column("webhook_error", sa.Text()),
        sqlite_autoincrement=True,
    )
    for column in ("job_id", "created_at", "published_at", "webhook_due_at"):
        op.create_index(f"ix_job_events_{column}", "job_events", [column])
    _create_triggers()
    op.execute(view_sql(_dialect()))


def _create_triggers() -> None:
    if _dialect() == "postgresql":
        op.execute(f"""
            CREATE FUNCTION berth_job_event() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                INSERT INTO job_events ({EVENT_COLUMNS}) VALUES ({EVENT_VALUES.format(now=PG_NOW)});
                RETURN NULL;
            END $$""")
        op.execute("CREATE TRIGGER berth_job_event_insert AFTER INSERT ON jobs FOR EACH ROW "
                   "EXECUTE FUNCTION berth_job_event()")
        op.execute("CREATE TRIGGER berth_job_event_update AFTER UPDATE OF status ON jobs FOR EACH ROW "
                   "WHEN (OLD.status IS DISTINCT FROM NEW.status) EXECUTE FUNCTION berth_job_event()")
        return
    insert = f"INSERT INTO job_events ({EVENT_COLUMNS}) VALUES ({EVENT_VALUES.format(now=SQLITE_NOW)});"
    op.execute(f"CREATE TRIGGER berth_job_event_insert AFTER INSERT ON jobs BEGIN {insert} END")
    op.execute("CREATE TRIGGER berth_job_event_update AFTER UPDATE OF status ON jobs "
               f"WHEN OLD.status IS NOT NEW.status BEGIN {insert} END")


def view_sql(dialect: str) -> str:
    """``berth_jobs``: a job per row as a person reads it (docs/queue.md lists the columns). Progress
    and ETA are computed as ``berth status`` computes them (``jobs.records.status.JobView``)."""
    if dialect == "postgresql":
        now, ts, fraction = "extract(epoch FROM now())", "to_timestamp({})", "CAST({} AS double precision)"
    else:
        now = SQLITE_NOW
        ts = "strftime('%Y-%m-%d %H:%M:%f', {}, 'unixepoch')"
        fraction = "CAST({} AS REAL)"
    stamps = ("created", "in_progress", "finalizing", "completed", "failed", "cancelling", "cancelled", "expired",
              "expires")
    timestamps = ",\n            ".join(f"{ts.format(f'x.{name}_at')} AS {name}_at" for name in stamps)
    # seconds it has run: from in_progress until finalizing, its end, or now (as JobView.seconds_running)
    running = (f"CASE WHEN j.in_progress_at IS NULL THEN 0.0 ELSE "
               f"CASE WHEN COALESCE(j.finalizing_at, j.completed_at, j.failed_at, j.cancelled_at, j.expired_at, {now}) "
               f"> j.in_progress_at THEN COALESCE(j.finalizing_at, j.completed_at, j.failed_at, j.cancelled_at, "
               f"j.expired_at, {now}) - j.in_progress_at ELSE 0.0 END END")
    final = "('completed', 'failed', 'cancelled', 'expired')"
    return f"""
        CREATE VIEW berth_jobs AS
        SELECT
            x.id AS id,
            x.tenant_name AS tenant,
            x.status AS status,
            x.model AS model,
            x.priority AS priority,
            x.total AS total,
            x.completed AS completed,
            x.failed AS failed,
            x.completed + x.failed AS done,
            CASE WHEN x.total > 0 THEN {fraction.format('x.completed + x.failed')} / x.total ELSE 0.0 END AS progress,
            CASE WHEN x.status IN {final} OR x.completed + x.failed = 0 OR x.seconds <= 0 THEN NULL
                 ELSE (x.total - x.completed - x.failed) * x.seconds / (x.completed + x.failed) END AS eta_seconds,
            x.prompt_tokens AS prompt_tokens,
            x.completion_tokens AS completion_tokens,
            CASE WHEN x.seconds > 0 THEN x.completion_tokens / x.seconds ELSE 0.0 END AS output_tokens_per_second,
            x.seconds AS seconds_running,
            x.completion_window AS completion_window,
            x.error AS error,
            x.input_name AS input_file,
            x.output_key AS output_file,
            x.errors_key AS error_file,
            x.metadata AS metadata,
            x.submit_message_id AS message_id,
            {timestamps}
        FROM (SELECT j.*, t.name AS tenant_name, {running} AS seconds
              FROM jobs j JOIN tenants t ON t.id = j.tenant_id) x
    """


def downgrade() -> None:
    op.execute("DROP VIEW berth_jobs")
    op.execute("DROP TRIGGER berth_job_event_update" + (" ON jobs" if _dialect() == "postgresql" else ""))
    op.execute("DROP TRIGGER berth_job_event_insert" + (" ON jobs" if _dialect() == "postgresql" else ""))
    if _dialect() == "postgresql":
        op.execute("DROP FUNCTION berth_job_event()")
    op.drop_table("job_events")
    op.drop_table("broker_users")
    with op.batch_alter_table("tenants") as t:
        t.drop_column("webhook_secret")
    op.drop_index("ix_jobs_tenant_message_id", "jobs")
    with op.batch_alter_table("jobs") as t:
        t.drop_column("webhook_url")
        t.drop_column("submit_message_id")
