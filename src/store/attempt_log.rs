//! The attempt history of a row (`outbox.attempt_log`, migration 0012): each
//! failed attempt the relay counts (a retry, or the failure that
//! dead-letters the row) appends `{at, attempt, status, error}` in the
//! statement that marks it ([`super::outbox`]'s `MARK`), so the history
//! costs no write of its own, and an event delivered at its first attempt
//! has none (`NULL`). Bounded per row: the last [`KEPT`] attempts, the first
//! [`ERROR_CHARS`] characters of each answer. `dlq show` lists it.
//!
//! Not in it: requests whose failure was not counted as an attempt (a row
//! deferred while its route was paused, or waiting for a witness), and what
//! QStash's own retries met (its callbacks say so in `last_error`).

/// Attempts kept per row; an older one makes room for a newer.
pub const KEPT: usize = 10;

/// Characters of each answer kept.
pub const ERROR_CHARS: usize = 200;

/// The `attempt_log` of a row `o` whose failed attempt the mark `u` writes
/// (`u.error` is the answer, `HTTP <status>: <body>` when there was one).
/// Keep the numbers in step with [`KEPT`] and [`ERROR_CHARS`].
macro_rules! attempt_log_append {
    () => {
        "(CASE WHEN jsonb_array_length(coalesce(o.attempt_log, '[]'::jsonb)) >= 10
               THEN o.attempt_log - 0
               ELSE coalesce(o.attempt_log, '[]'::jsonb) END)
         || jsonb_build_object(
                'at', now(),
                'attempt', o.attempt_count + 1,
                'status', substring(u.error FROM 'HTTP ([0-9]{3})')::int,
                'error', left(u.error, 200))"
    };
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_sql_keeps_what_the_constants_say() {
        let sql = attempt_log_append!();
        assert!(sql.contains(&format!(">= {}", super::KEPT)), "{sql}");
        assert!(
            sql.contains(&format!("left(u.error, {})", super::ERROR_CHARS)),
            "{sql}"
        );
    }
}
