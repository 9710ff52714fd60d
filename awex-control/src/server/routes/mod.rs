//! The route handlers, one file per resource: they parse, authorise, call the pair's state (the
//! update lifecycle lives in `server::lifecycle`) and map its refusals to status codes.

pub(crate) mod engines;
pub(crate) mod events;
pub(crate) mod kv;
pub(crate) mod metrics;
pub(crate) mod openapi;
pub(crate) mod pairs;
pub(crate) mod ranks;
pub(crate) mod updates;
