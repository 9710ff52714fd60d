//! Every HTTP answer awex reads is read with a bound: a server that answers without end (a
//! wrong URL, a broken or hostile engine) is refused once its answer passes the bound, and the
//! rest is never read. The server counts what it got out, so each test bounds the work done,
//! not the time taken.

mod endless_server;

use awex_control::body::{MAX_ENGINE_ANSWER_BYTES, MAX_GATEWAY_ANSWER_BYTES};
use awex_control::client::Client;
use endless_server::endless;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// What the kernel's socket buffers on both ends may hold past what the reader took.
const IN_FLIGHT: u64 = 32 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_probed_server_that_answers_without_end_is_refused_at_the_bound() {
    let server = endless(512 << 20, None).await;
    let e = awex_control::probe::get_json(&server.url, "/server_info", Duration::from_secs(300))
        .await
        .unwrap_err();
    assert!(
        e.ends_with("its answer runs past the 16 MiB awex reads from it (left unread)"),
        "{e}"
    );
    let sent = server.sent.load(Ordering::SeqCst);
    assert!(
        sent <= MAX_ENGINE_ANSWER_BYTES + IN_FLIGHT,
        "{sent} bytes were taken"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_probed_server_that_declares_a_huge_answer_is_refused_before_it_is_read() {
    let server = endless(512 << 20, Some(1 << 40)).await;
    let e = awex_control::probe::get_json(&server.url, "/server_info", Duration::from_secs(300))
        .await
        .unwrap_err();
    assert!(
        e.ends_with("its answer is 1099511627776 bytes, more than the 16 MiB awex reads from it"),
        "{e}"
    );
    let sent = server.sent.load(Ordering::SeqCst);
    assert!(sent <= IN_FLIGHT, "{sent} bytes were taken");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_client_reads_at_most_its_bound_of_an_answer() {
    let server = endless(1 << 30, None).await;
    let client = Client::new(&server.url, None).unwrap();
    let e = client.status("p").await.unwrap_err().to_string();
    assert!(
        e.contains("its answer runs past the 256 MiB awex reads from it"),
        "{e}"
    );
    let sent = server.sent.load(Ordering::SeqCst);
    assert!(
        sent <= MAX_GATEWAY_ANSWER_BYTES + IN_FLIGHT,
        "{sent} bytes were taken"
    );
}
