-- Tenant fairness: the plain claim shares a shard's rows between the tenants
-- that have some due (round-robin, optionally weighted), so one tenant's
-- backlog does not hold back another's events. This index lets the claim
-- list the tenants with pending rows (a loose index scan, one descent per
-- tenant) and read each tenant's due rows of a shard in the plain claim's
-- own order (bucket, available_at, id) without reading the other tenants'.
--
-- Online: built CONCURRENTLY (producers keep inserting), safe to run again.
-- Relays before it claim as they did.

-- step: index outbox_tenant_ready_idx
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_tenant_ready_idx
    ON outbox (tenant_id, bucket, available_at, id)
    WHERE published_at IS NULL AND dead_lettered_at IS NULL;
