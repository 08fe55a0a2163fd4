-- One producer transaction: a business row and its outbox event, committed
-- with synchronous_commit on. The same statement for every variant; the
-- shard given here is overwritten by the relay's trigger where there is one.
\set account random(1, 100000)
BEGIN;
INSERT INTO orders (account_id, amount_cents, note)
VALUES (:account, 1299, 'an order placed by the benchmark');
INSERT INTO outbox (tenant_id, aggregate_type, aggregate_id, event_type, payload,
                    idempotency_key, partition_key, shard)
VALUES ('00000000-0000-0000-0000-000000000007', 'order', :account, 'order.placed',
        '{"orderId": "o-1", "totalCents": 1299, "currency": "EUR", "lines": [{"sku": "A-1", "qty": 2}]}',
        gen_random_uuid()::text, 'order:' || :account, :account % 8);
END;
