//! This replica's name: one live process per name. Two relays under one
//! `relay.replica_id` would each take the shards held under that name as
//! their own (a restart's rule) and take them from each other every round.
//! So each relay draws an instance token at start, and a heartbeat under a
//! name whose row holds another instance with a current heartbeat is refused
//! (`store::shards`).
//!
//! At start, [`claim_name`] tells "an earlier process under this name that
//! died" from "another one alive": it watches the holder's heartbeat for one
//! of its periods (a quarter of its `relay.shard_lease`) and one second more.
//! If the heartbeat moved on, the name is taken and the relay refuses to
//! start; if not, the holder is gone and the row is taken over. A holder that
//! was only stalled that long finds its next heartbeat refused and stops
//! claiming (the coordinator), so two never run under one name.

use std::time::{Duration, Instant};

use crate::store::shards::{Heartbeat, Holder, Replica};
use crate::store::{Store, StoreError};

/// How often the start looks at the holder's heartbeat again.
const LOOK_EVERY: Duration = Duration::from_millis(200);

/// How long a holder's heartbeat may stand still before it counts as gone:
/// one of its rounds (a quarter of its lease) and a second.
fn patience(holder: &Holder) -> Duration {
    holder.alive_for / 4 + Duration::from_secs(1)
}

/// Announces `me` under its name, alive for `alive_for`; `Err(holder)` when
/// another live process holds the name.
pub(crate) async fn claim_name(
    store: &Store,
    me: &Replica,
    alive_for: Duration,
) -> Result<Result<(), Holder>, StoreError> {
    let mut session = store.session();
    let mut first: Option<(Holder, Instant)> = None;
    loop {
        let silent = first
            .as_ref()
            .filter(|(h, since)| since.elapsed() >= patience(h))
            .map(|(h, _)| h);
        match session.heartbeat(me, alive_for, silent).await? {
            Heartbeat::Beat { .. } => {
                if let Some(h) = silent {
                    tracing::info!(
                        replica = %me.id,
                        host = %h.hostname,
                        pid = h.pid,
                        "took the replica name over from a process whose heartbeat stopped"
                    );
                }
                return Ok(Ok(()));
            }
            Heartbeat::Refused(holder) => match &first {
                None => {
                    tracing::info!(
                        replica = %me.id,
                        host = %holder.hostname,
                        pid = holder.pid,
                        wait = ?patience(&holder),
                        "another process's heartbeat under this replica name is current; waiting to see whether it is still alive"
                    );
                    first = Some((holder, Instant::now()));
                }
                Some((seen, _)) if silent.is_some() || holder != *seen => {
                    return Ok(Err(holder));
                }
                Some(_) => {}
            },
        }
        tokio::time::sleep(LOOK_EVERY).await;
    }
}

/// Why the name cannot be used, and what to do.
pub(crate) fn name_taken(me: &Replica, holder: &Holder) -> String {
    format!(
        "configuration key `relay.replica_id`: \"{}\" is in use by a live relay on host {} (pid {}, running since {}, last heartbeat {}); two relays under one name take each other's shards. Give each replica its own relay.replica_id, or leave it empty for a name of its own. A replica restarted under its name gets it back once the old process's heartbeat stops (within about {} s)",
        me.id,
        holder.hostname,
        holder.pid,
        holder.started_at.format("%Y-%m-%d %H:%M:%S UTC"),
        holder.seen_at.format("%Y-%m-%d %H:%M:%S%.3f UTC"),
        patience(holder).as_secs_f64().ceil(),
    )
}
