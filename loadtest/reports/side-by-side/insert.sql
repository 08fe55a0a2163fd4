-- One producer transaction: one event row, synchronous_commit on. Only the
-- columns both tables have, so the same statement runs against the seed
-- article's table and the relay's; the relay's triggers fill the rest.
\set account random(1, 100000)
INSERT INTO outbox (tenant_id, aggregate_type, aggregate_id, event_type, payload, idempotency_key)
VALUES ('00000000-0000-0000-0000-000000000007', 'order', :account, 'order.placed',
        '{"orderId": "o-1", "totalCents": 1299, "currency": "EUR", "lines": [{"sku": "A-1", "qty": 2}]}',
        gen_random_uuid()::text);
