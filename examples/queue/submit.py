"""Submit a job to berth through RabbitMQ with pika and follow its events until it ends (docs/queue.md).

    pip install pika
    AMQP_URL=amqp://alice:PASS@rabbit:5672/%2F python examples/queue/submit.py requests.jsonl --model NAME

Environment: AMQP_URL, BERTH_QUEUE_PREFIX (berth), MESSAGE_ID (the idempotency key; default a new UUID),
BERTH_TENANT (the tenant your broker user is mapped to; default the user's name): its events are
those whose routing key begins with it, all a tenant's user may bind to.
Prints each of the job's events as a JSON line; exits 0 once it completed, 1 if it failed or was refused.
"""

import json
import os
import sys
import uuid
from urllib.parse import unquote, urlsplit

import pika


def main(argv: list[str]) -> int:
    model = argv[argv.index("--model") + 1] if "--model" in argv else "SmolLM2-135M-Instruct"
    source = argv[0]
    url = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
    prefix = os.environ.get("BERTH_QUEUE_PREFIX", "berth")
    message_id = os.environ.get("MESSAGE_ID") or str(uuid.uuid4())
    user = unquote(urlsplit(url).username or "guest")  # RabbitMQ checks user_id against the connection's user
    word = os.environ.get("BERTH_TENANT", user).replace(".", "%2E")  # the first word of the tenant's routing keys

    body = {"version": 1, "model": model, "metadata": {"submitted_by": "submit.py"}}
    if source.startswith(("s3://", "file://")):
        body["input_url"] = source
    else:
        with open(source) as f:
            body["requests"] = [json.loads(line) for line in f if line.strip()]

    connection = pika.BlockingConnection(pika.URLParameters(url))
    channel = connection.channel()
    channel.exchange_declare(f"{prefix}.events", "topic", passive=True)  # berth declares it; a tenant may not
    queue = channel.queue_declare("", exclusive=True).method.queue
    for key in (f"{word}.job.*", f"{word}.submit.rejected"):
        channel.queue_bind(queue, f"{prefix}.events", key)
    channel.confirm_delivery()
    channel.basic_publish(f"{prefix}.submit", f"{prefix}.jobs", json.dumps(body).encode(), pika.BasicProperties(
        delivery_mode=2, content_type="application/json", message_id=message_id, user_id=user), mandatory=True)
    print(f"published job-submit message {message_id}", file=sys.stderr)
    for _method, _properties, raw in channel.consume(queue, auto_ack=True):
        event = json.loads(raw)
        if event.get("message_id") != message_id:
            continue
        print(json.dumps(event), flush=True)
        if event["type"] in ("job.completed", "job.cancelled", "job.expired", "job.failed", "submit.rejected"):
            connection.close()
            return 1 if event["type"] in ("job.failed", "submit.rejected") else 0
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
