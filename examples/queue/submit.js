// Submit a job to berth through RabbitMQ and follow its events until it ends (docs/queue.md).
//
//   npm install --prefix examples/queue
//   AMQP_URL=amqp://alice:PASS@rabbit:5672/ node examples/queue/submit.js requests.jsonl --model SmolLM2-135M-Instruct
//   node examples/queue/submit.js s3://berth-inbox/team-a/requests.jsonl      # an input berth reads itself
//
// Environment: AMQP_URL (amqp://guest:guest@127.0.0.1:5672/), BERTH_QUEUE_PREFIX (berth), MESSAGE_ID (the
// idempotency key: give the same one when publishing again after a failure; default a new UUID), BERTH_TENANT
// (the tenant your broker user is mapped to; default the user's name: its events are all it may bind to).
// Prints each of the job's events as a JSON line; exits 0 once it completed, 1 if it failed or was refused.
const amqp = require("amqplib");
const crypto = require("crypto");
const fs = require("fs");

async function main() {
  const args = process.argv.slice(2);
  const modelAt = args.indexOf("--model");
  const model = modelAt >= 0 ? args.splice(modelAt, 2)[1] : "SmolLM2-135M-Instruct";
  const input = args[0];
  if (!input) throw new Error("usage: submit.js REQUESTS.jsonl|s3://...|file://... [--model NAME]");
  const url = process.env.AMQP_URL || "amqp://guest:guest@127.0.0.1:5672/";
  const prefix = process.env.BERTH_QUEUE_PREFIX || "berth";
  const messageId = process.env.MESSAGE_ID || crypto.randomUUID();
  const user = decodeURIComponent(new URL(url).username || "guest");  // RabbitMQ checks user_id against it
  const word = (process.env.BERTH_TENANT || user).replaceAll(".", "%2E");  // the first word of its routing keys

  const body = { version: 1, model, metadata: { submitted_by: "submit.js" } };
  if (/^(s3|file):\/\//.test(input)) body.input_url = input;
  else body.requests = fs.readFileSync(input, "utf8").split("\n").filter((l) => l.trim()).map((l) => JSON.parse(l));

  const connection = await amqp.connect(url);
  const channel = await connection.createConfirmChannel();
  // The job's events: a queue of our own on the events exchange (berth declares it), bound before publishing
  // to the keys of our tenant, the only ones a tenant's user may bind.
  await channel.checkExchange(`${prefix}.events`);
  const { queue } = await channel.assertQueue("", { exclusive: true });
  await channel.bindQueue(queue, `${prefix}.events`, `${word}.job.*`);
  await channel.bindQueue(queue, `${prefix}.events`, `${word}.submit.rejected`);
  channel.on("return", () => {
    console.error(`no queue ${prefix}.jobs: is \`berth submit-consumer\` running?`);
    process.exit(2);
  });

  const ended = new Promise((resolve) => {
    channel.consume(queue, (message) => {
      const event = JSON.parse(message.content.toString());
      channel.ack(message);
      if (event.message_id !== messageId) return;  // another job's
      console.log(JSON.stringify(event));
      if (["job.completed", "job.cancelled", "job.expired"].includes(event.type)) resolve(0);
      if (["job.failed", "submit.rejected"].includes(event.type)) resolve(1);
    });
  });
  channel.publish(`${prefix}.submit`, `${prefix}.jobs`, Buffer.from(JSON.stringify(body)), {
    persistent: true, mandatory: true, contentType: "application/json", messageId, userId: user,
  });
  await channel.waitForConfirms();
  console.error(`published job-submit message ${messageId}`);
  const code = await ended;
  await connection.close();
  process.exit(code);
}

main().catch((error) => {
  console.error(error.message || error);
  process.exit(2);
});
