-- The producer's commit path: what an INSERT INTO outbox costs the application.
--
-- 1. No NOTIFY. PostgreSQL serialises the commits of all transactions that
--    notified (a database-wide lock from PreCommit_Notify to the end of the
--    commit, WAL flush included), so a notifying trigger made every producer
--    commit one after another. The relay now finds new rows by polling the
--    outbox's id sequence (src/actors/listener.rs).
-- 2. The shard trigger computes from the row alone. It used to read
--    outbox_relay_settings, so an application role with only INSERT on outbox
--    failed, and every row paid for a query. The shard count is compiled into
--    the function instead, and recompiled whenever the settings row changes.

-- step: transaction
CREATE OR REPLACE FUNCTION outbox_relay_compile_fill_defaults() RETURNS void
LANGUAGE plpgsql AS $fn$
DECLARE
    n integer;
BEGIN
    SELECT shards INTO STRICT n FROM outbox_relay_settings;
    EXECUTE format($f$
        CREATE OR REPLACE FUNCTION outbox_fill_defaults() RETURNS trigger
        LANGUAGE plpgsql AS $body$
        BEGIN
            IF NEW.partition_key IS NULL THEN
                NEW.partition_key := NEW.aggregate_type || ':' || NEW.aggregate_id;
            END IF;
            NEW.shard := (hashtext(NEW.partition_key) & 2147483647) %% %s;
            RETURN NEW;
        END
        $body$ $f$, n);
END
$fn$;

CREATE OR REPLACE FUNCTION outbox_relay_settings_changed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM outbox_relay_compile_fill_defaults();
    RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS outbox_relay_settings_changed ON outbox_relay_settings;
CREATE TRIGGER outbox_relay_settings_changed
    AFTER INSERT OR UPDATE ON outbox_relay_settings
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_relay_settings_changed();

SELECT outbox_relay_compile_fill_defaults();

-- step: transaction
DROP TRIGGER IF EXISTS outbox_notify ON outbox;
DROP FUNCTION IF EXISTS outbox_notify();
