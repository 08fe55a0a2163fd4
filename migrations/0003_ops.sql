-- Published rows by publication time: the per-minute throughput series and the
-- retention DELETE read only the rows of their window instead of the table.
-- Partial, so an INSERT (published_at is NULL) adds no entry and the lease
-- update (no indexed column changes) stays HOT; the publish mark, which is never
-- HOT because it changes the ready index's predicate, writes one entry more.
-- Built CONCURRENTLY: producers keep inserting while it builds. A build that
-- died midway leaves an INVALID index; the next run drops and rebuilds it.
-- step: index outbox_published_at_idx
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_published_at_idx
    ON outbox (published_at)
    WHERE published_at IS NOT NULL;
