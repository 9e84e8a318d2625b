#!/bin/sh
# Submit a job to berth with curl through RabbitMQ's management HTTP API (the management plugin must be
# enabled), no AMQP client needed (docs/queue.md):
#
#   RABBIT_USER=alice RABBIT_PASS=... ./submit.sh message.json order-42
#
# message.json is a job-submit message (jobs/queue_door/schemas/job-submit.v1.json); the second argument its
# message_id (the idempotency key). RabbitMQ checks user_id against the HTTP API's user, as on AMQP.
# It publishes to the exchange <prefix>.submit, the one a tenant's user may write to (docs/queue.md).
# Prints {"routed":true} when the message reached <prefix>.jobs. Needs jq.
set -eu
: "${RABBIT_URL:=http://127.0.0.1:15672}" "${RABBIT_USER:=guest}" "${RABBIT_PASS:=guest}" "${BERTH_QUEUE_PREFIX:=berth}"
jq -n --arg key "$BERTH_QUEUE_PREFIX.jobs" --arg id "$2" --arg user "$RABBIT_USER" --rawfile body "$1" \
  '{routing_key: $key, payload: $body, payload_encoding: "string",
    properties: {delivery_mode: 2, content_type: "application/json", message_id: $id, user_id: $user}}' |
  curl -sS -u "$RABBIT_USER:$RABBIT_PASS" -H 'content-type: application/json' --data-binary @- \
    "$RABBIT_URL/api/exchanges/%2F/$BERTH_QUEUE_PREFIX.submit/publish"
echo
