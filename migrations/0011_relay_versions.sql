-- Rolling upgrades: a relay's heartbeat says what it is, so `migrate` can tell
-- whether a migration that older relays cannot run across would strand a
-- live one (src/store/migrate/relays.rs). `version` is the relay's release,
-- `built_for` the newest migration it knows. Relays before this migration
-- write neither (both stay NULL): `migrate` counts them as older than any
-- migration that needs newer relays.
-- Nullable columns without a default: catalog changes only, and the
-- heartbeat of a relay before this one, which names its columns, still runs.

-- step: transaction
ALTER TABLE outbox_relay_replicas ADD COLUMN IF NOT EXISTS version text;
ALTER TABLE outbox_relay_replicas ADD COLUMN IF NOT EXISTS built_for integer;
