//! A pair whose gateway and ranks all run in this process (`bench apply`, `bench delta`): the
//! gateway on a free loopback port, the pair connected with the caller's options, and every
//! rank's configuration for the caller to run as a task.

use anyhow::Context;
use awex_control::client::Client;
use awex_control::connect::connect_request;
use awex_control::server::{GatewayConfig, bind, serve};
use awex_control::wire::{ApplyMode, PairOptions};
use awex_core::Transport;
use awex_core::layout::Side;
use awex_runtime::rank::{RankConfig, pair_settings};

/// A connected pair and its gateway, ending (the gateway's task aborted) when dropped.
pub(super) struct LocalPair {
    pub client: Client,
    pub name: String,
    /// Every rank of both sides, configured for this pair (its connect uid and apply mode).
    pub ranks: Vec<RankConfig>,
    server: tokio::task::JoinHandle<Result<(), awex_control::server::ServeError>>,
}

impl LocalPair {
    /// Starts a gateway and connects pair `name` of `r` over `transport` with `options`.
    pub async fn connect(
        r: &crate::cmd::plan::Resolved,
        name: String,
        transport: Transport,
        options: PairOptions,
    ) -> anyhow::Result<LocalPair> {
        let listener = bind("127.0.0.1:0".parse()?)?;
        let gateway = format!("http://{}", listener.local_addr()?);
        let server = tokio::spawn(serve(listener, GatewayConfig::default()));
        let client = Client::new(&gateway, None)?;
        let bucket_bytes = options.bucket_mib << 20;
        let mut req = connect_request(&name, r, vec![], options);
        req.transport = transport;
        client.connect(&req).await.context("connecting the pair")?;
        let mut ranks = Vec::new();
        for (side, ids) in [
            (Side::Training, r.training.ranks()),
            (Side::Inference, r.inference.ranks()),
        ] {
            for rank in ids {
                let mut cfg = RankConfig {
                    infer_fp8: None,
                    gateway: gateway.clone(),
                    token: None,
                    pair: name.clone(),
                    side,
                    rank,
                    model: r.spec.model.clone(),
                    train: r.spec.train.clone(),
                    infer: r.spec.infer.clone(),
                    transport,
                    bucket_bytes,
                    host: "127.0.0.1".into(),
                    uid: String::new(),
                    apply: ApplyMode::InPlace,
                    transports: crate::settings::transports()?,
                    gateway_lost: crate::settings::gateway_lost()?,
                    deltas: true,
                };
                (cfg.uid, cfg.apply) = pair_settings(&cfg).await?;
                ranks.push(cfg);
            }
        }
        Ok(LocalPair {
            client,
            name,
            ranks,
            server,
        })
    }
}

impl Drop for LocalPair {
    fn drop(&mut self) {
        self.server.abort();
    }
}
