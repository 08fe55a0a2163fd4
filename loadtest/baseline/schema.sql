-- The article's outbox table and its claim index, as the article writes them
-- (its migrations/0001_outbox.sql).
CREATE TABLE outbox (
  id                bigserial    PRIMARY KEY,
  tenant_id         uuid         NOT NULL,
  aggregate_type    text         NOT NULL,
  aggregate_id      text         NOT NULL,
  event_type        text         NOT NULL,
  payload           jsonb        NOT NULL,
  headers           jsonb        NOT NULL DEFAULT '{}'::jsonb,
  idempotency_key   text         NOT NULL,
  created_at        timestamptz  NOT NULL DEFAULT now(),
  available_at      timestamptz  NOT NULL DEFAULT now(),
  locked_until      timestamptz,
  attempt_count     integer      NOT NULL DEFAULT 0,
  published_at      timestamptz,
  dead_lettered_at  timestamptz,
  last_error        text,
  CONSTRAINT outbox_idempotency_key_key UNIQUE (idempotency_key)
);

-- The only index the relay's claim query needs. Partial => stays small.
CREATE INDEX outbox_ready_idx
  ON outbox (available_at, id)
  WHERE published_at IS NULL AND dead_lettered_at IS NULL;
