"""The suite runs on several processes (pytest-xdist, the README's test command), which share this machine's
PostgreSQL and RabbitMQ. A test marked ``exclusive`` stops one of them: it runs while no other test of any
run on this machine does (an exclusive lock on ``SERVICES_LOCK``, ``tests/conftest.py``), every test that may
reach one of them holding it shared: one that uses a fixture handing a service out (through any other fixture)
or whose module names one (``SERVICE``: its address, a constant, a helper module, a fixture fetched by name),
except a case parametrized onto SQLite (``backend`` or ``any_settings`` "sqlite": its module names PostgreSQL for
the other case). The others (the embedded defaults: SQLite, the embedded queue, a folder) run on beside an
outage test."""

from __future__ import annotations

import functools
import re
import tempfile
from pathlib import Path

SERVICES_LOCK = Path(tempfile.gettempdir()) / "berth-tests-services.lock"
# the fixtures that hand out the shared services
SERVICE_FIXTURES = frozenset({"pg_url", "queue_prefix", "any_settings", "broker_users", "s3_endpoint", "s3_url"})
BOTH_BACKENDS = "any_settings"  # a service fixture parametrized over both: its SQLite case reaches none
EMBEDDED_CASE = "sqlite"  # a parametrized case on the embedded defaults: ``backend`` or ``BOTH_BACKENDS``
# those fixtures by name, the services' addresses and clients, and the helper modules that reach them
SERVICE = re.compile(rf"\b({'|'.join(sorted(SERVICE_FIXTURES))}|AMQP_URL|PG_ADMIN_URL|PIKA_URL|rabbitmqctl|psql"
                     r"|pg_ctlcluster)\b|postgresql(\+\w+)?://|amqp://|:5432\b|:5672\b|tests\.support\.(rabbitmq|s3_server)")


def services_named(text: str) -> set[str]:
    return {m.group(0) for m in SERVICE.finditer(text)}


@functools.cache
def _module_names_a_service(path: Path) -> bool:
    return bool(SERVICE.search(path.read_text()))


def needs_services(fixturenames, path: Path, params: dict | None = None) -> bool:
    """Whether a test of the module at ``path`` using ``fixturenames`` (its fixtures' whole closure), in the
    case ``params`` (its parametrization's values), may reach PostgreSQL or RabbitMQ. A SQLite case fetches
    ``pg_url`` only in its other case (``request.getfixturevalue``), so only a fixture it holds counts."""
    if not (SERVICE_FIXTURES - {BOTH_BACKENDS}).isdisjoint(fixturenames):
        return True
    if EMBEDDED_CASE in (params or {}).values():
        return False
    return BOTH_BACKENDS in fixturenames or _module_names_a_service(Path(path))
