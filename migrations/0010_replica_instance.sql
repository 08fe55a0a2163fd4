-- One name, one process: each relay process draws an instance token at
-- start and writes it with its heartbeat. A heartbeat under a name whose row
-- holds another instance with a current heartbeat is refused, so two live
-- processes never run under one `relay.replica_id` (they took each other's
-- shards). The refused process is recorded (`refused_*`) for `stats`.
-- Nullable columns without defaults: catalog changes only.

-- step: transaction
ALTER TABLE outbox_relay_replicas
    ADD COLUMN IF NOT EXISTS instance text,
    ADD COLUMN IF NOT EXISTS refused_hostname text,
    ADD COLUMN IF NOT EXISTS refused_pid integer,
    ADD COLUMN IF NOT EXISTS refused_at timestamptz;
