-- Shard ownership across replicas. A replica claims and marks only in the
-- shards it holds a lease on; every takeover draws a new fencing token from
-- one sequence, so a token names one tenure of one shard. Claims and marks
-- carry the token and check, in the statement itself, that it is still the
-- shard's and that its lease has not ended: a replica that lost its shard
-- (paused, partitioned, slow) has its late writes refused by the database.
CREATE SEQUENCE outbox_relay_shard_token_seq;

CREATE TABLE outbox_relay_shard_leases (
    shard        smallint PRIMARY KEY,
    -- The replica holding the lease; NULL once released.
    owner        text,
    -- 0 until first taken; then the token of the latest takeover.
    token        bigint NOT NULL DEFAULT 0,
    -- The lease is the owner's while now() < lease_until.
    lease_until  timestamptz,
    acquired_at  timestamptz,
    renewed_at   timestamptz
) WITH (fillfactor = 50);

INSERT INTO outbox_relay_shard_leases (shard)
SELECT generate_series(0, shards - 1) FROM outbox_relay_settings;

-- Replicas announce themselves; each takes a fair share of the shards among
-- those whose heartbeat is current.
CREATE TABLE outbox_relay_replicas (
    replica      text PRIMARY KEY,
    hostname     text NOT NULL,
    pid          integer NOT NULL,
    started_at   timestamptz NOT NULL,
    seen_at      timestamptz NOT NULL,
    -- Counted as live while now() < alive_until.
    alive_until  timestamptz NOT NULL
) WITH (fillfactor = 50);
