//! After an abort, the next attempt runs on a fresh communicator built from a new unique id,
//! without the pair reconnecting: checked on the stub libnccl's call log.

mod stub_nccl;

use awex_core::layout::{RankId, Side};
use awex_gpu::nccl::{
    AttemptComm, NcclError, OpKind, P2p, UID_KEY, UniqueId, attempt_uid_key, needs_fresh_comm,
};
use std::time::Duration;
use stub_nccl::{load, stub, stub_log};

const T: Duration = Duration::from_secs(5);

fn send(peer: u32) -> P2p {
    P2p {
        kind: OpKind::Send,
        addr: 0x1000,
        bytes: 64,
        peer,
    }
}

fn recv(peer: u32) -> P2p {
    P2p {
        kind: OpKind::Recv,
        addr: 0x2000,
        bytes: 64,
        peer,
    }
}

fn init_line(nranks: u32, rank: u32, id0: u8, id127: u8) -> String {
    format!(
        "init nranks={nranks} rank={rank} id[0]={id0} id[127]={id127} size=48 magic=cafebeef version=21900 blocking=0 min_ctas=-2147483648;"
    )
}

#[test]
fn retries_use_a_key_per_version_and_attempt_and_first_attempts_the_join_id() {
    assert_eq!(attempt_uid_key(5, 1), UID_KEY);
    assert_eq!(attempt_uid_key(5, 0), UID_KEY);
    assert_eq!(attempt_uid_key(5, 2), "nccl.uid.5.2");
    assert_eq!(attempt_uid_key(6, 2), "nccl.uid.6.2");
    assert!(!needs_fresh_comm(1) && needs_fresh_comm(2) && needs_fresh_comm(9));
    assert_eq!(
        AttemptComm::read_for_attempt(Side::Inference, RankId::infer(1, 0), 5, 3).as_deref(),
        Some("nccl.uid.5.3")
    );
    assert_eq!(
        AttemptComm::read_for_attempt(Side::Training, RankId::train(1), 5, 2).as_deref(),
        Some("nccl.uid.5.2")
    );
    // the creator publishes, it does not read; nobody reads for a first attempt
    assert_eq!(
        AttemptComm::read_for_attempt(Side::Training, RankId::train(0), 5, 2),
        None
    );
    assert_eq!(
        AttemptComm::read_for_attempt(Side::Inference, RankId::infer(0, 0), 5, 1),
        None
    );
}

#[test]
fn an_aborted_attempt_is_retried_on_the_same_pair_with_a_fresh_communicator() {
    // training rank 0 (the id's creator): its first group fails with ncclRemoteError
    let Some((_d, path)) = stub(&["FAIL_GROUPS=1"]) else {
        return;
    };
    let lib = load(&path);
    let mut train = AttemptComm::new(lib.clone(), 2, 0);
    let joined = lib.unique_id().unwrap();
    train.set_uid(UID_KEY, joined);
    // first attempts publish nothing: they use the id of the join
    assert_eq!(
        train
            .publish_for_attempt(Side::Training, RankId::train(0), 7, 1)
            .unwrap(),
        None
    );

    // attempt 1 of version 7: init, the group fails, the communicator is aborted
    let comm = train.get(T).unwrap();
    // SAFETY: the stub never touches the addresses or the stream.
    let e = unsafe { comm.group(&[send(1)], std::ptr::null_mut(), &mut || None) }.unwrap_err();
    assert!(
        matches!(
            e,
            NcclError::Call {
                call: "ncclGroupEnd",
                code: 6,
                ..
            }
        ),
        "{e}"
    );
    train.fail(&e.to_string());
    assert!(!train.is_live());
    // the failed id is not used again: no second init from it
    assert!(matches!(train.get(T), Err(NcclError::Aborted(_))));
    let after_abort = stub_log(&path);
    assert_eq!(
        after_abort,
        format!(
            "{}start;send 0x1000 64 dtype=1 peer=1;end;abort;",
            init_line(2, 0, 1, 122)
        )
    );

    // attempt 2: a fresh id, published under the attempt's key, and a fresh communicator
    let (key, value) = train
        .publish_for_attempt(Side::Training, RankId::train(0), 7, 2)
        .unwrap()
        .expect("training rank 0 publishes a fresh id for a retry");
    assert_eq!(key, "nccl.uid.7.2");
    let fresh = UniqueId::from_kv(&value).unwrap();
    assert_ne!(fresh, joined);
    assert_eq!(fresh.0[0], 17);
    // publishing again (a repeated call for the same attempt) keeps the same id
    assert_eq!(
        train
            .publish_for_attempt(Side::Training, RankId::train(0), 7, 2)
            .unwrap(),
        Some((key.clone(), value.clone()))
    );
    let comm = train.get(T).unwrap();
    // SAFETY: as above.
    unsafe { comm.group(&[send(1)], std::ptr::null_mut(), &mut || None) }.unwrap();
    assert_eq!(train.built(), 2);
    train.close(T).unwrap();
    assert_eq!(
        stub_log(&path),
        format!(
            "{after_abort}{}start;send 0x1000 64 dtype=1 peer=1;end;finalize;destroy;",
            init_line(2, 0, 17, 122u8.wrapping_add(16))
        )
    );

    // the inference rank of the pair (its own stub: its own log): its communicator of the join
    // is still live (it was waiting on its peer); the retry's id read from the kv replaces it
    let Some((_d2, path2)) = stub(&[]) else {
        return;
    };
    let lib2 = load(&path2);
    let mut infer = AttemptComm::new(lib2.clone(), 2, 1);
    infer.set_uid(UID_KEY, joined);
    // SAFETY: as above.
    unsafe {
        infer
            .get(T)
            .unwrap()
            .group(&[recv(0)], std::ptr::null_mut(), &mut || None)
    }
    .unwrap();
    let read = AttemptComm::read_for_attempt(Side::Inference, RankId::infer(0, 0), 7, 2)
        .expect("a retry is read from the kv");
    assert_eq!(read, key);
    infer.set_uid(&read, UniqueId::from_kv(&value).unwrap());
    assert!(!infer.is_live());
    // SAFETY: as above.
    unsafe {
        infer
            .get(T)
            .unwrap()
            .group(&[recv(0)], std::ptr::null_mut(), &mut || None)
    }
    .unwrap();
    // the same key again (a repeated read) keeps the communicator
    infer.set_uid(&read, UniqueId::from_kv(&value).unwrap());
    assert!(infer.is_live());
    assert_eq!(infer.built(), 2);
    infer.close(T).unwrap();
    assert_eq!(
        stub_log(&path2),
        format!(
            "{}start;recv 0x2000 64 dtype=1 peer=0;end;abort;{}start;recv 0x2000 64 dtype=1 peer=0;end;finalize;destroy;",
            init_line(2, 1, 1, 122),
            init_line(2, 1, 17, 122u8.wrapping_add(16))
        )
    );
}
