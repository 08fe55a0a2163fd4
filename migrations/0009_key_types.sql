-- Per-route key heads: an ordered route's head of a key is the key's oldest
-- pending row among the event types that route takes. The claim finds it by
-- visiting the key's pending event types (one index descent each) instead of
-- reading the key's rows one by one, which, behind a paused route's backlog
-- of other types, would read every one of those rows on every claim.
--
-- Online: built CONCURRENTLY (producers keep inserting), safe to run again.

-- step: index outbox_bucket_key_type_idx
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_bucket_key_type_idx
    ON outbox (bucket, partition_key, event_type, id)
    WHERE published_at IS NULL AND dead_lettered_at IS NULL;
