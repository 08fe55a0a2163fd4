-- One producer transaction: a business row and its outbox event, committed
-- with synchronous_commit on; the trigger fills the partition key's bucket.
\set account random(1, 100000)
BEGIN;
INSERT INTO orders (account_id, amount_cents, note)
VALUES (:account, 1299, 'an order placed by the benchmark');
INSERT INTO outbox (tenant_id, aggregate_type, aggregate_id, event_type, payload,
                    idempotency_key, partition_key)
VALUES (('00000000-0000-0000-0000-0000000000' || lpad((:account % 20)::text, 2, '0'))::uuid,
        'order', :account, 'order.placed',
        '{"orderId": "o-1", "totalCents": 1299, "currency": "EUR", "lines": [{"sku": "A-1", "qty": 2}]}',
        gen_random_uuid()::text, 'order:' || :account);
END;
