//! The relay's HTTP endpoints. Operations (`/metrics`, `/healthz`, `/readyz`)
//! listen on a private address; QStash's failure callback gets a listener of
//! its own, since it must face the internet.

pub mod callback;
pub(crate) mod guarded;
pub mod ops;
