#!/usr/bin/env python3
"""One GPU: what the driver does with PyTorch's expandable segments (`cuMemCreate` memory), the
facts an export path for such memory would rest on. Prints one JSON report.

Two sibling processes under this controller (as a training and an inference rank are: neither
is the other's parent). The sender turns on ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``,
fills tensors of several sizes with a known byte pattern and, for each: ``cuMemGetAddressRange``,
``cuIpcGetMemHandle`` of that base (legacy IPC), ``cuMemRetainAllocationHandle`` and the
allocation's requested handle types, ``cuMemExportToShareableHandle`` as a POSIX fd. The
receiver gets the fds both ways a rank could (``pidfd_getfd`` on the sender's pid, and
``SCM_RIGHTS`` over a Unix socket the sender serves), imports them
(``cuMemImportFromShareableHandle``), maps them (``cuMemAddressReserve`` + ``cuMemMap`` +
``cuMemSetAccess``) and compares the bytes, timing each step.

    python3 scripts/gpu_vmm_probe.py            # on the GPU machine
"""

from __future__ import annotations

import ctypes as C
import json
import os
import socket
import subprocess
import sys
import time

HERE = os.path.abspath(__file__)
WORK = os.environ.get("AWEX_PROBE_DIR", "/tmp/awex-vmm-probe")
SOCK = os.path.join(WORK, "fds.sock")
SIZES_MIB = [1, 3, 30, 100, 700]


class Location(C.Structure):
    _fields_ = [("type", C.c_int), ("id", C.c_int)]


class AllocFlags(C.Structure):
    _fields_ = [("compressionType", C.c_ubyte), ("gpuDirectRDMACapable", C.c_ubyte), ("usage", C.c_ushort), ("reserved", C.c_ubyte * 4)]


class Prop(C.Structure):
    _fields_ = [("type", C.c_int), ("requestedHandleTypes", C.c_int), ("location", Location), ("win32HandleMetaData", C.c_void_p), ("allocFlags", AllocFlags)]


class Access(C.Structure):
    _fields_ = [("location", Location), ("flags", C.c_int)]


cu = C.CDLL("libcuda.so.1")


def call(name, *args):
    r = getattr(cu, name)(*args)
    if r == 0:
        return None
    s = C.c_char_p()
    cu.cuGetErrorName(r, C.byref(s))
    return f"{name}: {r} {s.value.decode() if s.value else '?'}"


def pattern(n: int, seed: int) -> bytes:
    return bytes((i * 7 + seed) % 251 for i in range(n))


