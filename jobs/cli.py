"""The ``berth`` command line. Every engine flag maps to a field of ``worker.config.Settings`` and
can also be set as a ``BERTH_*`` environment variable; a flag wins over the environment."""

from __future__ import annotations

import atexit
import gc
import json
import logging
import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Literal, get_args, get_origin
from urllib.parse import unquote, urlsplit

import click
from pydantic import ValidationError

from jobs.records.job_status import JobStatus
from worker.config import ConfigError, Settings, default_text, flag_group, flag_names, flag_takes_text
from worker.frozen_heap import start_up

# The flags of settings: each is made from its field in worker.config (names, type, help, the default it
# shows), where the setting is described; only which commands take which group of them is said here.
# tests/test_settings_docs.py fails on a flag for a setting made any other way.
OPTION_TYPES = {"interactive_prefetch": click.IntRange(0, 65535)}  # refused by click, before pydantic


def setting_option(name: str):
    """The flag of setting ``name``. Its own default is None: a flag not given leaves the environment's value."""
    field = Settings.model_fields[name]
    flags = flag_names(name)
    if field.annotation is bool:  # a switch: --respawn turns it on, --no-prefix-cache off
        return click.option(*flags, name, flag_value=not flags[0].startswith("--no-"), default=None,
                            help=field.description)
    shown = default_text(name)
    if name in OPTION_TYPES:
        kind = OPTION_TYPES[name]
    elif get_origin(field.annotation) is Literal:
        kind = click.Choice(get_args(field.annotation))
    else:
        kind = str if flag_takes_text(name) else field.annotation
    return click.option(*flags, name, type=kind, help=f"{field.description}  [default: {shown}]" if shown
                        else field.description)


def setting_options(group: str):
    """A decorator adding the flags of the settings of ``group`` (``setting(cli=group)``), in the fields' order."""
    options = [setting_option(name) for name in Settings.model_fields if flag_group(name) == group]

    def add(command):
        for option in reversed(options):
            command = option(command)
        return command

    return add


engine_options = setting_options("engine")  # the engine's, on every command that runs one


def model_options(command):
    """The engine flags a command that checks lines without running them takes (submit, retry): the lines
    are checked against the model's tokenizer and name (its context: BERTH_MAX_MODEL_LEN), nothing else
    of the engine's."""
    for name in reversed(("model", "model_name")):
        command = setting_option(name)(command)
    return command


service_options = setting_options("service")  # where the database, the queue and the job files are
worker_options = setting_options("worker")  # berth worker's own
serve_options = setting_options("serve")  # berth serve's own

# Exit statuses a script can trust (docs/cli.md): 0 done (a failed line is listed in the errors file), 1 an
# error berth reports in one line, 2 a wrong command line (click's), these two, and 130 after Ctrl-C.
EXIT_LINES_FAILED = 3  # every line failed (or, with --fail-on-line-errors, one did), or the job failed
EXIT_INTERRUPTED = 130  # stopped by Ctrl-C, what was done kept


def configure_logging(quiet: bool = False) -> None:
    """What berth is doing on stderr, one line each (loading the model, the KV cache, ready, warnings);
    ``quiet``: warnings and errors only."""
    logging.basicConfig(level=logging.WARNING if quiet else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("alembic").setLevel(logging.WARNING)  # its plugin list at every start says nothing


def prefault_heap(settings: Settings) -> None:
    """Fault in the heap the model's weights will fill, on a thread, while this process imports torch
    (``worker.engine.heap_prefault``)."""
    from worker.engine import heap_prefault

    heap_prefault.start(settings)


_settings: Settings | None = None  # the command's, once read: the addresses ``user_errors`` names


def settings_from(flags: dict) -> Settings:
    """Settings from the environment, overridden by the flags that were given."""
    global _settings
    given = {k: v for k, v in flags.items() if v is not None and k in Settings.model_fields}
    try:
        _settings = Settings(**given)
        return _settings
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'settings'}: {e['msg']}" for e in exc.errors())
        raise click.UsageError(f"bad setting: {problems}") from None


