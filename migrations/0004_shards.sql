-- Shards: each row belongs to one shard (a hash of its partition key), so a
-- claimer reads only its shard, through an index whose order is the claim's.
-- The number of shards is a property of the database, not of one relay:
-- every relay must agree on it (`outbox-relay reshard N` changes it).
--
-- Online: no step holds a lock that stops producers for longer than the
-- runner's lock_timeout, the backfill commits batch by batch, and every step
-- can run again after a crash (the runner reruns an unfinished migration from
-- its first step).

-- step: transaction
CREATE TABLE IF NOT EXISTS outbox_relay_settings (
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    shards    integer NOT NULL CHECK (shards BETWEEN 1 AND 1024)
);
INSERT INTO outbox_relay_settings (shards) VALUES (8) ON CONFLICT DO NOTHING;
-- Nullable and without a default: only a catalog change.
ALTER TABLE outbox ADD COLUMN IF NOT EXISTS shard smallint;
-- New rows get their shard from here on (0006 replaces this function).
CREATE OR REPLACE FUNCTION outbox_fill_defaults() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.partition_key IS NULL THEN
        NEW.partition_key := NEW.aggregate_type || ':' || NEW.aggregate_id;
    END IF;
    NEW.shard := (hashtext(NEW.partition_key) & 2147483647) % 8;
    RETURN NEW;
END
$$;

-- The rows already there, a few thousand per transaction, in id order, each
-- batch looked up by primary key (`= ANY`), whatever the statistics say: a
-- join with the batch could be planned as a scan of the whole outbox per batch.
-- step: batches
WITH batch AS (
    SELECT id FROM outbox WHERE id > $1 ORDER BY id LIMIT 5000
), filled AS (
    UPDATE outbox o
    SET shard = (hashtext(o.partition_key) & 2147483647) % 8
    WHERE o.id = ANY (ARRAY(SELECT id FROM batch)) AND o.shard IS NULL
)
SELECT max(id) FROM batch;

-- Rows an insert that began before the trigger changed may have left unsharded.
-- step: transaction
UPDATE outbox SET shard = (hashtext(partition_key) & 2147483647) % 8
WHERE shard IS NULL;

-- NOT NULL without a scan under ACCESS EXCLUSIVE: a CHECK added NOT VALID
-- (a catalog change), validated under a lock that lets inserts through, then
-- SET NOT NULL, which trusts the validated CHECK instead of scanning.
-- step: transaction
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_constraint
                   WHERE conrelid = 'outbox'::regclass AND conname = 'outbox_shard_not_null')
       AND NOT (SELECT attnotnull FROM pg_attribute
                WHERE attrelid = 'outbox'::regclass AND attname = 'shard') THEN
        ALTER TABLE outbox ADD CONSTRAINT outbox_shard_not_null
            CHECK (shard IS NOT NULL) NOT VALID;
    END IF;
END
$$;

-- step: transaction
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_constraint
               WHERE conrelid = 'outbox'::regclass AND conname = 'outbox_shard_not_null') THEN
        ALTER TABLE outbox VALIDATE CONSTRAINT outbox_shard_not_null;
    END IF;
END
$$;

-- step: transaction
ALTER TABLE outbox ALTER COLUMN shard SET NOT NULL;
ALTER TABLE outbox DROP CONSTRAINT IF EXISTS outbox_shard_not_null;

-- The claim's index: equality on the shard, then the ready order.
-- step: index outbox_shard_ready_idx
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_shard_ready_idx
    ON outbox (shard, available_at, id)
    WHERE published_at IS NULL AND dead_lettered_at IS NULL;

-- Per-key ordering: the head of each key (its oldest undelivered row) is found
-- by skipping from key to key through this index, so an ordered claim costs
-- O(keys in the shard), not O(rows waiting behind them).
-- step: index outbox_shard_key_idx
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_shard_key_idx
    ON outbox (shard, partition_key, id)
    WHERE published_at IS NULL AND dead_lettered_at IS NULL;

-- step: concurrently
DROP INDEX CONCURRENTLY IF EXISTS outbox_pending_key_idx;
