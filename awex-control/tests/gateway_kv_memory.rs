//! A rendezvous value costs the gateway at most twice its JSON size: values are kept as their
//! compact JSON text, not as parsed trees (a 64 KiB array of small numbers parsed into
//! `serde_json::Value`s costs about 16 times its size). Measured with a counting allocator: the
//! bytes the process holds after 16 PUTs of 64 KiB values, minus those it held before.

mod gateway_common;

use awex_control::server::{GatewayConfig, router};
use axum::body::Body;
use axum::http::{Request, header};
use gateway_common::connect_request;
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};
use tower::ServiceExt;

struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: every call is forwarded to the system allocator unchanged; only a counter is added.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        LIVE.fetch_add(l.size() as isize, Ordering::Relaxed);
        // SAFETY: same layout as given
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size() as isize, Ordering::Relaxed);
        // SAFETY: allocated by `alloc` with this layout
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        LIVE.fetch_add(new as isize - l.size() as isize, Ordering::Relaxed);
        // SAFETY: forwarded as given
        unsafe { System.realloc(p, l, new) }
    }
}

#[global_allocator]
static A: Counting = Counting;

async fn put(app: &axum::Router, uri: &str, body: Vec<u8>, method: &str) -> u16 {
    let req = Request::builder()
        .method(method)
        .uri(uri)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body))
        .unwrap();
    let resp = app.clone().oneshot(req).await.unwrap();
    let status = resp.status().as_u16();
    let _ = axum::body::to_bytes(resp.into_body(), usize::MAX).await;
    status
}

#[tokio::test(flavor = "current_thread")]
async fn a_kv_value_costs_at_most_twice_its_json_size() {
    let app = router(GatewayConfig::default());
    let connect = serde_json::to_vec(&connect_request("mem", 1, 1, 1)).unwrap();
    assert_eq!(put(&app, "/v1/pairs", connect, "POST").await, 201);
    // [1,2,...]: 2 bytes of JSON per element, 32 bytes as a serde_json::Value
    let n = 64 * 1024 / 2 - 16;
    let array = format!(
        "[{}]",
        (0..n)
            .map(|i| (i % 10).to_string())
            .collect::<Vec<_>>()
            .join(",")
    );
    let json_size = array.len();
    assert!(json_size <= 64 * 1024);
    let body = format!("{{\"value\": {array}}}").into_bytes();
    const KEYS: usize = 16;
    // warm up everything the route allocates once (routing tables, the pair's map)
    assert_eq!(
        put(&app, "/v1/pairs/mem/kv/warm", body.clone(), "PUT").await,
        201
    );
    let before = LIVE.load(Ordering::SeqCst);
    for k in 0..KEYS {
        let uri = format!("/v1/pairs/mem/kv/k{k}");
        assert_eq!(put(&app, &uri, body.clone(), "PUT").await, 201);
    }
    let held = LIVE.load(Ordering::SeqCst) - before;
    let limit = 2 * (KEYS * json_size) as isize;
    eprintln!("held {held} bytes for {} bytes of JSON", KEYS * json_size);
    assert!(
        held <= limit,
        "{KEYS} values of {json_size} bytes of JSON hold {held} bytes; at most {limit} (2x) allowed"
    );
    assert!(
        held >= (KEYS * json_size) as isize,
        "the values are held ({held} bytes)"
    );
}