@click.group()
@click.version_option(package_name="berth", message="berth %(version)s")
def main():
    """berth: bulk LLM inference with continuous batching over a paged KV cache."""
    # Last of the exit handlers: every object moves to the collector's permanent generation, so that
    # the collection the interpreter runs as it shuts down does not walk torch's and the engine's
    # millions of objects. That walk was 0.6 s of a 3 s `berth generate` (AMD EPYC, py-spy:
    # gc_collect_main after the output was written); the process's memory goes back to the system
    # whole either way.
    atexit.register(gc.freeze)


@main.command()
@click.argument("input_file", type=click.Path(exists=True, dir_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="output JSONL file")
@click.option("--errors", type=click.Path(dir_okay=False), help="errors JSONL [default: OUTPUT.errors.jsonl]")
@click.option("--quiet", is_flag=True, help="no progress bar")
@click.option("--resume", is_flag=True, help="keep the lines an interrupted run left in OUTPUT.partial, run the rest")
@click.option("--fail-on-line-errors", is_flag=True, help=f"exit {EXIT_LINES_FAILED} if any line failed (not only all)")
@engine_options
def generate(input_file, output, errors, quiet, resume, fail_on_line_errors, **flags):
    """Run an OpenAI Batch request file through the engine in this process. Finished lines are kept in
    OUTPUT.partial as they come; Ctrl-C stops at once and keeps them (--resume finishes the file)."""
    stop = threading.Event()

    def interrupted(signum, frame):  # the flag too: a library may swallow the exception (generate_file's stop)
        stop.set()
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupted)
    try:
        _generate(input_file, output, errors, quiet, resume, fail_on_line_errors, flags, stop)
    except KeyboardInterrupt:  # before a line ran (the imports, the model's load): nothing more to keep
        click.echo(f"stopped: no line run; `berth generate {input_file} -o {output} --resume` runs them", err=True)
        sys.exit(EXIT_INTERRUPTED)


@start_up()  # no collector walks over torch's import and the model's load (worker/frozen_heap.py)
def _generate(input_file, output, errors, quiet, resume, fail_on_line_errors, flags, stop) -> None:
    configure_logging(quiet)
    settings = settings_from(flags)
    from jobs.lines.validate import InputError, check_output

    try:
        check_output(Path(output))  # before the model loads
    except InputError as exc:
        raise click.ClickException(str(exc)) from None
    prefault_heap(settings)  # beside torch's import, which follows
    from jobs.hosting.generate import GenerateInterrupted, generate_file
    from worker.engine.engine import RequestRejected
    from worker.model.base import ModelLoadError

    try:
        summary = generate_file(input_file, output, settings, errors_path=errors, progress=not quiet, resume=resume,
                                stop=stop)
    except (ConfigError, ModelLoadError, RequestRejected, InputError) as exc:
        raise click.ClickException(str(exc)) from None
    except GenerateInterrupted as stop:
        s = stop.summary
        click.echo(f"stopped: {s.completed} of {s.total} lines done, kept in {stop.partial}; "
                   f"`berth generate {input_file} -o {output} --resume` runs the rest", err=True)
        sys.exit(EXIT_INTERRUPTED)
    resumed = f" ({summary.resumed} kept from the run before)" if summary.resumed else ""
    click.echo(f"{summary.completed} completed{resumed}, {summary.failed} failed of {summary.total} requests; "
               f"{summary.output_tokens} output tokens in {summary.seconds:.1f}s "
               f"({summary.output_tokens_per_second:.1f} tok/s) -> {summary.output_path}", err=True)
    if summary.errors_path:
        click.echo(f"errors: {summary.errors_path}", err=True)
    if summary.completed == 0 or (fail_on_line_errors and summary.failed):
        sys.exit(EXIT_LINES_FAILED)


def job_options(command):
    options = [
        click.option("--tenant", default="default", show_default=True, help="who the job is for (fair share)"),
        click.option("--priority", type=click.IntRange(0, 9), default=0, show_default=True,
                     help="0-9, higher runs first"),
        click.option("--completion-window", default="24h", show_default=True,
                     help="how long the job may take (e.g. 24h, 90m, 7d); after that it expires"),
        click.option("--metadata", multiple=True, metavar="KEY=VALUE", help="a label kept with the job (repeatable)"),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _labels(items) -> dict[str, str]:
    """``--metadata KEY=VALUE`` options as a dict."""
    labels = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r}: give KEY=VALUE", param_hint="--metadata")
        labels[key] = value
    return labels


