-- Shards: each row belongs to one shard (a hash of its partition key), so a
-- claimer reads only its shard, through an index whose order is the claim's.
-- The number of shards is a property of the database, not of one relay:
-- every relay must agree on it (`outbox-relay reshard N` changes it).
CREATE TABLE outbox_relay_settings (
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    shards    integer NOT NULL CHECK (shards BETWEEN 1 AND 1024)
);
INSERT INTO outbox_relay_settings (shards) VALUES (8);

ALTER TABLE outbox ADD COLUMN shard smallint;
UPDATE outbox SET shard = (hashtext(partition_key) & 2147483647) % 8;
ALTER TABLE outbox ALTER COLUMN shard SET NOT NULL;

CREATE OR REPLACE FUNCTION outbox_fill_defaults() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.partition_key IS NULL THEN
        NEW.partition_key := NEW.aggregate_type || ':' || NEW.aggregate_id;
    END IF;
    NEW.shard := (hashtext(NEW.partition_key) & 2147483647)
                 % (SELECT shards FROM outbox_relay_settings);
    RETURN NEW;
END
$$;

-- The claim's index: equality on the shard, then the ready order.
CREATE INDEX outbox_shard_ready_idx
    ON outbox (shard, available_at, id)
    WHERE published_at IS NULL AND dead_lettered_at IS NULL;

-- Per-key ordering: the head of each key (its oldest undelivered row) is found
-- by skipping from key to key through this index, so an ordered claim costs
-- O(keys in the shard), not O(rows waiting behind them).
CREATE INDEX outbox_shard_key_idx
    ON outbox (shard, partition_key, id)
    WHERE published_at IS NULL AND dead_lettered_at IS NULL;
DROP INDEX outbox_pending_key_idx;
