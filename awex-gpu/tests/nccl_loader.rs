//! The NCCL loader and communicator against no library and against stub libraries built here
//! with the system C compiler: search order, version gate, missing symbols, unique ids, and a
//! communicator's init, groups, timeouts, aborts and teardown, call by call.

use awex_core::layout::{RankId, Side};
use awex_gpu::nccl::{
    Communicator, Library, NcclError, OpKind, P2p, UID_KEY, UniqueId, candidates, creates_uid,
};
use proptest::prelude::*;
use std::ffi::OsString;
use std::time::{Duration, Instant};

mod stub_nccl;
use stub_nccl::{load, stub, stub_log};

#[test]
fn search_order_is_env_then_soname_then_dev_name() {
    let c = candidates(Some(OsString::from("/opt/nccl/lib/libnccl.so.2")));
    assert_eq!(
        c,
        vec![
            OsString::from("/opt/nccl/lib/libnccl.so.2"),
            OsString::from("libnccl.so.2"),
            OsString::from("libnccl.so"),
        ]
    );
    assert_eq!(
        candidates(None),
        vec![OsString::from("libnccl.so.2"), OsString::from("libnccl.so")]
    );
}

#[test]
fn no_library_error_names_every_path_tried() {
    // stands in for AWEX_NCCL_LIBRARY=<missing> plus fallback names no machine has
    let tried = [
        OsString::from("/nonexistent/awex/libnccl.so.2"),
        OsString::from("libnccl-awex-absent.so.2"),
    ];
    let e = Library::load_first(&tried).unwrap_err();
    let NcclError::NotFound { tried: got } = &e else {
        panic!("expected NotFound, got {e:?}");
    };
    assert_eq!(
        got.iter().map(|(p, _)| p.as_str()).collect::<Vec<_>>(),
        ["/nonexistent/awex/libnccl.so.2", "libnccl-awex-absent.so.2"]
    );
    assert_eq!(
        got[0].1,
        "cannot open shared object file: No such file or directory"
    );
    assert_eq!(
        e.to_string(),
        "no NCCL library found: tried /nonexistent/awex/libnccl.so.2 (cannot open shared object file: No such file or directory), libnccl-awex-absent.so.2 (cannot open shared object file: No such file or directory); install NCCL 2.19 or newer (e.g. `pip install nvidia-nccl-cu12`) and put it on the library path, or set AWEX_NCCL_LIBRARY to the full path of libnccl.so.2"
    );
}

#[test]
fn a_missing_env_path_falls_back_to_the_next_candidate() {
    let Some((_d, path)) = stub(&[]) else { return };
    let lib = Library::load_first(&[
        OsString::from("/nonexistent/awex/libnccl.so.2"),
        path.clone().into_os_string(),
    ])
    .unwrap();
    assert_eq!(lib.path(), path.to_str().unwrap());
}

#[test]
fn stub_nccl_2_19_3_loads_and_reports_version_and_path() {
    let Some((_d, path)) = stub(&["VERSION=21903"]) else {
        return;
    };
    let lib = Library::load_from(&path).unwrap();
    assert_eq!(lib.version().to_string(), "2.19.3");
    assert_eq!(
        (
            lib.version().major,
            lib.version().minor,
            lib.version().patch
        ),
        (2, 19, 3)
    );
    assert_eq!(lib.path(), path.to_str().unwrap());
    assert!(lib.has_finalize());
    assert_eq!(
        format!("{lib:?}"),
        format!("Library(NCCL 2.19.3 at {})", path.display())
    );
}

#[test]
fn nccl_older_than_2_19_is_refused_with_version_and_path() {
    let Some((_d, path)) = stub(&["VERSION=21803"]) else {
        return;
    };
    let e = Library::load_from(&path).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "NCCL 2.18.3 found at {}; awex needs 2.19 or newer",
            path.display()
        )
    );
    // the pre-2.9 encoding decodes too
    let Some((_d2, old)) = stub(&["VERSION=2804"]) else {
        return;
    };
    assert_eq!(
        Library::load_from(&old).unwrap_err().to_string(),
        format!(
            "NCCL 2.8.4 found at {}; awex needs 2.19 or newer",
            old.display()
        )
    );
}

#[test]
fn a_missing_entry_point_is_named() {
    let Some((_d, path)) = stub(&["OMIT_SEND"]) else {
        return;
    };
    assert_eq!(
        Library::load_from(&path).unwrap_err().to_string(),
        format!(
            "the NCCL library at {} lacks `ncclSend`; awex needs NCCL 2.19 or newer",
            path.display()
        )
    );
}

#[test]
fn finalize_is_optional_and_teardown_destroys_without_it() {
    let Some((_d, path)) = stub(&["OMIT_FINALIZE"]) else {
        return;
    };
    let lib = load(&path);
    assert!(!lib.has_finalize());
    let uid = lib.unique_id().unwrap();
    let comm = Communicator::init(lib.clone(), &uid, 2, 0, Duration::from_secs(5)).unwrap();
    comm.destroy(Duration::from_secs(1)).unwrap();
    assert!(
        stub_log(&path).ends_with(";destroy;"),
        "{}",
        stub_log(&path)
    );
}