def job_spec(flags: dict):
    from jobs.pipeline.submit import JobSpec

    metadata = _labels(flags.pop("metadata"))
    spec = JobSpec(flags.pop("tenant"), flags.pop("priority"), flags.pop("completion_window"), metadata)
    try:
        spec.check()
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    return spec


# berth's errors that reach the user as one line, by module and name. They are looked up among the modules
# already imported, never imported to be named: an error of a module nobody imported cannot have been
# raised, and importing them all would cost `berth status` the engine (torch) and the line checks.
USER_ERRORS = (("jobs.records.db", "SchemaError"), ("jobs.records.job_errors", "JobNotFound"),
               ("jobs.records.job_errors", "JobStateError"), ("jobs.records.storage_quota", "QuotaExceeded"),
               ("jobs.records.job_errors", "TenantNotFound"), ("jobs.lines.validate", "InputError"),
               ("worker.engine.engine", "RequestRejected"), ("worker.model.base", "ModelLoadError"),
               ("jobs.pipeline.publish", "PublishError"))  # `berth run`'s ingest: the broker refused messages


def user_error_types() -> tuple[type[BaseException], ...]:
    loaded = tuple(getattr(sys.modules[module], name) for module, name in USER_ERRORS if module in sys.modules)
    return (ConfigError, FileNotFoundError, ValueError, *loaded)


@contextmanager
def user_errors(settings: Settings | None = None):
    """berth's own errors, and a database or broker that does not answer, become one line for the user,
    not a traceback."""
    try:
        yield
    except Exception as exc:
        unreachable = _unreachable(exc, settings or _settings or Settings())
        if unreachable is not None:
            raise click.ClickException(unreachable) from None
        if not isinstance(exc, user_error_types()):
            raise
        raise click.ClickException(str(exc)) from None


def _unreachable(exc: BaseException, settings: Settings) -> str | None:
    """The line for an error of the database's driver, the job store or the broker's connection; None for others.
    Looked up among the modules already imported, as ``USER_ERRORS``."""
    database = sys.modules.get("sqlalchemy.exc")
    if database is not None and isinstance(exc, (database.OperationalError, database.InterfaceError)):
        from sqlalchemy.engine import make_url

        url = make_url(settings.database_url).render_as_string(hide_password=True)
        reason = str(exc.orig or exc).strip().splitlines()[0]
        return (f"the database at {url}: {reason}; check that it runs and takes connections there, or set "
                "BERTH_DATABASE_URL (--database-url)")
    store = sys.modules.get("storage.base")
    if store is not None and isinstance(exc, store.StorageError):
        return (f"the store {exc}; check BERTH_STORAGE_URL (--storage-url) and, for S3, its credentials "
                "(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY; AWS_ENDPOINT_URL for MinIO)")
    broker = sys.modules.get("kombu.exceptions")
    if broker is not None and isinstance(exc, broker.OperationalError):
        from kombu import Connection

        url = Connection(settings.broker_url).as_uri() if settings.broker_url else "(embedded)"
        return (f"the broker at {url} does not answer ({exc}); check that RabbitMQ runs there, or set "
                "BERTH_BROKER_URL (--broker-url; empty: the embedded queue)")
    return None


def _print_job(view, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(view.to_dict(), indent=2))
        return
    from jobs.records.progress import describe

    click.echo(describe(view))


