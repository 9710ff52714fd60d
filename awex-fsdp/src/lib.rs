//! awex backend for fsdp.
