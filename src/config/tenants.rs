//! `relay.tenant_fairness`, `relay.tenant_rate` and `[[relay.tenants]]`:
//! how the plain claim shares a shard's rows between tenants, and how fast
//! it may take one tenant's rows (the policy itself is the claim plan's).

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::{ConfigError, RelayConfig};

/// The heaviest weight a tenant may have.
pub const MAX_TENANT_WEIGHT: u32 = 1000;

/// One tenant's weight in the claims' shares (a tenant not listed weighs 1)
/// and, optionally, its own pace.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct TenantWeight {
    /// The tenant, as in `outbox.tenant_id` (a UUID).
    pub id: String,
    /// Its share of a claim against the others' (1 to 1000).
    #[serde(default = "one")]
    pub weight: u32,
    /// The most of its rows the plain claims of this relay take per second
    /// (instead of `relay.tenant_rate`); unset: `relay.tenant_rate`.
    #[serde(default)]
    pub rate: Option<u32>,
}

fn one() -> u32 {
    1
}

/// The tenants' policy, checked: weights and paces by tenant.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TenantPolicy {
    /// The tenants whose weight is given (others weigh 1).
    pub weights: Vec<(Uuid, u32)>,
    /// The tenants whose pace is their own, in rows per second.
    pub rates: Vec<(Uuid, u32)>,
    /// Every other tenant's pace (`relay.tenant_rate`); `None`: unpaced.
    pub default_rate: Option<u32>,
}

impl RelayConfig {
    /// The weights and paces of `[[relay.tenants]]` and `relay.tenant_rate`,
    /// checked; `None` when tenant fairness is off.
    pub fn tenant_policy(&self) -> Result<Option<TenantPolicy>, ConfigError> {
        if !self.tenant_fairness {
            if !self.tenants.is_empty() {
                return Err(ConfigError::invalid(
                    "relay.tenants",
                    "weights tenants' shares of a claim, which only relay.tenant_fairness = true shares: set it, or remove the weights",
                ));
            }
            if self.tenant_rate.is_some() {
                return Err(ConfigError::invalid(
                    "relay.tenant_rate",
                    "paces each tenant's share of the claims, which only relay.tenant_fairness = true shares: set it, or remove the rate",
                ));
            }
            return Ok(None);
        }
        if self.tenant_rate == Some(0) {
            return Err(ConfigError::invalid(
                "relay.tenant_rate",
                "must be at least 1 (rows per second); leave it out for no pace",
            ));
        }
        let mut rates: Vec<(Uuid, u32)> = Vec::new();
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
            match t.rate {
                Some(0) => {
                    return Err(ConfigError::invalid(
                        format!("relay.tenants[{i}].rate"),
                        "must be at least 1 (rows per second); leave it out for relay.tenant_rate",
                    ))
                }
                Some(rate) => rates.push((id, rate)),
                None => {}
            }
            weights.push((id, t.weight));
        }
        Ok(Some(TenantPolicy {
            weights,
            rates,
            default_rate: self.tenant_rate,
        }))
    }
}