@main.command()
@click.argument("input_file", type=click.Path(exists=True, dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="print the job as JSON")
@job_options
@service_options
@model_options
def submit(input_file, as_json, **flags):
    """Submit an OpenAI Batch request file as a job; prints its id."""
    from jobs import api

    spec = job_spec(flags)
    with user_errors():
        view = api.submit(input_file, settings_from(flags), spec=spec)
    if as_json:
        _print_job(view, True)
    else:
        click.echo(view.id)


@main.command()
@click.argument("job_id")
@click.option("--watch", is_flag=True, help="follow the job with a live progress bar until it ends")
@click.option("--json", "as_json", is_flag=True, help="print the job as JSON")
@service_options
def status(job_id, watch, as_json, **flags):
    """A job's state, request counts, tokens, throughput and time left."""
    from jobs import api
    from jobs.records.progress import watch as watch_job

    settings = settings_from(flags)
    with user_errors():
        if watch:
            watch_job(lambda: api.status(job_id, settings))
        view = api.status(job_id, settings)
        _print_job(view, as_json)
        if not as_json:
            if not view.status.is_final and not any(not w.gone for w in api.live_workers(settings, view.model)):
                click.echo(f"workers   none live serves model {view.model}: start one (`berth worker --model "
                           "...`); the job waits, nothing is lost")
            budget = api.tenant_budget(view.tenant, settings)
            click.echo(f"budget    tenant {view.tenant}: {budget.describe(view.model)}")
            click.echo(f"limits    tenant {view.tenant}: {budget.interactive.describe()}")


@main.command()
@click.option("--all", "show_gone", is_flag=True, help="also workers gone within the hour")
@click.option("--json", "as_json", is_flag=True)
@service_options
def workers(show_gone, as_json, **flags):
    """The engine workers: live ones (a heartbeat within 30 s) with their model, load and rate."""
    from jobs import api

    with user_errors():
        views = [w for w in api.live_workers(settings_from(flags)) if show_gone or not w.gone]
    if as_json:
        click.echo(json.dumps([w.to_dict() for w in views], indent=2))
        return
    if not views:
        click.echo("no engine worker is live: `berth worker` starts one", err=True)
    for w in views:
        b = w.beat
        click.echo(f"{b.worker:24} {'gone' if w.gone else 'live':4} {b.model:24} {b.device:6} running {b.running:4} "
                   f"waiting {b.waiting:4} {b.output_tokens_per_second:8.1f} tok/s  KV {b.kv_blocks_used}/"
                   f"{b.kv_blocks_used + b.kv_blocks_free}")


@main.command()
@click.option("--tenant", help="only this tenant")
@click.option("--since", default="30d", show_default=True,
              help="from this long ago (e.g. 24h, 7d) or this date (YYYY-MM-DD, UTC)")
@click.option("--until", help="to this date (YYYY-MM-DD, UTC) or this long ago; default now")
@click.option("--price-in", type=float, default=0.0, help="price per million prompt tokens, for a cost column")
@click.option("--price-out", type=float, default=0.0, help="price per million output tokens")
@click.option("--json", "as_json", is_flag=True)
@service_options
def usage(tenant, since, until, price_in, price_out, as_json, **flags):
    """Tokens in and out per tenant and model over a period (from the results: each request once)."""
    from jobs import api

    start, end = _moment(since, "--since"), _moment(until, "--until") if until else None
    with user_errors():
        rows = api.usage(settings_from(flags), tenant, start, end)
    if as_json:
        click.echo(json.dumps([{**r.to_dict(), "cost": r.cost(price_in, price_out)} for r in rows], indent=2))
        return
    priced = price_in or price_out
    click.echo(f"{'tenant':20} {'model':28} {'requests':>9} {'prompt':>12} {'cached':>12} {'output':>12}"
               + (f" {'cost':>10}" if priced else ""))
    for r in rows:
        click.echo(f"{r.tenant:20} {r.model:28} {r.requests:9d} {r.prompt_tokens:12d} {r.cached_tokens:12d} "
                   f"{r.completion_tokens:12d}" + (f" {r.cost(price_in, price_out):10.2f}" if priced else ""))


def _moment(text: str, flag: str) -> float:
    """'7d', '24h', '90m' ago, or a UTC date 'YYYY-MM-DD', as a Unix time; a UsageError naming ``flag``."""
    import datetime
    import time

    units = {"m": 60, "h": 3600, "d": 86400}
    try:
        if text[-1:] in units and text[:-1].isdigit():
            return time.time() - int(text[:-1]) * units[text[-1]]
        return datetime.datetime.strptime(text, "%Y-%m-%d").replace(tzinfo=datetime.UTC).timestamp()
    except ValueError:
        pass
    raise click.UsageError(f"{flag} {text!r}: give a span (90m, 24h, 7d) or a date (2026-12-01)")


@main.command(name="list")
@click.option("--tenant", help="only this tenant's jobs")
@click.option("--status", "state", type=click.Choice([s.value for s in JobStatus]), help="only jobs in this state")
@click.option("--since", help="created since this long ago (e.g. 90m, 24h, 7d) or this date (YYYY-MM-DD, UTC)")
@click.option("--until", help="created before this date (YYYY-MM-DD, UTC) or this long ago")
@click.option("--metadata", multiple=True, metavar="KEY=VALUE", help="only jobs with this label (repeatable: all)")
@click.option("--limit", type=int, default=20, show_default=True)
@click.option("--json", "as_json", is_flag=True)
@service_options
def list_command(tenant, state, since, until, metadata, limit, as_json, **flags):
    """The newest jobs."""
    from jobs import api
    from jobs.records.progress import job_table

    start = _moment(since, "--since") if since else None
    end = _moment(until, "--until") if until else None
    labels = _labels(metadata)
    with user_errors():
        views = api.list_jobs(settings_from(flags), tenant, state, limit, since=start, until=end, metadata=labels)
    if as_json:
        click.echo(json.dumps([v.to_dict() for v in views], indent=2))
    else:
        job_table(views)


@main.command()
@click.argument("job_id")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="output JSONL file")
@click.option("--errors", type=click.Path(dir_okay=False), help="errors JSONL [default: OUTPUT.errors.jsonl]")
@click.option("--partial", is_flag=True, help="a running job's lines finished so far (input order)")
@service_options
def results(job_id, output, errors, partial, **flags):
    """Fetch a finished job's output (input order) and its errors file; --partial, what a running one has."""
    from jobs import api

    with user_errors():
        files = api.results(job_id, output, errors, settings_from(flags), partial=partial)
    click.echo(f"output: {files.output or '(no request completed)'}", err=True)
    if files.errors:
        click.echo(f"errors: {files.errors}", err=True)


