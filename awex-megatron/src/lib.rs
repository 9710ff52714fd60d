//! awex backend for megatron.
