-- Consumer-side deduplication: a handler's work and its dedupe row commit together.
CREATE TABLE processed_messages (
    consumer     text        NOT NULL,
    message_id   text        NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_id)
);

-- Pruning past a TTL walks this index instead of the whole table.
CREATE INDEX processed_messages_processed_at_idx ON processed_messages (processed_at);
