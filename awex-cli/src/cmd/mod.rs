//! One module per subcommand.

pub mod detect;
pub mod pair;
pub mod plan;
pub mod serve;
