//! The route handlers, one file per resource, and the lifecycle of updates they drive.

pub(crate) mod events;
pub(crate) mod kv;
pub(crate) mod metrics;
pub(crate) mod openapi;
pub(crate) mod pairs;
pub(crate) mod ranks;
pub(crate) mod updates;
