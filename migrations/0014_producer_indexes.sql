-- The producer's insert enters every index whose predicate a pending row
-- meets. Two of them served no statement the relay runs on a plain outbox:
--
-- * outbox_pending_age_idx (created_at, pending rows): written for a lag
--   query that reads it in order; the lag now comes from the snapshot, which
--   reads every pending row anyway (for the backlog, flapping and stuck
--   counts) and never this index.
-- * outbox_ready_idx (available_at, id, pending rows): the claim of migration
--   0001. Since 0007 every claim goes through the bucket indexes; the last
--   reader was `drain`'s completion check, which now walks
--   outbox_bucket_ready_idx (src/store/drain.rs).
--
-- Each is an index entry, its WAL and its vacuum work less per event.
-- A partitioned outbox (`outbox-relay partitions init`) keeps both: its
-- indexes cannot be dropped concurrently, and its key pruning reads the
-- oldest pending created_at through outbox_pending_age_idx.
--
-- Online: dropped CONCURRENTLY (producers keep inserting), safe to run again.
-- Relays before it keep working: only their drain check's plan changes.

-- step: drop index outbox_pending_age_idx
DROP INDEX CONCURRENTLY IF EXISTS outbox_pending_age_idx;

-- step: drop index outbox_ready_idx
DROP INDEX CONCURRENTLY IF EXISTS outbox_ready_idx;
