-- An attempt history for dead letters: each failed delivery attempt the relay
-- counts (a retry, or the failure that dead-letters the row) appends
-- {at, attempt, status, error} to `attempt_log`, in the same UPDATE that
-- marks the outcome, so it costs no write of its own and none at all for
-- an event delivered at its first attempt. Bounded: the last 10 attempts,
-- the first 200 characters of each answer. `dlq show` lists it.
-- A nullable column without a default: a catalog change only. Relays built
-- before it never name it and keep working (their marks leave it NULL).

-- step: transaction
ALTER TABLE outbox ADD COLUMN IF NOT EXISTS attempt_log jsonb;
