//! The statements of tenant fairness: which tenants have rows pending in a
//! shard, and each one's share of a plain claim. The policy (who gets how
//! much) is the claim plan's ([`crate::actors::claim_plan`]); both statements
//! go through `outbox_tenant_ready_idx` (migration 0013,
//! `(tenant_id, bucket, available_at, id)` over the pending rows), so neither
//! reads one tenant's rows to find another's: a tenant with a million rows
//! pending costs the others one index descent.

use tokio_postgres::types::Type;
use uuid::Uuid;

use super::outbox::{claimed, ClaimScope, Claimed, Cursor};
use super::{Fence, Session, Sql, StoreError};

/// Up to `$1` tenants with a pending row in shard `$2` (token `$4`), in
/// tenant id order from after `$3`, wrapping around to the first tenant: a
/// loose index scan over the tenants of the whole outbox (one descent each,
/// lazy: it stops once it has `$1`), each checked for a pending row in the
/// shard's range with one more descent. Written as a LATERAL ordered by
/// bucket with `LIMIT 1` so that only the tenant index serves it: on a fresh
/// backlog (no ANALYZE yet) the generic plan of an `EXISTS` hashed the whole
/// pending set, and an unordered probe walked another pending index with a
/// filter. A fenced claim reads nothing.
pub(super) const TENANTS: Sql = Sql {
    text: concat!(
        "WITH RECURSIVE ",
        fence!("$4"),
        ", after_cursor (tenant_id) AS (
    (SELECT tenant_id FROM outbox
     WHERE tenant_id > $3 AND published_at IS NULL AND dead_lettered_at IS NULL
       AND EXISTS (SELECT 1 FROM fence)
     ORDER BY tenant_id
     LIMIT 1)
    UNION ALL
    SELECT next.tenant_id FROM after_cursor AS prev, LATERAL (
        SELECT tenant_id FROM outbox
        WHERE tenant_id > prev.tenant_id AND published_at IS NULL AND dead_lettered_at IS NULL
        ORDER BY tenant_id
        LIMIT 1) AS next
), up_to_cursor (tenant_id) AS (
    (SELECT tenant_id FROM outbox
     WHERE tenant_id <= $3 AND published_at IS NULL AND dead_lettered_at IS NULL
       AND EXISTS (SELECT 1 FROM fence)
     ORDER BY tenant_id
     LIMIT 1)
    UNION ALL
    SELECT next.tenant_id FROM up_to_cursor AS prev, LATERAL (
        SELECT tenant_id FROM outbox
        WHERE tenant_id > prev.tenant_id AND tenant_id <= $3
          AND published_at IS NULL AND dead_lettered_at IS NULL
        ORDER BY tenant_id
        LIMIT 1) AS next
)
SELECT t.tenant_id FROM (
    SELECT tenant_id FROM after_cursor
    UNION ALL
    SELECT tenant_id FROM up_to_cursor
) AS t, LATERAL (
    SELECT 1 FROM outbox AS o
    WHERE o.tenant_id = t.tenant_id
      AND o.bucket >= (SELECT bucket_lo FROM fence) AND o.bucket < (SELECT bucket_hi FROM fence)
      AND o.published_at IS NULL AND o.dead_lettered_at IS NULL
    ORDER BY o.bucket
    LIMIT 1) AS here
LIMIT $1"
    ),
    types: &[Type::INT8, Type::INT2, Type::UUID, Type::INT8],
};

/// The plain claim, tenant by tenant: for each tenant of `$1` (with its
/// share `$3` and its own cursor `($4, $5, $6)`), up to its share of its due
/// rows of shard `$2` that an unordered route takes, in the plain claim's
/// order, read through `outbox_tenant_ready_idx` from the tenant's cursor.
/// `$7`: the shard's token; `$8`, `$10`: every route's pattern and whether
/// it is ordered; `$9`: the rows out here.
pub(super) const CLAIM_TENANTS: Sql = Sql {
    text: concat!(
        "WITH ",
        fence!("$7"),
        "
SELECT c.* FROM unnest($1::uuid[], $3::int8[], $4::int2[], $5::timestamptz[], $6::int8[])
     AS t(tenant_id, share, bucket, available_at, id),
LATERAL (
    SELECT ",
        claimed_columns!(),
        "
    FROM outbox AS o
    WHERE o.tenant_id = t.tenant_id
      AND o.bucket >= (SELECT bucket_lo FROM fence) AND o.bucket < (SELECT bucket_hi FROM fence)
      AND (o.bucket, o.available_at, o.id) > (t.bucket, t.available_at, t.id)
      AND ",
        unordered_due!("$8", "$10", "$9"),
        "
    ORDER BY o.bucket, o.available_at, o.id
    LIMIT t.share) AS c"
    ),
    types: &[
        Type::UUID_ARRAY,
        Type::INT2,
        Type::INT8_ARRAY,
        Type::INT2_ARRAY,
        Type::TIMESTAMPTZ_ARRAY,
        Type::INT8_ARRAY,
        Type::INT8,
        Type::TEXT_ARRAY,
        Type::INT8_ARRAY,
        Type::BOOL_ARRAY,
    ],
};

/// One tenant's part of a claim: up to `share` rows, after `after`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct TenantShare {
    pub tenant: Uuid,
    pub share: i64,
    pub after: Cursor,
}

impl Session {
    /// Up to `limit` tenants with rows pending in `fence`'s shard, in tenant
    /// order from after `after`, wrapping around.
    pub(crate) async fn tenants_pending(
        &mut self,
        fence: Fence,
        after: Uuid,
        limit: i64,
    ) -> Result<Vec<Uuid>, StoreError> {
        let shard = fence.shard.sql();
        bounded!(self, async {
            let (conn, statement) = self.prepared(&TENANTS).await?;
            let rows = conn
                .query(&statement, &[&limit, &shard, &after, &fence.token])
                .await?;
            Ok(rows.iter().map(|r| r.get(0)).collect())
        })
    }

    /// Each tenant's share of the scope's shard's due rows of the unordered
    /// routes, from its own cursor on, in one statement. Nothing is written.
    pub(crate) async fn claim_tenants(
        &mut self,
        scope: &ClaimScope<'_>,
        shares: &[TenantShare],
    ) -> Result<Vec<Claimed>, StoreError> {
        let shard = scope.fence.shard.sql();
        let tenants: Vec<Uuid> = shares.iter().map(|s| s.tenant).collect();
        let limits: Vec<i64> = shares.iter().map(|s| s.share).collect();
        let buckets: Vec<i16> = shares.iter().map(|s| s.after.0).collect();
        let available: Vec<_> = shares.iter().map(|s| s.after.1).collect();
        let ids: Vec<i64> = shares.iter().map(|s| s.after.2).collect();
        let patterns: Vec<&str> = scope.routes.iter().map(|r| r.like.as_str()).collect();
        let ordered: Vec<bool> = scope.routes.iter().map(|r| r.ordered).collect();
        bounded!(self, async {
            let (conn, statement) = self.prepared(&CLAIM_TENANTS).await?;
            let rows = conn
                .query(
                    &statement,
                    &[
                        &tenants,
                        &shard,
                        &limits,
                        &buckets,
                        &available,
                        &ids,
                        &scope.fence.token,
                        &patterns,
                        &scope.out,
                        &ordered,
                    ],
                )
                .await?;
            Ok(rows.iter().map(claimed).collect())
        })
    }
}
