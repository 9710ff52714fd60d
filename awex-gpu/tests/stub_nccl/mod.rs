//! A stub libnccl compiled from C at test time (needs a C compiler; tests skip without one):
//! the entry points awex resolves, with behaviour selected by `-D` defines and a call log.

#![allow(dead_code)]

use awex_gpu::nccl::Library;
use std::ffi::{CStr, c_char};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

/// A stand-in for libnccl: every entry point awex resolves, with behaviour set by macros, and a
/// log of the calls that matter (`stub_log`).
const STUB: &str = r#"
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>

typedef struct { char internal[128]; } ncclUniqueId;
typedef struct {
  size_t size; unsigned magic; unsigned version;
  int blocking; int cga; int min_ctas; int max_ctas; const char* net; int split;
} config_t;

#ifndef VERSION
#define VERSION 21903
#endif
/* polls answered with ncclInProgress after init, group end and finalize (-1: forever) */
#ifndef INIT_PENDING
#define INIT_PENDING 0
#endif
#ifndef GROUP_PENDING
#define GROUP_PENDING 0
#endif
#ifndef FINALIZE_PENDING
#define FINALIZE_PENDING 0
#endif
/* the first FAIL_GROUPS group ends fail with ncclRemoteError (6) */
#ifndef FAIL_GROUPS
#define FAIL_GROUPS 0
#endif
static int groups_ended;
/* the state reported once nothing is pending */
#ifndef FINAL
#define FINAL 0
#endif

static char log_buf[1 << 16];
static size_t log_len;
static int pending;
static int comm_object;

static void say(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(log_buf + log_len, sizeof log_buf - log_len - 1, fmt, ap);
  va_end(ap);
  if (n > 0) log_len += (size_t)n;
  log_buf[log_len++] = ';';
  log_buf[log_len] = 0;
}

const char* stub_log(void) { return log_buf; }

static int started(int polls) { pending = polls; return polls == 0 ? FINAL : 7; }

int ncclGetVersion(int* v) { *v = VERSION; return 0; }
/* every id differs from the last (id[0] = 1, 17, 33, ...), so a log tells communicators apart */
static int uid_calls;
int ncclGetUniqueId(ncclUniqueId* id) {
  for (int i = 0; i < 128; i++) id->internal[i] = (char)(i * 7 + 1 + 16 * uid_calls);
  uid_calls++;
  return 0;
}
int ncclCommInitRankConfig(void** comm, int nranks, ncclUniqueId id, int rank, config_t* c) {
  say("init nranks=%d rank=%d id[0]=%d id[127]=%d size=%zu magic=%x version=%u blocking=%d min_ctas=%d",
      nranks, rank, id.internal[0], (unsigned char)id.internal[127], c->size, c->magic, c->version,
      c->blocking, c->min_ctas);
  *comm = &comm_object;
  return started(INIT_PENDING);
}
int ncclCommGetAsyncError(void* comm, int* state) {
  if (comm != &comm_object) return 4;
  if (pending < 0) { *state = 7; return 0; }
  if (pending > 0) { pending--; *state = 7; return 0; }
  *state = FINAL;
  return 0;
}
int ncclCommAbort(void* comm) { say("abort"); return 0; }
int ncclCommDestroy(void* comm) { say("destroy"); return 0; }
#ifndef OMIT_FINALIZE
int ncclCommFinalize(void* comm) { say("finalize"); return started(FINALIZE_PENDING); }
#endif
#ifndef OMIT_SEND
int ncclSend(const void* buf, size_t count, int dtype, int peer, void* comm, void* stream) {
  say("send %#lx %zu dtype=%d peer=%d", (unsigned long)buf, count, dtype, peer);
  return 0;
}
#endif
int ncclRecv(void* buf, size_t count, int dtype, int peer, void* comm, void* stream) {
  say("recv %#lx %zu dtype=%d peer=%d", (unsigned long)buf, count, dtype, peer);
  return 0;
}
int ncclGroupStart(void) { say("start"); return 0; }
int ncclGroupEnd(void) {
  say("end");
  if (groups_ended++ < FAIL_GROUPS) return 6;
  return started(GROUP_PENDING);
}
const char* ncclGetErrorString(int r) { return r == 6 ? "remote process exited or there was a network error" : "stub error"; }
const char* ncclGetLastError(void* comm) { return "peer 3 closed the connection"; }
"#;

/// A stub library built with `defines`, in its own directory (kept alive by the returned
/// guard); `None` (after saying why) when there is no C compiler.
pub fn stub(defines: &[&str]) -> Option<(tempfile::TempDir, PathBuf)> {
    let dir = tempfile::tempdir().expect("temporary directory");
    let src = dir.path().join("nccl_stub.c");
    std::fs::write(&src, STUB).expect("write the stub source");
    let out = dir.path().join("libnccl_stub.so");
    let mut cmd = Command::new("cc");
    cmd.args(["-shared", "-fPIC", "-O0", "-o"])
        .arg(&out)
        .arg(&src);
    for d in defines {
        cmd.arg(format!("-D{d}"));
    }
    match cmd.output() {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            eprintln!("skipped: no `cc` on PATH, so the stub NCCL library cannot be built");
            None
        }
        Err(e) => panic!("running cc: {e}"),
        Ok(o) if !o.status.success() => {
            panic!("cc failed: {}", String::from_utf8_lossy(&o.stderr))
        }
        Ok(_) => Some((dir, out)),
    }
}

/// The calls the stub at `path` has logged so far.
pub fn stub_log(path: &Path) -> String {
    // SAFETY: the stub is already loaded; opening it again only bumps its reference count.
    let lib = unsafe { libloading::Library::new(path) }.expect("reopen the stub");
    // SAFETY: `stub_log` returns the stub's static, NUL-terminated log.
    let f: libloading::Symbol<unsafe extern "C" fn() -> *const c_char> =
        unsafe { lib.get(b"stub_log\0") }.expect("stub_log");
    // SAFETY: as above.
    unsafe { CStr::from_ptr(f()) }
        .to_string_lossy()
        .into_owned()
}

/// Loads the stub; tests keep the returned handle alive to the end, so that the stub (and its
/// log) stays loaded after the communicator under test is gone.
pub fn load(path: &Path) -> Arc<Library> {
    Arc::new(Library::load_from(path).expect("the stub loads"))
}