@main.command()
@click.argument("job_id")
@service_options
def cancel(job_id, **flags):
    """Cancel a job: running requests stop within a second, the rest fail as cancelled."""
    from jobs import api

    with user_errors():
        view = api.cancel(job_id, settings_from(flags))
    click.echo(f"{view.id}: {view.status.value}")


@main.command()
@click.argument("name")
@click.option("--weight", type=float,
              help="its share of the engines against other tenants' (default 1; 2 = twice the seats)")
@click.option("--cache-group", help="share cached prompt prefixes with the tenants of this group ('': its own again)")
@click.option("--enqueued-token-limit", "token_limit", metavar="TOKENS|default",
              help="its enqueued tokens per model at most: prompt tokens and max_tokens of its lines not yet done "
                   "(0: no limit; default: BERTH_TENANT_MAX_ENQUEUED_TOKENS)")
@click.option("--live-requests", metavar="N|default",
              help="its chat and completions requests running at once on each berth serve process (0: no limit; "
                   "default: BERTH_HTTP_TENANT_LIVE_REQUESTS)")
@click.option("--tokens-per-minute", metavar="TOKENS|default",
              help="its chat and completions tokens (prompt and max_tokens) in any 60 s on each berth serve process "
                   "(0: no limit; default: BERTH_HTTP_TENANT_TOKENS_PER_MINUTE)")
@service_options
def tenant(name, weight, cache_group, token_limit, live_requests, tokens_per_minute, **flags):
    """Set a tenant's share of the engines (running workers apply it within a second), the group of
    tenants it shares cached prompt prefixes with (requests admitted from then on), its enqueued-token
    limit (batches checked from then on) or its interactive limits (berth serve applies them within
    seconds); then show its enqueued tokens and its limits."""
    from jobs import api

    limit = _count_or_default(token_limit, "--enqueued-token-limit")
    interactive = {what: _count_or_default(value, flag) for what, value, flag in (
        ("live_requests", live_requests, "--live-requests"),
        ("tokens_per_minute", tokens_per_minute, "--tokens-per-minute")) if value is not None}
    settings = settings_from(flags)
    with user_errors():
        if weight is not None:
            api.set_tenant_weight(name, weight, settings)
            click.echo(f"tenant {name}: weight {weight:g}")
        if cache_group is not None:
            api.set_tenant_cache_group(name, cache_group or None, settings)
            click.echo(f"tenant {name}: " + (f"shares cached prefixes with group {cache_group}" if cache_group
                                             else "its cached prefixes are its own"))
        if token_limit is not None:
            api.set_tenant_token_limit(name, limit, settings)
        if interactive:
            api.set_tenant_interactive_limits(name, settings, **interactive)
        budget = api.tenant_budget(name, settings)
        click.echo(f"tenant {name}: {budget.describe()}")
        click.echo(f"tenant {name}: {budget.interactive.describe()}")


