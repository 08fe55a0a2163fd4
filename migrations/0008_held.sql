-- Per-key order through QStash: an ordered delivery QStash took is held
-- (`locked_until`, no claim reads it) until QStash's callback says what the
-- destination answered. `accepted_at` records that QStash took the row's
-- latest attempt, for the failure callback (it may dead-letter a held row)
-- and for the relay, which tells a hold that ran out from a new row.
-- A nullable column without a default: a catalog change only.

-- step: transaction
ALTER TABLE outbox ADD COLUMN IF NOT EXISTS accepted_at timestamptz;
