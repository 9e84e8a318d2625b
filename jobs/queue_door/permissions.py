r"""The RabbitMQ permissions of a tenant's broker user: enough to submit jobs and follow its own
events, nothing of anyone else's. ``berth broker-user USER --tenant T`` prints them; why each pattern:
docs/queue.md, "Permissions of a tenant's user".
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from jobs.queue_door.contract import event_routing_key
from worker.messaging.topology import Topology


@dataclass(frozen=True)
class TenantPermissions:
    """The regular expressions of ``rabbitmqctl set_permissions`` and ``set_topic_permissions``."""

    configure: str
    write: str
    read: str
    topic_exchange: str
    topic_write: str
    topic_read: str


def _literal(name: str) -> str:
    return name.replace(".", r"\.")  # queue prefixes and tenant words hold no other character special to a regex


def tenant_permissions(prefix: str, tenant: str) -> TenantPermissions:
    topology = Topology(prefix)
    own = r"amq\.gen-.*"
    word = event_routing_key(tenant, "")[:-1]  # the tenant's first word of every routing key
    return TenantPermissions(
        configure=f"^{own}$",
        write=f"^({own}|{_literal(topology.submit_exchange.name)})$",
        read=f"^({own}|{_literal(topology.events_exchange.name)})$",
        topic_exchange=topology.events_exchange.name,
        topic_write="^$",
        topic_read=f"^{_literal(word)}\\.",
    )


def rabbitmqctl_commands(user: str, tenant: str, prefix: str, vhost: str = "/") -> list[list[str]]:
    """The ``rabbitmqctl`` calls (argument lists) that give ``user`` exactly a tenant's permissions."""
    p = tenant_permissions(prefix, tenant)
    return [["rabbitmqctl", "set_permissions", "-p", vhost, user, p.configure, p.write, p.read],
            ["rabbitmqctl", "set_topic_permissions", "-p", vhost, user, p.topic_exchange, p.topic_write, p.topic_read]]


def shell_lines(user: str, tenant: str, prefix: str, vhost: str = "/") -> list[str]:
    return [shlex.join(command) for command in rabbitmqctl_commands(user, tenant, prefix, vhost)]