def _count_or_default(value: str | None, flag: str) -> int | None:
    """A limit's flag: a count (1,000 and 1_000 too), 0 (no limit); None for 'default' or no flag."""
    if value is None or value == "default":
        return None
    try:
        count = int(value.replace(",", "").replace("_", ""))
    except ValueError:
        raise click.BadParameter(f"{value!r}: give a number, 0 (no limit) or 'default'", param_hint=flag) from None
    if count < 0:
        raise click.BadParameter(f"{value!r}: give a number, 0 (no limit) or 'default'", param_hint=flag)
    return count


@main.command()
@worker_options
@service_options
@engine_options
def worker(**flags):
    """Run the engine on the request queue until SIGTERM."""
    configure_logging()
    settings = settings_from(flags)
    if settings.respawn:
        from jobs.hosting.engine_worker import ledger_modules  # torch and the engine, before it forks
        from jobs.hosting.respawn import Respawner

        ledger_modules()  # imported once here, not in each child (on a thread while its model loads)
        sys.exit(Respawner(lambda ready: run_worker(settings, ready)).run())
    with start_up():  # no collector walks over torch's import and the model's load (worker/frozen_heap.py)
        prefault_heap(settings)  # beside torch's import, which follows (not for --respawn: its children import nothing)
        code = run_worker(settings, lambda: None)
    sys.exit(code)


def run_worker(settings, ready) -> int:
    """Build the worker, say it is ready, run it; its exit status (``berth worker``, and each ``--respawn`` child)."""
    from jobs.hosting.engine_worker import engine_worker

    try:
        with start_up(), user_errors():  # a --respawn child's model load without the collector too
            built = engine_worker(settings)
            ready()
            built.run()
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    return 0


@main.command(name="broker-user")
@click.argument("user")
@click.option("--tenant", help="the tenant its jobs are for")
@click.option("--remove", is_flag=True, help="it may no longer submit")
@service_options
def broker_user(user, tenant, remove, **flags):
    """Let a RabbitMQ user submit jobs through the queue (<prefix>.jobs), for a tenant."""
    from jobs import api

    if remove == bool(tenant):
        raise click.UsageError("give --tenant TENANT, or --remove")
    with user_errors():
        if remove:
            known = api.remove_broker_user(user, settings_from(flags))
            click.echo(f"broker user {user}: may not submit" + ("" if known else " (it could not before either)"))
            return
        settings = settings_from(flags)
        api.allow_broker_user(user, tenant, settings)
    click.echo(f"broker user {user}: submits jobs for tenant {tenant}")
    from jobs.queue_door.permissions import shell_lines

    vhost = unquote(urlsplit(settings.broker_url).path[1:]) or "/"  # amqp://HOST// and amqp://HOST/%2F: "/"
    click.echo("its RabbitMQ permissions, to submit and read its own events only (docs/queue.md):")
    for line in shell_lines(user, tenant, settings.queue_prefix, vhost):
        click.echo(f"  {line}")


@main.command(name="webhook-secret")
@click.argument("tenant")
@click.option("--rotate", is_flag=True, help="make a new secret (the old one stops signing at once)")
@service_options
def webhook_secret_command(tenant, rotate, **flags):
    """Print the secret that signs a tenant's webhooks (X-Berth-Signature), made on first use."""
    from jobs import api

    with user_errors():
        click.echo(api.webhook_secret(tenant, settings_from(flags), rotate))


def _queue_door(flags: dict, submit: bool, events: bool, eager_ingest: bool = False) -> None:
    configure_logging()
    from jobs.queue_door.consumer import QueueDoor

    settings = settings_from(flags)
    with user_errors():
        QueueDoor(settings, submit=submit, events=events, eager_ingest=eager_ingest or None).serve()


@main.command(name="submit-consumer")
@click.option("--no-events", is_flag=True, help="do not publish job events or send webhooks (run `berth events`)")
@click.option("--eager-ingest", is_flag=True,
              help="ingest each job in this process before acking its message (default: on the Celery workers)")
@service_options
@model_options
def submit_consumer(no_events, eager_ingest, **flags):
    """Make jobs of the job-submit messages on <prefix>.jobs; publish job events (docs/queue.md)."""
    _queue_door(flags, submit=True, events=not no_events, eager_ingest=eager_ingest)


