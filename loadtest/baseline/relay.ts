// The relay worker of the article "Building Resilient Event-Driven
// Architectures with Postgres and Serverless Queues", as the article writes
// it (see README.md for the only changes: where the database and QStash are,
// and the loop that calls relayBatch, which the article does not show).
import { Client as QStashClient } from '@upstash/qstash';
import pg from 'pg';
import type { Pool } from 'pg';

export type JsonObject = Record<string, unknown>;

export interface OutboxRow<T extends JsonObject = JsonObject> {
  readonly id: string;
  readonly tenant_id: string;
  readonly aggregate_type: string;
  readonly aggregate_id: string;
  readonly event_type: string;
  readonly payload: T;
  readonly headers: Record<string, string>;
  readonly idempotency_key: string;
  readonly attempt_count: number;
}

const CLAIM_SQL = `
WITH claimed AS (
  SELECT id
  FROM outbox
  WHERE published_at IS NULL
    AND dead_lettered_at IS NULL
    AND available_at <= now()
    AND (locked_until IS NULL OR locked_until < now())
  ORDER BY id
  LIMIT $1
  FOR UPDATE SKIP LOCKED
)
UPDATE outbox o
SET locked_until  = now() + ($2 * interval '1 second'),
    attempt_count = o.attempt_count + 1
FROM claimed
WHERE o.id = claimed.id
RETURNING o.id, o.tenant_id, o.aggregate_type, o.aggregate_id,
          o.event_type, o.payload, o.headers, o.idempotency_key, o.attempt_count;`;

function backoffSeconds(attempt: number): number {
  const base = Math.min(300, 2 ** attempt * 2);          // 4s, 8s, 16s ... capped at 5 min
  return Math.round(base * (0.5 + Math.random() * 0.5)); // full jitter
}

async function publishOne(
  pool: Pool,
  qstash: QStashClient,
  row: OutboxRow,
  maxAttempts: number,
): Promise<'published' | 'retry' | 'dead'> {
  try {
    await qstash.publishJSON({
      url: `${process.env.CONSUMER_BASE_URL}/api/events`,
      body: {
        id: row.id,
        type: row.event_type,
        aggregateType: row.aggregate_type,
        aggregateId: row.aggregate_id,
        tenantId: row.tenant_id,
        payload: row.payload,
      },
      headers: { ...row.headers, 'x-event-id': String(row.id) },
      retries: 3,
      deduplicationId: row.idempotency_key,
    });

    await pool.query(
      `UPDATE outbox SET published_at = now(), locked_until = NULL, last_error = NULL WHERE id = $1`,
      [row.id],
    );
    return 'published';
  } catch (err) {
    const message = err instanceof Error ? err.message : String(err);
    const exhausted = row.attempt_count >= maxAttempts;

    await pool.query(
      `UPDATE outbox
          SET locked_until     = NULL,
              available_at     = now() + ($2 * interval '1 second'),
              dead_lettered_at = CASE WHEN $3 THEN now() ELSE dead_lettered_at END,
              last_error       = $4
        WHERE id = $1`,
      [row.id, exhausted ? 0 : backoffSeconds(row.attempt_count), exhausted, message.slice(0, 2000)],
    );
    return exhausted ? 'dead' : 'retry';
  }
}

interface RelayOptions { batchSize: number; leaseSeconds: number; maxAttempts: number }

export async function relayBatch(
  pool: Pool,
  qstash: QStashClient,
  opts: RelayOptions,
): Promise<{ published: number; retried: number; dead: number }> {
  const { rows } = await pool.query<OutboxRow>(CLAIM_SQL, [opts.batchSize, opts.leaseSeconds]);
  const counts = { published: 0, retried: 0, dead: 0 };

  const outcomes = await Promise.allSettled(
    rows.map((row) => publishOne(pool, qstash, row, opts.maxAttempts)),
  );
  for (const o of outcomes) {
    if (o.status === 'fulfilled') counts[o.value === 'published' ? 'published' : o.value === 'retry' ? 'retried' : 'dead']++;
  }
  return counts;
}

// --- Added to run it: the environment, and a loop over relayBatch. ---

const pool = new pg.Pool({ connectionString: process.env.DATABASE_URL });
const qstash = new QStashClient({
  baseUrl: process.env.QSTASH_URL,
  token: process.env.QSTASH_TOKEN!,
});
const opts: RelayOptions = {
  batchSize: Number(process.env.BATCH_SIZE ?? 100),
  leaseSeconds: 30,
  maxAttempts: 10,
};
let stopping = false;
process.on('SIGTERM', () => { stopping = true; });
while (!stopping) {
  const counts = await relayBatch(pool, qstash, opts);
  if (counts.published + counts.retried + counts.dead === 0) {
    await new Promise((resolve) => setTimeout(resolve, 100));
  }
}
await pool.end();
