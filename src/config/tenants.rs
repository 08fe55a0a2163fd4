//! `relay.tenant_fairness` and `[[relay.tenants]]`: how the plain claim
//! shares a shard's rows between tenants (the policy itself is the claim
//! plan's).

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::{ConfigError, RelayConfig};

/// The heaviest weight a tenant may have.
pub const MAX_TENANT_WEIGHT: u32 = 1000;

/// One tenant's weight in the claims' shares (a tenant not listed weighs 1).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct TenantWeight {
    /// The tenant, as in `outbox.tenant_id` (a UUID).
    pub id: String,
    /// Its share of a claim against the others' (1 to 1000).
    pub weight: u32,
}

impl RelayConfig {
    /// The weights of `[[relay.tenants]]` by tenant, checked; `None` when
    /// tenant fairness is off.
    pub fn tenant_weights(&self) -> Result<Option<Vec<(Uuid, u32)>>, ConfigError> {
        if !self.tenant_fairness {
            if !self.tenants.is_empty() {
                return Err(ConfigError::invalid(
                    "relay.tenants",
                    "weights tenants' shares of a claim, which only relay.tenant_fairness = true shares: set it, or remove the weights",
                ));
            }
            return Ok(None);
        }
        let mut weights: Vec<(Uuid, u32)> = Vec::with_capacity(self.tenants.len());
        for (i, t) in self.tenants.iter().enumerate() {
            let id = Uuid::parse_str(&t.id).map_err(|e| {
                ConfigError::invalid(
                    format!("relay.tenants[{i}].id"),
                    format!("must be a tenant id as in outbox.tenant_id, a UUID ({e})"),
                )
            })?;
            if t.weight == 0 || t.weight > MAX_TENANT_WEIGHT {
                return Err(ConfigError::invalid(
                    format!("relay.tenants[{i}].weight"),
                    format!("must be between 1 and {MAX_TENANT_WEIGHT}"),
                ));
            }
            if let Some(j) = weights.iter().position(|(other, _)| *other == id) {
                return Err(ConfigError::invalid(
                    format!("relay.tenants[{i}].id"),
                    format!("names the same tenant as relay.tenants[{j}]"),
                ));
            }
            weights.push((id, t.weight));
        }
        Ok(Some(weights))
    }
}
