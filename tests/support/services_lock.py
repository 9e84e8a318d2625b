"""The suite runs on several processes (pytest-xdist, the README's test command), which share this machine's
PostgreSQL and RabbitMQ. A test marked ``exclusive`` stops one of them: it runs while no other test of any
run on this machine does (an exclusive lock on ``SERVICES_LOCK``, ``tests/conftest.py``), every other test
holding it shared, but those of the folders that use no shared service (``SERVICELESS``;
``tests/test_suite_services.py`` checks they name none): beside two busy loops, their tests had waited 59 s
in all for the services' outage tests."""

from __future__ import annotations

import tempfile
from pathlib import Path

from tests.support.paths import ROOT

SERVICES_LOCK = Path(tempfile.gettempdir()) / "berth-tests-services.lock"
SERVICELESS = tuple(ROOT / "tests" / folder for folder in ("engine", "model", "kernels"))
