-- Buckets: every row gets a fixed bucket, a hash of its partition key modulo
-- 4096, computed once by the insert trigger from the row alone and never
-- rewritten. A shard is a range of buckets, held in its lease row, so
-- changing the number of shards (`outbox-relay reshard N`) rewrites the lease
-- table only: no outbox row moves, relays may keep running, and a producer
-- whose snapshot predates the change (REPEATABLE READ, SERIALIZABLE) still
-- writes its rows where the relays look, since the bucket does not depend on
-- the shard count. A key lives in one bucket, so in one shard at a time.
--
-- Online, like 0004: short catalog changes under the runner's lock_timeout,
-- a batched backfill, NOT NULL through a validated CHECK, indexes built
-- CONCURRENTLY, every step safe to run again.

-- The bucket column, and the trigger that fills it (no longer the shard: the
-- shard column goes at the end). Both are catalog changes.
-- step: transaction
ALTER TABLE outbox ADD COLUMN IF NOT EXISTS bucket smallint;
ALTER TABLE outbox ALTER COLUMN shard DROP NOT NULL;
CREATE OR REPLACE FUNCTION outbox_fill_defaults() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.partition_key IS NULL THEN
        NEW.partition_key := NEW.aggregate_type || ':' || NEW.aggregate_id;
    END IF;
    NEW.bucket := (hashtext(NEW.partition_key) & 2147483647) % 4096;
    RETURN NEW;
END
$$;
-- The trigger no longer depends on the shard count: nothing to recompile.
DROP TRIGGER IF EXISTS outbox_relay_settings_changed ON outbox_relay_settings;
DROP FUNCTION IF EXISTS outbox_relay_settings_changed();
DROP FUNCTION IF EXISTS outbox_relay_compile_fill_defaults();

-- Each shard's range of buckets, [bucket_lo, bucket_hi): shard k of n holds
-- k * 4096 / n up to (k + 1) * 4096 / n.
-- step: transaction
ALTER TABLE outbox_relay_shard_leases ADD COLUMN IF NOT EXISTS bucket_lo smallint;
ALTER TABLE outbox_relay_shard_leases ADD COLUMN IF NOT EXISTS bucket_hi smallint;
UPDATE outbox_relay_shard_leases l
SET bucket_lo = (l.shard * 4096 / s.shards)::smallint,
    bucket_hi = ((l.shard + 1) * 4096 / s.shards)::smallint
FROM outbox_relay_settings s
WHERE l.bucket_lo IS NULL;
ALTER TABLE outbox_relay_shard_leases ALTER COLUMN bucket_lo SET NOT NULL;
ALTER TABLE outbox_relay_shard_leases ALTER COLUMN bucket_hi SET NOT NULL;

-- The rows already there, a few thousand per transaction, in id order, each
-- batch looked up by primary key (`= ANY`), whatever the statistics say: a
-- join with the batch could be planned as a scan of the whole outbox per batch.
-- step: batches
WITH batch AS (
    SELECT id FROM outbox WHERE id > $1 ORDER BY id LIMIT 5000
), filled AS (
    UPDATE outbox o
    SET bucket = (hashtext(o.partition_key) & 2147483647) % 4096
    WHERE o.id = ANY (ARRAY(SELECT id FROM batch)) AND o.bucket IS NULL
)
SELECT max(id) FROM batch;

-- Rows an insert that began before the trigger changed may have left without one.
-- step: transaction
UPDATE outbox SET bucket = (hashtext(partition_key) & 2147483647) % 4096
WHERE bucket IS NULL;

-- step: transaction
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_constraint
                   WHERE conrelid = 'outbox'::regclass AND conname = 'outbox_bucket_not_null')
       AND NOT (SELECT attnotnull FROM pg_attribute
                WHERE attrelid = 'outbox'::regclass AND attname = 'bucket') THEN
        ALTER TABLE outbox ADD CONSTRAINT outbox_bucket_not_null
            CHECK (bucket IS NOT NULL) NOT VALID;
    END IF;
END
$$;

-- step: transaction
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_constraint
               WHERE conrelid = 'outbox'::regclass AND conname = 'outbox_bucket_not_null') THEN
        ALTER TABLE outbox VALIDATE CONSTRAINT outbox_bucket_not_null;
    END IF;
END
$$;

-- step: transaction
ALTER TABLE outbox ALTER COLUMN bucket SET NOT NULL;
ALTER TABLE outbox DROP CONSTRAINT IF EXISTS outbox_bucket_not_null;

-- The claim's index: a shard's range of buckets, each in ready order.
-- step: index outbox_bucket_ready_idx
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_bucket_ready_idx
    ON outbox (bucket, available_at, id)
    WHERE published_at IS NULL AND dead_lettered_at IS NULL;

-- Per-key ordering: the key walk skips from key to key within the range.
-- step: index outbox_bucket_key_idx
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_bucket_key_idx
    ON outbox (bucket, partition_key, id)
    WHERE published_at IS NULL AND dead_lettered_at IS NULL;

-- step: concurrently
DROP INDEX CONCURRENTLY IF EXISTS outbox_shard_ready_idx;

-- step: concurrently
DROP INDEX CONCURRENTLY IF EXISTS outbox_shard_key_idx;

-- The shard is the lease's range now, not a column of the row. Dropping a
-- column is a catalog change (no rewrite).
-- step: transaction
ALTER TABLE outbox DROP COLUMN IF EXISTS shard;
