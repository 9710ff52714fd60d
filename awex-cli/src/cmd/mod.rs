//! One module per subcommand.

pub mod bench;
pub mod demo;
pub mod detect;
pub mod gc;
pub mod live;
pub mod pair;
pub mod plan;
pub mod quant;
pub mod serve;
pub mod worker;
