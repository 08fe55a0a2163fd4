//! The publishers' queue with tenant fairness (without it, each job goes to
//! one publisher's mailbox): jobs the claimers handed out and no publisher
//! has taken yet; a free publisher takes the next. Each tenant has a queue of
//! its own (first in, first out) and the tenants take turns, each taking its
//! weight's number of jobs per turn: the
//! claim shares a claim between tenants, and this shares what is queued
//! behind it, so the rows claimed for a quiet tenant go out with the next
//! free publisher instead of behind every row already claimed for a
//! tenant with a backlog.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use uuid::Uuid;

use super::claim_plan::TenantWeights;
use super::inflight::Lease;
use outbox_client::row::OutboxRow;

/// Rows of one route (and, with fairness, one tenant) for one publisher.
#[derive(Debug)]
pub(crate) struct Job {
    /// Index into the router's routes.
    pub route: usize,
    pub rows: Vec<OutboxRow>,
    pub leases: Vec<Lease>,
}

pub(crate) struct JobQueue {
    weights: Arc<TenantWeights>,
    queues: Mutex<Turns>,
}

#[derive(Default)]
struct Turns {
    by_tenant: HashMap<Uuid, VecDeque<Job>>,
    /// The tenants with jobs queued, the one whose turn it is first.
    turn: VecDeque<Uuid>,
    /// Jobs the tenant whose turn it is has taken in this turn.
    taken_in_turn: u32,
    jobs: usize,
}

impl JobQueue {
    pub(crate) fn new(weights: Arc<TenantWeights>) -> JobQueue {
        JobQueue {
            weights,
            queues: Mutex::default(),
        }
    }

    /// Queues `job` (rows of one tenant) behind its tenant's others.
    pub(crate) fn push(&self, job: Job) {
        let tenant = job.rows.first().map_or(Uuid::nil(), |r| r.tenant_id);
        let mut q = self.lock();
        let queue = q.by_tenant.entry(tenant).or_default();
        if queue.is_empty() {
            q.turn.push_back(tenant);
        }
        q.by_tenant.get_mut(&tenant).expect("queued").push_back(job);
        q.jobs += 1;
    }

    /// The next job: the oldest of the tenant whose turn it is. A turn
    /// ends when the tenant has taken its weight's jobs; it passes on at the
    /// next take, so a tenant that queues meanwhile goes next even when the
    /// one before was alone.
    pub(crate) fn pop(&self) -> Option<Job> {
        let mut q = self.lock();
        let front = *q.turn.front()?;
        if q.taken_in_turn >= self.weight(&front) {
            q.turn.rotate_left(1);
            q.taken_in_turn = 0;
        }
        let tenant = *q.turn.front().expect("a tenant is queued");
        let queue = q
            .by_tenant
            .get_mut(&tenant)
            .expect("a tenant in turn has jobs");
        let job = queue.pop_front().expect("a tenant in turn has jobs");
        if queue.is_empty() {
            q.by_tenant.remove(&tenant);
            q.turn.pop_front();
            q.taken_in_turn = 0;
        } else {
            q.taken_in_turn += 1;
        }
        q.jobs -= 1;
        Some(job)
    }

    fn weight(&self, tenant: &Uuid) -> u32 {
        self.weights.of(tenant)
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.lock().jobs == 0
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.lock().jobs
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Turns> {
        self.queues.lock().expect("job queue lock")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(tenant: u128, id: i64) -> Job {
        let row = OutboxRow {
            id,
            tenant_id: Uuid::from_u128(tenant),
            aggregate_type: "order".into(),
            aggregate_id: id.to_string(),
            event_type: "order.placed".into(),
            payload: "{}".into(),
            headers: Vec::new(),
            idempotency_key: id.to_string(),
            partition_key: id.to_string(),
            created_at: chrono::DateTime::from_timestamp(1_700_000_000, 0).unwrap(),
            attempt: 1,
        };
        Job {
            route: 0,
            rows: vec![row],
            leases: Vec::new(),
        }
    }

    fn drain(q: &JobQueue) -> Vec<i64> {
        std::iter::from_fn(|| q.pop())
            .map(|j| j.rows[0].id)
            .collect()
    }

    fn fair(weights: &[(u128, u32)]) -> JobQueue {
        let weights = weights.iter().map(|&(t, w)| (Uuid::from_u128(t), w));
        JobQueue::new(Arc::new(TenantWeights::new(weights)))
    }

    #[test]
    fn one_tenants_jobs_go_first_in_first_out() {
        let q = fair(&[]);
        for id in 1..=4 {
            q.push(job(1, id));
        }
        assert_eq!(q.len(), 4);
        assert_eq!(drain(&q), [1, 2, 3, 4]);
        assert!(q.is_empty());
    }

    #[test]
    fn a_tenant_queued_behind_a_backlog_goes_next() {
        let q = fair(&[]);
        for id in 1..=5 {
            q.push(job(1, id));
        }
        q.push(job(2, 100));
        q.push(job(2, 101));
        assert_eq!(drain(&q), [1, 100, 2, 101, 3, 4, 5]);
    }

    #[test]
    fn a_tenant_that_comes_back_waits_for_its_turn_only() {
        let q = fair(&[]);
        q.push(job(1, 1));
        q.push(job(1, 2));
        q.push(job(1, 3));
        assert_eq!(q.pop().unwrap().rows[0].id, 1);
        q.push(job(2, 100));
        // Tenant 1's turn ended with its first job: 2 goes next.
        assert_eq!(drain(&q), [100, 2, 3]);
        q.push(job(2, 101));
        q.push(job(1, 4));
        assert_eq!(drain(&q), [101, 4]);
    }

    #[test]
    fn weights_set_how_many_jobs_a_tenant_takes_per_turn() {
        let q = fair(&[(1, 3)]);
        for id in 1..=6 {
            q.push(job(1, id));
        }
        for id in 100..=102 {
            q.push(job(2, id));
        }
        assert_eq!(drain(&q), [1, 2, 3, 100, 4, 5, 6, 101, 102]);
    }
}
