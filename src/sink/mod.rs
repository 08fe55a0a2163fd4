//! Where events go: QStash (`/v2/batch`, `/v2/publish`) or a signed webhook,
//! over one shared keep-alive hyper client.

pub mod webhook;