@main.command()
@service_options
def events(**flags):
    """Publish job events on <prefix>.events and send their webhooks, until SIGTERM."""
    _queue_door(flags, submit=False, events=True)


@main.command()
@click.argument("input_file", type=click.Path(exists=True, dir_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="output JSONL file")
@click.option("--errors", type=click.Path(dir_okay=False), help="errors JSONL [default: OUTPUT.errors.jsonl]")
@click.option("--quiet", is_flag=True, help="no progress bar")
@click.option("--fail-on-line-errors", is_flag=True, help=f"exit {EXIT_LINES_FAILED} if any line failed (not only all)")
@click.option("--new", "new_job", is_flag=True,
              help="submit the file as a new job even when an earlier run of it was left unfinished")
@job_options
@service_options
@engine_options
def run(input_file, output, errors, quiet, fail_on_line_errors, new_job, **flags):
    """Submit, run and fetch a job in this process (no servers on the default settings). Ctrl-C stops
    it (up to drain_timeout to finish the running requests; again to stop at once) and leaves the
    job queued; the same `berth run` goes on with it."""
    with start_up():  # no collector walks over torch's import and the model's load (worker/frozen_heap.py)
        _run(input_file, output, errors, quiet, fail_on_line_errors, new_job, flags)


def _run(input_file, output, errors, quiet, fail_on_line_errors, new_job, flags) -> None:
    configure_logging(quiet)
    from jobs import api
    from jobs.records.progress import JobProgress

    spec = job_spec(flags)
    settings = settings_from(flags)
    from jobs.lines.validate import InputError, check_output

    try:
        check_output(Path(output))  # before the model loads
    except InputError as exc:
        raise click.ClickException(str(exc)) from None
    with user_errors(settings):
        earlier = None if new_job else api.unfinished_run(input_file, settings, spec)
    if earlier is not None:
        done = (f"{earlier.completed} of {earlier.total} lines done" if earlier.status is not JobStatus.VALIDATING
                else f"{earlier.completed} of the {earlier.total} lines read so far done, the rest read now")
        click.echo(f"going on with {earlier.id}, which an earlier run of {Path(input_file).name} left unfinished "
                   f"({done}); --new submits the file again", err=True)
    try:
        with user_errors(settings), JobProgress(disabled=quiet) as progress:
            view, files = api.run(input_file, output, settings, errors=errors, spec=spec, on_progress=progress.update,
                                  job_id=earlier.id if earlier else None)
    except KeyboardInterrupt:  # while the model loaded, before the worker took the signal
        click.echo(f"stopped while starting; `berth run {input_file} -o {output}` again goes on with any job it "
                   "submitted", err=True)
        sys.exit(EXIT_INTERRUPTED)
    if files is None:  # Ctrl-C or SIGTERM: the worker stopped, the job waits in the queue
        left = (f"{view.completed} of {view.total} lines done, its other lines queued"
                if view.status is not JobStatus.VALIDATING else  # stopped during its ingest
                f"{view.completed} of the {view.total} lines read so far done, the rest of its file not yet read")
        click.echo(f"stopped: {view.id} left with {left}; `berth run {input_file} -o {output}` again goes on with it "
                   f"(or `berth worker`, then `berth results {view.id} -o {output}`)", err=True)
        sys.exit(EXIT_INTERRUPTED)
    click.echo(f"{view.id} {view.status.value}: {view.completed} completed, {view.failed} failed of {view.total}; "
               f"{view.prompt_tokens} input tokens, "  # all an embeddings job has
               f"{view.completion_tokens} output tokens at {view.output_tokens_per_second:.1f} tok/s "
               f"-> {files.output or '(no output)'}", err=True)
    if files.errors:
        click.echo(f"errors: {files.errors}", err=True)
    if view.status is not JobStatus.COMPLETED or view.completed == 0 or (fail_on_line_errors and view.failed):
        sys.exit(EXIT_LINES_FAILED)


@main.command()
@click.argument("job_id")
@click.option("--json", "as_json", is_flag=True, help="print the new job as JSON")
@service_options
@model_options
def retry(job_id, as_json, **flags):
    """A new job of the failed lines of a finished job (its failed requests and the lines a cancel or
    expiry left unread); prints its id."""
    from jobs import api

    with user_errors():
        view = api.retry(job_id, settings_from(flags))
    if as_json:
        _print_job(view, True)
    else:
        click.echo(view.id)


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="address to listen on")
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--open", "open_access", is_flag=True,
              help="serve requests without a valid API key as tenant 'default' (only on 127.0.0.1)")
