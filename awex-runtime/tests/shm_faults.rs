//! Shared memory under faults and attack: control segments whose counts and indices are
//! hostile, ranks that disagree on bucket size, segment permissions, and the lifecycle of the
//! segments of killed ranks (exact pair matching, liveness by lock, reclaimed after SIGKILL).

use awex_core::DType;
use awex_core::layout::{RankId, Side, SideLayout};
use awex_core::plan::Pair;
use awex_core::synthetic::{SyntheticSide, TensorSplit, catalogue};
use awex_runtime::host::{ShmScope, shm_data_segment};
use awex_runtime::shm::{ShmSegment, gc, is_live, list_segments, parse_name, segment_name};
use awex_runtime::transport::{ShmTransport, Transport};
use awex_runtime::{RuntimeError, TensorSet};
use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

fn uid() -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "{:08x}{:08x}{:016x}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64
    )
}

/// A sender (bucket `sb` bytes) and a receiver (bucket `rb`) of one 64 x 64 tensor.
fn pair_of(sb: u64, rb: u64) -> (ShmTransport, ShmTransport, serde_json::Value) {
    let cat = catalogue(&[vec![64, 64]]);
    let side = |side| {
        SyntheticSide {
            side,
            engines: 1,
            replicas: 1,
            shards: 1,
            splits: vec![TensorSplit {
                dim: 0,
                cuts: vec![],
                pad: 0,
            }],
            dtype: DType::Bf16,
            fuse: false,
        }
        .build(&cat)
    };
    let (train, infer) = (side(Side::Training), side(Side::Inference));
    let pair = Pair {
        catalogue: &cat,
        training: &train,
        inference: &infer,
        encode_on_sender: false,
    };
    let scope = ShmScope::new("shmfaults", &uid());
    let (t, i) = (RankId::train(0), RankId::infer(0, 0));
    let data = Arc::new(
        TensorSet::allocate_shm(&train.rank_layout(t).unwrap(), &scope.name("t0.0", "data"))
            .unwrap(),
    );
    let tx = ShmTransport::new(
        Arc::new(pair.plan_rank(Side::Training, t).unwrap()),
        data,
        sb,
        &scope.name("t0.0", "ctl"),
    )
    .unwrap();
    let rx = ShmTransport::new(
        Arc::new(pair.plan_rank(Side::Inference, i).unwrap()),
        Arc::new(TensorSet::allocate_host(&infer.rank_layout(i).unwrap()).unwrap()),
        rb,
        "unused",
    )
    .unwrap();
    let rdv = tx.rendezvous();
    (tx, rx, rdv)
}

fn connect(rx: &mut ShmTransport, rdv: serde_json::Value) -> Result<(), RuntimeError> {
    rx.connect(&HashMap::from([(RankId::train(0), rdv)]))
}

#[test]
fn ranks_with_different_bucket_sizes_are_refused_clearly() {
    let (_tx, mut rx, rdv) = pair_of(256, 512);
    let e = connect(&mut rx, rdv).unwrap_err().to_string();
    assert!(
        e.contains("buckets of 256 bytes, this rank 512") && e.contains("bucket_mib"),
        "{e}"
    );
}

/// Writes words into a peer's control segment, as a hostile or broken peer could.
fn poke(name: &str, at: usize, v: u64) {
    let seg = ShmSegment::open(name).unwrap();
    assert!(at * 8 + 8 <= seg.len());
    // SAFETY: in bounds (checked above), aligned (page-aligned mapping), plain shared memory.
    unsafe { (seg.ptr().add(at * 8) as *mut u64).write_volatile(v) };
}

#[test]
fn counts_that_overflow_are_refused_not_multiplied() {
    let (_tx, mut rx, rdv) = pair_of(256, 256);
    let ctl = rdv["ctl"].as_str().unwrap().to_string();
    // 3 * n_tensors wraps around 2^64
    poke(&ctl, 3, u64::MAX / 2);
    let e = connect(&mut rx, rdv).unwrap_err().to_string();
    assert!(e.contains("not an awex control segment"), "{e}");
}

#[test]
fn checksum_indices_outside_the_peers_table_are_refused() {
    let (_tx, mut rx, rdv) = pair_of(256, 256);
    let ctl = rdv["ctl"].as_str().unwrap().to_string();
    // the single peer entry sits after the single tensor entry: words 8+3 .. 8+6
    poke(&ctl, 8 + 3 + 1, 1 << 40); // its first checksum index
    let e = connect(&mut rx, rdv).unwrap_err().to_string();
    assert!(e.contains("bucket sizes or plans disagree"), "{e}");
}