#[test]
fn unique_id_comes_from_the_library_and_round_trips_through_the_kv_value() {
    let Some((_d, path)) = stub(&[]) else { return };
    let lib = load(&path);
    let uid = lib.unique_id().unwrap();
    let want: Vec<u8> = (0..128u32).map(|i| (i * 7 + 1) as u8).collect();
    assert_eq!(uid.0.to_vec(), want);
    let hex = uid.to_hex();
    assert_eq!(hex.len(), 256);
    assert_eq!(&hex[..8], "01080f16");
    assert_eq!(uid.to_kv(), serde_json::Value::String(hex.clone()));
    assert_eq!(UniqueId::from_kv(&uid.to_kv()).unwrap(), uid);
    assert_eq!(UID_KEY, "nccl.uid");
    assert!(creates_uid(Side::Training, RankId::train(0)));
    assert!(!creates_uid(Side::Training, RankId::train(1)));
    assert!(!creates_uid(Side::Inference, RankId::infer(0, 0)));
}

#[test]
fn bad_unique_ids_are_refused_with_the_expected_shape() {
    for bad in [
        "",
        "abc",
        &"zz".repeat(128),
        &"0".repeat(255),
        &"é".repeat(128),
    ] {
        let e = UniqueId::from_hex(bad).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!("bad NCCL unique id `{bad}`: expected 256 hex digits (128 bytes)")
        );
    }
    assert_eq!(
        UniqueId::from_kv(&serde_json::json!(42))
            .unwrap_err()
            .to_string(),
        "bad NCCL unique id `42`: expected 256 hex digits (128 bytes)"
    );
    // upper-case digits are accepted
    assert_eq!(
        UniqueId::from_hex(&"AB".repeat(128)).unwrap(),
        UniqueId([0xab; 128])
    );
}

proptest! {
    #[test]
    fn unique_id_hex_round_trips(bytes in proptest::collection::vec(any::<u8>(), 128)) {
        let mut b = [0u8; 128];
        b.copy_from_slice(&bytes);
        let uid = UniqueId(b);
        prop_assert_eq!(UniqueId::from_hex(&uid.to_hex()).unwrap(), uid);
        let json = serde_json::to_string(&uid).unwrap();
        prop_assert_eq!(serde_json::from_str::<UniqueId>(&json).unwrap(), uid);
        prop_assert_eq!(uid.to_string().parse::<UniqueId>().unwrap(), uid);
    }
}

#[test]
fn init_is_non_blocking_and_polls_until_ready() {
    let Some((_d, path)) = stub(&["INIT_PENDING=3"]) else {
        return;
    };
    let lib = load(&path);
    let uid = lib.unique_id().unwrap();
    let comm = Communicator::init(lib.clone(), &uid, 6, 4, Duration::from_secs(5)).unwrap();
    assert_eq!((comm.rank(), comm.nranks()), (4, 6));
    assert_eq!(
        stub_log(&path),
        "init nranks=6 rank=4 id[0]=1 id[127]=122 size=48 magic=cafebeef version=21900 blocking=0 min_ctas=-2147483648;"
    );
    comm.destroy(Duration::from_secs(1)).unwrap();
    assert!(stub_log(&path).ends_with(";finalize;destroy;"));
}

#[test]
fn init_that_never_finishes_is_aborted_at_its_deadline() {
    let Some((_d, path)) = stub(&["INIT_PENDING=-1"]) else {
        return;
    };
    let lib = load(&path);
    let uid = lib.unique_id().unwrap();
    let t0 = Instant::now();
    let e = Communicator::init(lib.clone(), &uid, 8, 3, Duration::from_millis(150)).unwrap_err();
    let waited = t0.elapsed();
    // aborted at its deadline, never before; the upper bound only says it did not hang (a
    // loaded machine may be slow to get there)
    assert!(
        waited >= Duration::from_millis(150) && waited < Duration::from_secs(120),
        "{waited:?}"
    );
    assert_eq!(
        e.to_string(),
        "NCCL communicator init (rank 3 of 8) did not finish within 150ms; it was aborted. Every rank of the pair must join, and the ranks must reach each other (NCCL_SOCKET_IFNAME, firewall)"
    );
    assert!(stub_log(&path).ends_with(";abort;"), "{}", stub_log(&path));
}

#[test]
fn init_that_fails_reports_nccls_reason_and_aborts() {
    let Some((_d, path)) = stub(&["INIT_PENDING=2", "FINAL=6"]) else {
        return;
    };
    let lib = load(&path);
    let uid = lib.unique_id().unwrap();
    let e = Communicator::init(lib.clone(), &uid, 2, 1, Duration::from_secs(5)).unwrap_err();
    assert_eq!(
        e.to_string(),
        "ncclCommInitRankConfig failed: ncclRemoteError (6): remote process exited or there was a network error; peer 3 closed the connection"
    );
    assert!(stub_log(&path).ends_with(";abort;"));
}