@serve_options
@service_options
@engine_options
def serve(host, port, open_access, **flags):
    """OpenAI's Files and Batches API (base_url http://HOST:PORT/v1). On the embedded defaults (no
    --broker-url) it runs an engine worker in this process too."""
    from jobs.http.keys import any_keys
    from jobs.http.server import Server
    from jobs.records.db import open_database
    from worker.messaging.topology import is_embedded

    configure_logging()
    settings = settings_from(flags)
    _check_port_free(host, port)  # before the model loads: one line, not uvicorn's traceback after it
    with user_errors():
        server = Server(settings, host, port, open_access)
        keys = any_keys(open_database(settings.database_url))
    if open_access:
        click.secho(f"WARNING: --open: anyone who can reach {server.url} is tenant 'default' without an API key "
                    "(a valid key still names its own tenant). Use it on your own machine only.",
                    fg="yellow", bold=True, err=True)
    elif not keys:
        click.secho("no API keys yet: every request gets 401 until you run `berth key create --tenant NAME` "
                    "(or serve with --open on 127.0.0.1)", fg="yellow", err=True)
    worker = "with an engine worker in this process" if is_embedded(settings) else \
        "without an engine worker (run `berth worker` and the Celery worker beside it)"
    click.echo(f"berth serving {settings.served_model_name()} on {server.url}/v1 {worker}", err=True)
    with user_errors():
        server.serve_forever()


def _check_port_free(host: str, port: int) -> None:
    """A ClickException naming the port when something already listens there."""
    import socket

    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            probe.bind((host, port))
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {host}:{port} ({exc.strerror}): another program holds it "
                                   f"(`ss -ltnp 'sport = :{port}'` names it); stop it or give --port") from None


@main.group()
def key():
    """API keys of `berth serve`: each names a tenant."""


@key.command(name="create")
@click.option("--tenant", required=True, help="the tenant the key acts for")
@setting_option("database_url")
def key_create(tenant, database_url):
    """Make a key and print it: it is shown this once (the database keeps only its hash)."""
    from jobs.http.keys import create_key
    from jobs.records.db import open_database

    with user_errors():
        made = create_key(open_database(settings_from({"database_url": database_url}).database_url), tenant)
    click.echo(made)
    click.echo(f"the API key of tenant {tenant!r}, shown this once: keep it somewhere safe", err=True)


@key.command(name="list")
@click.option("--tenant", help="only this tenant's keys")
@setting_option("database_url")
def key_list(tenant, database_url):
    """The keys by their first characters, with their tenants."""
    import datetime

    from jobs.http.keys import list_keys
    from jobs.records.db import open_database

    with user_errors():
        keys = list_keys(open_database(settings_from({"database_url": database_url}).database_url), tenant)
    for k in keys:
        made = datetime.datetime.fromtimestamp(k.created_at).strftime("%Y-%m-%d %H:%M")
        state = "revoked" if k.revoked_at else "live"
        click.echo(f"{k.prefix}...  {k.tenant}  {made}  {state}")


@key.command(name="revoke")
@click.argument("key_or_prefix")
@setting_option("database_url")
def key_revoke(key_or_prefix, database_url):
    """Revoke a key: give it whole, or its 12 first characters as `berth key list` shows them."""
    from jobs.http.keys import revoke_key
    from jobs.records.db import open_database

    with user_errors():
        n = revoke_key(open_database(settings_from({"database_url": database_url}).database_url), key_or_prefix)
    if not n:
        raise click.ClickException(f"no live key {key_or_prefix!r}: `berth key list` shows them")
    click.echo(f"revoked {n} key{'s' if n > 1 else ''}")


@main.group()
def db():
    """The jobs database."""


@db.command()
@setting_option("database_url")
def upgrade(database_url):
    """Apply the migrations (creates the schema in an empty database)."""
    from jobs import api

    with user_errors():
        revision = api.upgrade_database(settings_from({"database_url": database_url}))
    click.echo(f"database at migration {revision}")


if __name__ == "__main__":
    sys.exit(main())
