//! awex-control: the control plane of awex.
//!
//! - [`wire`]: the gateway's JSON protocol (connect, join, events, kv, updates, reports) and
//!   its limits, shared by every party;
//! - [`client`]: the typed client the ranks and controllers use;
//! - [`body`]: reading an HTTP answer with a bound (every answer awex reads goes through it);
//! - [`probe`]: gathers the facts backends detect their engines from (`python3`, a server's
//!   info routes) into a data-only [`awex_core::backend::Probe`];
//! - [`connect`]: the connect request of a resolved pair;
//! - `server` (feature `server`): the axum gateway (`awex-cli serve`), which never touches
//!   tensor bytes and drives inference engines only through their backend's
//!   [`awex_core::backend::EngineControl`].

#![warn(missing_docs)]

pub mod body;
pub mod client;
pub mod connect;
pub mod probe;
#[cfg(feature = "server")]
pub mod server;
pub mod wire;
