-- The tenant listing (src/store/tenants.rs TENANTS) and the plain claim
-- (src/store/outbox.rs CLAIM) as prepared statements, timed with EXPLAIN
-- ANALYZE on a database with 500,000 rows of one tenant pending (every
-- shard lease set to token 7). Run: psql -f tenants.sql (then the claim).
PREPARE tenants(int8, int2, uuid, int8) AS
WITH RECURSIVE fence AS (
    SELECT bucket_lo, bucket_hi FROM outbox_relay_shard_leases
    WHERE shard = $2 AND token = $4 AND lease_until > now()
), after_cursor (tenant_id) AS (
    (SELECT tenant_id FROM outbox
     WHERE tenant_id > $3 AND published_at IS NULL AND dead_lettered_at IS NULL
       AND EXISTS (SELECT 1 FROM fence)
     ORDER BY tenant_id LIMIT 1)
    UNION ALL
    SELECT next.tenant_id FROM after_cursor AS prev, LATERAL (
        SELECT tenant_id FROM outbox
        WHERE tenant_id > prev.tenant_id AND published_at IS NULL AND dead_lettered_at IS NULL
        ORDER BY tenant_id LIMIT 1) AS next
), up_to_cursor (tenant_id) AS (
    (SELECT tenant_id FROM outbox
     WHERE tenant_id <= $3 AND published_at IS NULL AND dead_lettered_at IS NULL
       AND EXISTS (SELECT 1 FROM fence)
     ORDER BY tenant_id LIMIT 1)
    UNION ALL
    SELECT next.tenant_id FROM up_to_cursor AS prev, LATERAL (
        SELECT tenant_id FROM outbox
        WHERE tenant_id > prev.tenant_id AND tenant_id <= $3
          AND published_at IS NULL AND dead_lettered_at IS NULL
        ORDER BY tenant_id LIMIT 1) AS next
)
SELECT t.tenant_id FROM (
    SELECT tenant_id FROM after_cursor UNION ALL SELECT tenant_id FROM up_to_cursor
) AS t, LATERAL (
    SELECT 1 FROM outbox AS o
    WHERE o.tenant_id = t.tenant_id
      AND o.bucket >= (SELECT bucket_lo FROM fence) AND o.bucket < (SELECT bucket_hi FROM fence)
      AND o.published_at IS NULL AND o.dead_lettered_at IS NULL
    ORDER BY o.bucket LIMIT 1) AS here
LIMIT $1;
PREPARE claim(int8, int2, int2, timestamptz, int8, text[], int8, int8[], bool[]) AS
WITH fence AS (
    SELECT bucket_lo, bucket_hi FROM outbox_relay_shard_leases
    WHERE shard = $2 AND token = $7 AND lease_until > now()
)
SELECT o.id, o.tenant_id, o.aggregate_type, o.aggregate_id, o.event_type,
       o.payload::text, o.headers::text, o.idempotency_key, o.partition_key,
       o.created_at, o.attempt_count, o.available_at, o.bucket,
       o.accepted_at IS NOT NULL
FROM outbox AS o
WHERE o.bucket >= (SELECT bucket_lo FROM fence) AND o.bucket < (SELECT bucket_hi FROM fence)
  AND (o.bucket, o.available_at, o.id) > ($3, $4, $5)
  AND o.published_at IS NULL AND o.dead_lettered_at IS NULL
  AND o.available_at <= now()
  AND (o.locked_until IS NULL OR o.locked_until < now())
  AND NOT coalesce((
      SELECT r.ordered FROM unnest($6::text[], $9::bool[]) WITH ORDINALITY AS r(pattern, ordered, n)
      WHERE o.event_type LIKE r.pattern ORDER BY r.n LIMIT 1), false)
  AND NOT (o.id = ANY ($8))
ORDER BY o.bucket, o.available_at, o.id
LIMIT $1;
SET plan_cache_mode = force_generic_plan;
\timing on
EXPLAIN (ANALYZE, BUFFERS, TIMING OFF, SUMMARY ON) EXECUTE tenants(500, 0::int2, '00000000-0000-0000-0000-000000000000', 7);
EXPLAIN (ANALYZE, BUFFERS, TIMING OFF, SUMMARY ON) EXECUTE claim(500, 0::int2, '-32768'::int2, '0001-01-01', -9223372036854775808, '{}', 7, '{}', '{}');