def sender() -> int:
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    import torch

    torch.cuda.init()
    out = {"pid": os.getpid(), "tensors": [], "fds": []}
    keep = []
    for k, mib in enumerate(SIZES_MIB):
        n = mib << 20
        t = torch.empty(n, dtype=torch.uint8, device="cuda")
        head = torch.frombuffer(bytearray(pattern(4096, k)), dtype=torch.uint8)
        t[:4096].copy_(head)
        t[-4096:].copy_(head)
        keep.append(t)
        ptr = t.data_ptr()
        e = {"mib": mib, "ptr": ptr}
        base, size = C.c_uint64(), C.c_size_t()
        e["range_err"] = call("cuMemGetAddressRange_v2", C.byref(base), C.byref(size), C.c_uint64(ptr))
        e["range"] = [base.value, size.value]
        h = (C.c_char * 64)()
        e["legacy_ipc_err"] = call("cuIpcGetMemHandle", h, C.c_uint64(base.value or ptr))
        # every physical allocation behind the tensor: walk it by the ranges the driver reports
        chunks = []
        p = ptr
        while p < ptr + n and len(chunks) < 4096:
            b, s = C.c_uint64(), C.c_size_t()
            err = call("cuMemGetAddressRange_v2", C.byref(b), C.byref(s), C.c_uint64(p))
            ah = C.c_uint64()
            rerr = call("cuMemRetainAllocationHandle", C.byref(ah), C.c_void_p(p))
            c = {"at": p, "range": [b.value, s.value], "range_err": err, "retain_err": rerr}
            if rerr is None:
                prop = Prop()
                c["props_err"] = call("cuMemGetAllocationPropertiesFromHandle", C.byref(prop), ah)
                c["requested_handle_types"] = prop.requestedHandleTypes
                fd = C.c_int(-1)
                c["export_fd_err"] = call("cuMemExportToShareableHandle", C.byref(fd), ah, 1, C.c_ulonglong(0))
                if c["export_fd_err"] is None:
                    c["fd"] = fd.value
                    out["fds"].append(fd.value)
                call("cuMemRelease", ah)
            chunks.append(c)
            if err is not None or s.value == 0:
                break
            p = b.value + s.value
        e["chunks"] = chunks
        out["tensors"].append(e)
    torch.cuda.synchronize()
    snap = torch.cuda.memory_snapshot()
    out["snapshot"] = [{"address": s["address"], "total_size": s["total_size"], "is_expandable": s.get("is_expandable")} for s in snap]
    # serve the fds over a Unix socket (SCM_RIGHTS), once
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    if os.path.exists(SOCK):
        os.unlink(SOCK)
    srv.bind(SOCK)
    srv.listen(1)
    with open(os.path.join(WORK, "sender.json"), "w") as f:
        json.dump(out, f)
    srv.settimeout(60)
    try:
        conn, _ = srv.accept()
        fds = out["fds"]
        for i in range(0, len(fds), 200):
            socket.send_fds(conn, [json.dumps(fds[i:i + 200]).encode().ljust(8192)], fds[i:i + 200])
        conn.recv(16)  # the receiver's "done"
    except Exception as e:  # noqa: BLE001
        print("sender: socket:", e, flush=True)
    srv.close()
    # stay alive until the receiver has finished mapping (its file appears)
    t0 = time.time()
    while not os.path.exists(os.path.join(WORK, "receiver.json")) and time.time() - t0 < 90:
        time.sleep(0.05)
    return 0


