//! awex backend for sglang.