#[test]
fn segments_are_created_owner_only() {
    use std::os::unix::fs::PermissionsExt;
    let name = segment_name("modetest", &uid(), "t0.0", "data");
    let _s = ShmSegment::create(&name, 4096).unwrap();
    let mode = std::fs::metadata(format!("/dev/shm/{name}"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
}

#[test]
fn names_match_their_pair_exactly() {
    let u = uid();
    let a = segment_name("s6-job", &u, "t0.1", "data");
    let b = segment_name("s6-job-2", &u, "i1.0", "ctl");
    assert_eq!(parse_name(&a).unwrap().pair, "s6-job");
    assert_eq!(parse_name(&b).unwrap().pair, "s6-job-2");
    assert_eq!(parse_name(&b).unwrap().who, "i1.0");
    let c = segment_name("s6-job", &u, "t0.1.0a1b2c3d", "ctl");
    assert_eq!(parse_name(&c).unwrap().who, "t0.1.0a1b2c3d");
    assert!(
        parse_name("awex-s6-job-123-data").is_none(),
        "old pid names"
    );
}

/// A dead segment of `s6-job-2` is not reclaimed by a gc of `s6-job` (run inside the
/// kill-cycle test: a gc of every pair runs there).
fn gc_matches_the_pair_exactly() {
    let b = segment_name("s6-job-2", &uid(), "i1.0", "ctl");
    let seg = ShmSegment::create(&b, 64).unwrap();
    drop_without_unlink(seg);
    assert_eq!(is_live(&b), Some(false));
    assert!(!gc(Some("s6-job")).contains(&b));
    assert!(list_segments(&b).contains(&b));
    assert!(gc(Some("s6-job-2")).contains(&b));
}

/// Leaves a segment behind as a killed process would (no unlink), lock released.
fn drop_without_unlink(seg: ShmSegment) {
    let name = seg.name().to_string();
    // forgetting keeps the name, the mapping and the creator's lock fd: undo the last two as
    // the kernel does at exit (the mapping holds the locked file open too)
    let (ptr, len) = (seg.ptr(), seg.len());
    std::mem::forget(seg);
    // SAFETY: the forgotten segment's own mapping, not used again.
    unsafe { libc_munmap(ptr.cast(), len) };
    close_lock_fds(&name);
}

/// Closes this process's descriptors that point at `/dev/shm/name` (the forgotten lock).
fn close_lock_fds(name: &str) {
    for e in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
        if let Ok(t) = std::fs::read_link(e.path())
            && t.to_string_lossy() == format!("/dev/shm/{name}")
            && let Ok(fd) = e.file_name().to_string_lossy().parse::<i32>()
        {
            // SAFETY: closing a descriptor nothing else in this test uses.
            unsafe { libc_close(fd) };
        }
    }
}

unsafe extern "C" {
    #[link_name = "close"]
    fn libc_close(fd: i32) -> i32;
    #[link_name = "munmap"]
    fn libc_munmap(addr: *mut std::ffi::c_void, len: usize) -> i32;
}

const CHILD: &str = "AWEX_SHM_CHILD_SCOPE";

/// Not a test on its own: the body of the child process of the kill-cycle test.
#[test]
fn child_holds_segments() {
    let Ok(scope) = std::env::var(CHILD) else {
        return;
    };
    let (pair, uid) = scope.split_once(':').unwrap();
    let scope = ShmScope::new(pair, uid);
    // as a rank does: name the data segment (reclaiming the dead), create it and a control
    let data = ShmSegment::create(&shm_data_segment(&scope, RankId::train(0)), 1 << 16).unwrap();
    let ctl = ShmSegment::create(&scope.name("t0.0", "ctl"), 4096).unwrap();
    println!("ready {} {}", data.name(), ctl.name());
    use std::io::Write;
    std::io::stdout().flush().unwrap();
    std::thread::sleep(Duration::from_secs(60));
}

/// 30 times: a rank creates its segments and is SIGKILLed. Its segments stay live while it
/// runs (whatever its PID namespace: liveness is its lock, not /proc), the next start reclaims
/// them, and none is left at the end.
#[test]
fn segments_of_sigkilled_ranks_are_reclaimed_30_times() {
    gc_matches_the_pair_exactly();
    let pair = format!("killcycle{}", std::process::id());
    let exe = std::env::current_exe().unwrap();
    let mine = || {
        list_segments("awex-")
            .into_iter()
            .filter(|n| parse_name(n).is_some_and(|p| p.pair == pair))
            .collect::<Vec<_>>()
    };
    for cycle in 0..30 {
        // a fresh connect each cycle (a new uid), or the same connect restarted
        let u = if cycle % 2 == 0 {
            uid()
        } else {
            "0".repeat(32)
        };
        let mut child = Command::new(&exe)
            .args(["--exact", "child_holds_segments", "--nocapture"])
            .env(CHILD, format!("{pair}:{u}"))
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        let started = Instant::now();
        // the harness may print on the same line ("test child_holds_segments ... ready ...")
        while !line.contains("ready ") {
            line.clear();
            assert!(
                out.read_line(&mut line).unwrap() > 0,
                "child exited: cycle {cycle}"
            );
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "child never ready"
            );
        }
        let at = line.find("ready ").unwrap_or(0);
        let names: Vec<&str> = line[at..].split_whitespace().skip(1).take(2).collect();
        assert_eq!(names.len(), 2);
        for n in &names {
            assert_eq!(is_live(n), Some(true), "cycle {cycle}: {n} is live");
        }
        // the live rank's segments are never swept, even by a gc of its own pair
        assert!(gc(Some(&pair)).is_empty(), "cycle {cycle}");
        assert_eq!(
            mine().len(),
            2,
            "cycle {cycle}: only the live rank's segments"
        );
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        for n in &names {
            assert_eq!(is_live(n), Some(false), "cycle {cycle}: {n} is dead");
        }
    }
    // the last rank's segments: reclaimed by `gc` (or the next start on the host)
    assert_eq!(gc(Some(&pair)).len(), 2);
    assert_eq!(mine(), Vec::<String>::new());
}