def receiver() -> int:
    import torch

    torch.cuda.init()
    torch.zeros(1, device="cuda")  # a current context on this thread
    s = json.load(open(os.path.join(WORK, "sender.json")))
    out = {"ptrace_scope": open("/proc/sys/kernel/yama/ptrace_scope").read().strip() if os.path.exists("/proc/sys/kernel/yama/ptrace_scope") else None}
    # 1. pidfd_getfd
    libc = C.CDLL(None, use_errno=True)
    SYS_pidfd_open, SYS_pidfd_getfd = 434, 438
    pidfd = libc.syscall(SYS_pidfd_open, s["pid"], 0)
    got = {}
    if pidfd < 0:
        out["pidfd_open"] = f"errno {C.get_errno()}"
    else:
        for fd in s["fds"]:
            r = libc.syscall(SYS_pidfd_getfd, pidfd, fd, 0)
            if r < 0:
                out["pidfd_getfd"] = f"errno {C.get_errno()} ({os.strerror(C.get_errno())})"
                break
            got[fd] = r
        else:
            out["pidfd_getfd"] = f"ok, {len(got)} fds"
    # 2. SCM_RIGHTS
    scm = {}
    try:
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.connect(SOCK)
        while len(scm) < len(s["fds"]):
            msg, fds, _, _ = socket.recv_fds(c, 8192, 200)
            names = json.loads(msg.decode().strip())
            scm.update(zip(names, fds))
        c.send(b"done")
        out["scm_rights"] = f"ok, {len(scm)} fds"
    except Exception as e:  # noqa: BLE001
        out["scm_rights"] = f"{type(e).__name__}: {e}"
    fds = scm or got
    gran = C.c_size_t()
    prop = Prop(type=1, requestedHandleTypes=1, location=Location(type=1, id=0))
    out["granularity_err"] = call("cuMemGetAllocationGranularity", C.byref(gran), C.byref(prop), 0)
    out["granularity"] = gran.value
    results = []
    for e in s["tensors"]:
        chunks = [c for c in e["chunks"] if "fd" in c]
        r = {"mib": e["mib"], "chunks": len(chunks)}
        if not chunks or len(chunks) != len(e["chunks"]):
            r["skipped"] = "not every chunk exported"
            results.append(r)
            continue
        lo = chunks[0]["range"][0]
        hi = chunks[-1]["range"][0] + chunks[-1]["range"][1]
        t0 = time.perf_counter()
        va = C.c_uint64()
        r["reserve_err"] = call("cuMemAddressReserve", C.byref(va), C.c_size_t(hi - lo), C.c_size_t(0), C.c_uint64(0), C.c_ulonglong(0))
        errs = []
        for c in chunks:
            h = C.c_uint64()
            err = call("cuMemImportFromShareableHandle", C.byref(h), C.c_void_p(fds[c["fd"]]), 1)
            if err:
                errs.append(err)
                continue
            b, sz = c["range"]
            err = call("cuMemMap", C.c_uint64(va.value + b - lo), C.c_size_t(sz), C.c_size_t(0), h, C.c_ulonglong(0))
            if err:
                errs.append(err)
            call("cuMemRelease", h)
        acc = Access(location=Location(type=1, id=0), flags=3)
        err = call("cuMemSetAccess", C.c_uint64(va.value), C.c_size_t(hi - lo), C.byref(acc), C.c_size_t(1))
        if err:
            errs.append(err)
        r["open_ms"] = (time.perf_counter() - t0) * 1e3
        r["errors"] = errs[:5]
        if not errs:
            at = va.value + (e["ptr"] - lo)
            k = SIZES_MIB.index(e["mib"])
            buf = (C.c_char * 4096)()
            ok = call("cuMemcpyDtoH_v2", buf, C.c_uint64(at), C.c_size_t(4096)) is None and bytes(buf) == pattern(4096, k)
            ok2 = call("cuMemcpyDtoH_v2", buf, C.c_uint64(at + (e["mib"] << 20) - 4096), C.c_size_t(4096)) is None and bytes(buf) == pattern(4096, k)
            r["bytes_match"] = ok and ok2
        results.append(r)
    out["imports"] = results
    with open(os.path.join(WORK, "receiver.json.tmp"), "w") as f:
        json.dump(out, f)
    os.rename(os.path.join(WORK, "receiver.json.tmp"), os.path.join(WORK, "receiver.json"))
    return 0


def controller() -> int:
    os.makedirs(WORK, exist_ok=True)
    for f in ("sender.json", "receiver.json"):
        if os.path.exists(os.path.join(WORK, f)):
            os.unlink(os.path.join(WORK, f))
    snd = subprocess.Popen([sys.executable, HERE, "sender"])
    t0 = time.time()
    while not os.path.exists(os.path.join(WORK, "sender.json")):
        if snd.poll() is not None or time.time() - t0 > 120:
            print("the sender did not get ready", flush=True)
            return 1
        time.sleep(0.05)
    time.sleep(0.2)  # its socket is listening once the file is written
    rcv = subprocess.Popen([sys.executable, HERE, "receiver"])
    rc = (rcv.wait(timeout=180), snd.wait(timeout=120))
    s = json.load(open(os.path.join(WORK, "sender.json")))
    r = json.load(open(os.path.join(WORK, "receiver.json"))) if os.path.exists(os.path.join(WORK, "receiver.json")) else {}
    for t in s["tensors"]:
        cs = t.pop("chunks")
        t["chunks"] = len(cs)
        t["first_chunks"] = cs[:3]
        t["chunk_sizes_mib"] = sorted({c["range"][1] >> 20 for c in cs})
    s.pop("fds")
    print(json.dumps({"rc": rc, "sender": s, "receiver": r}, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    role = sys.argv[1] if len(sys.argv) > 1 else "controller"
    sys.exit({"controller": controller, "sender": sender, "receiver": receiver}[role]())
