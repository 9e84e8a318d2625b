r"""The RabbitMQ permissions of a tenant's broker user (docs/queue.md, "Permissions of a tenant's
user"): enough to submit jobs and follow its own events, nothing of anyone else's.

    rabbitmqctl set_permissions -p / alice '^amq\.gen-.*$' '^(amq\.gen-.*|berth\.submit)$' '^(amq\.gen-.*|berth\.events)$'
    rabbitmqctl set_topic_permissions -p / alice berth.events '^$' '^team-a\.'

Why each pattern, as RabbitMQ checks them (configure: declare or delete; write: publish to an
exchange, bind a queue; read: consume from a queue, bind from an exchange):

- configure ``amq.gen-*``: the queues the server names (``queue_declare("")``), which only it can
  make (``amq.`` names are reserved) and which, declared exclusive, only their connection can use.
  Nothing of berth's: a tenant that could declare or delete ``<prefix>.events`` or a request queue
  could break them for every tenant.
- write ``<prefix>.submit``: the exchange bound to ``<prefix>.jobs`` and to nothing else, so the
  user publishes job-submit messages and cannot reach another queue. Not the default exchange,
  which routes to every queue by name (the request queues, ``<prefix>.dead``, Celery's tasks).
  ``amq.gen-*`` because binding its own queue needs write on it.
- read ``<prefix>.events`` and ``amq.gen-*``: bind its queue to the events exchange, consume it;
  not ``<prefix>.jobs`` (other tenants' messages, inline requests and all) nor any queue of berth's.
- topic read ``^<tenant>\.`` on ``<prefix>.events``: every binding key it makes there must begin
  with its own word (``jobs.queue_door.contract.event_routing_key``): ``team-a.#`` yes, ``#`` or
  ``*.job.completed`` refused. Topic write ``^$``: it publishes no event.

``berth broker-user USER --tenant T`` prints these for its user, and the tests apply them as printed.
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