#[test]
fn a_rank_outside_the_communicator_is_refused_before_any_call() {
    let Some((_d, path)) = stub(&[]) else { return };
    let lib = load(&path);
    let uid = lib.unique_id().unwrap();
    let e = Communicator::init(lib.clone(), &uid, 4, 4, Duration::from_secs(1)).unwrap_err();
    assert_eq!(
        e.to_string(),
        "communicator rank 4 is outside the NCCL world of 4 ranks"
    );
    assert_eq!(stub_log(&path), "");
}

#[test]
fn a_group_issues_byte_sends_and_receives_between_start_and_end() {
    let Some((_d, path)) = stub(&["GROUP_PENDING=2"]) else {
        return;
    };
    let lib = load(&path);
    let uid = lib.unique_id().unwrap();
    let mut comm = Communicator::init(lib.clone(), &uid, 4, 0, Duration::from_secs(5)).unwrap();
    let ops = [
        P2p {
            kind: OpKind::Send,
            addr: 0x7000_0000,
            bytes: 4096,
            peer: 2,
        },
        P2p {
            kind: OpKind::Send,
            addr: 0x7000_1000,
            bytes: 17,
            peer: 3,
        },
    ];
    // SAFETY: the stub never touches the addresses or the stream.
    unsafe { comm.group(&ops, std::ptr::null_mut(), &mut || None) }.unwrap();
    let recv = [P2p {
        kind: OpKind::Recv,
        addr: 0x9000,
        bytes: 0,
        peer: 1,
    }];
    // SAFETY: as above.
    unsafe { comm.group(&recv, std::ptr::null_mut(), &mut || None) }.unwrap();
    let log = stub_log(&path);
    let calls: Vec<&str> = log.split(';').skip(1).collect();
    assert_eq!(
        calls,
        [
            "start",
            "send 0x70000000 4096 dtype=1 peer=2",
            "send 0x70001000 17 dtype=1 peer=3",
            "end",
            "start",
            "recv 0x9000 0 dtype=1 peer=1",
            "end",
            ""
        ]
    );
    comm.destroy(Duration::from_secs(1)).unwrap();
}

#[test]
fn a_group_that_never_completes_is_aborted_when_told_to_stop() {
    let Some((_d, path)) = stub(&["GROUP_PENDING=-1"]) else {
        return;
    };
    let lib = load(&path);
    let uid = lib.unique_id().unwrap();
    let mut comm = Communicator::init(lib.clone(), &uid, 2, 0, Duration::from_secs(5)).unwrap();
    let deadline = Instant::now() + Duration::from_millis(100);
    let ops = [P2p {
        kind: OpKind::Send,
        addr: 0x1000,
        bytes: 8,
        peer: 1,
    }];
    let mut stop = || {
        (Instant::now() >= deadline).then(|| NcclError::OpTimeout {
            step: 7,
            detail: "update 3 reached its deadline".into(),
        })
    };
    // SAFETY: the stub never touches the addresses or the stream.
    let e = unsafe { comm.group(&ops, std::ptr::null_mut(), &mut stop) }.unwrap_err();
    let msg = "NCCL operations of step 7 did not finish before the deadline (update 3 reached its deadline); the communicator was aborted";
    assert_eq!(e.to_string(), msg);
    assert!(stub_log(&path).ends_with(";end;abort;"));
    assert_eq!(comm.aborted(), Some(msg));
    // later use says why it cannot go on, and calls nothing
    // SAFETY: as above.
    let again = unsafe { comm.group(&ops, std::ptr::null_mut(), &mut || None) }.unwrap_err();
    assert_eq!(
        again.to_string(),
        format!(
            "the NCCL communicator was aborted ({msg}); reconnect the pair to build a new one with a fresh unique id"
        )
    );
    assert!(stub_log(&path).ends_with(";end;abort;"));
    // teardown of an aborted communicator has nothing left to do
    comm.destroy(Duration::from_secs(1)).unwrap();
    assert!(stub_log(&path).ends_with(";end;abort;"));
}

#[test]
fn teardown_whose_flush_hangs_aborts_instead() {
    let Some((_d, path)) = stub(&["FINALIZE_PENDING=-1"]) else {
        return;
    };
    let lib = load(&path);
    let uid = lib.unique_id().unwrap();
    let comm = Communicator::init(lib.clone(), &uid, 2, 1, Duration::from_secs(5)).unwrap();
    let e = comm.destroy(Duration::from_millis(50)).unwrap_err();
    assert_eq!(
        e.to_string(),
        "the NCCL communicator was aborted (ncclCommFinalize did not finish within 50ms); reconnect the pair to build a new one with a fresh unique id"
    );
    assert!(stub_log(&path).ends_with(";finalize;abort;"));
}

#[test]
fn a_dropped_communicator_is_aborted_not_leaked() {
    let Some((_d, path)) = stub(&[]) else { return };
    let lib = load(&path);
    let uid = lib.unique_id().unwrap();
    drop(Communicator::init(lib.clone(), &uid, 2, 0, Duration::from_secs(5)).unwrap());
    assert!(stub_log(&path).ends_with(";abort;"));
}
