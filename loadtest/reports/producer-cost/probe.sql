-- What the relay's listener runs while rows arrive (src/actors/listener.rs).
SELECT pg_sequence_last_value(pg_get_serial_sequence('outbox', 'id')::regclass),
       pg_snapshot_xmin(pg_current_snapshot())::text::bigint,
       pg_snapshot_xmax(pg_current_snapshot())::text::bigint;
