# Copy-kernel variants (streaming stores, 8 loads in flight, grid shapes) against the driver's device copy,
# local and out of IPC-mapped memory, on one GPU. Usage: python3 scripts/gpu_copy_kernel_variants.py awex-gpu/src/cuda/copy_rows.ptx
# (SIZE_GIB=4 by default). Needs torch with CUDA; loads the PTX with the driver API through ctypes.
import ctypes, os, re, statistics, sys, time
import torch, torch.multiprocessing as mp

PTX = open(sys.argv[1]).read()
GIB = 1 << 30
SIZE = int(os.environ.get("SIZE_GIB", "4")) * GIB
cu = ctypes.CDLL("libcuda.so.1")

def check(r, what):
    if r != 0:
        raise RuntimeError(f"{what}: CUresult {r}")

def variant(ld, st, unroll):
    p = PTX.replace(".version 7.0", ".version 8.0")
    if unroll == 8:
        # rebuild the 4-wide block as 8-wide
        m = re.search(r"COL4:\n(.*?)bra.uni \tCOL4;\n", p, re.S)
        body = ["\tmad.lo.u64 \t%rd18, %rd7, 7, %rd14;", "\tsetp.ge.u64 \t%p2, %rd18, %rd3;", "\t@%p2 bra \tCOL;",
                "\tshl.b64 \t%rd15, %rd14, 4;", "\tadd.u64 \t%rd16, %rd12, %rd15;", "\tadd.u64 \t%rd17, %rd13, %rd15;"]
        for i in range(8):
            body.append(f"\tmad.lo.u64 \t%rs{i}, %rd20, {i}, %rd16;")
            body.append(f"\tmad.lo.u64 \t%rt{i}, %rd20, {i}, %rd17;")
        for i in range(8):
            body.append(f"\tld.global.nc.v4.u32 \t{{%w{4*i}, %w{4*i+1}, %w{4*i+2}, %w{4*i+3}}}, [%rs{i}];")
        for i in range(8):
            body.append(f"\tst.global.v4.u32 \t[%rt{i}], {{%w{4*i}, %w{4*i+1}, %w{4*i+2}, %w{4*i+3}}};")
        body += ["\tshl.b64 \t%rd19, %rd7, 3;", "\tadd.u64 \t%rd14, %rd14, %rd19;", "\tbra.uni \tCOL4;"]
        p = p[:m.start()] + "COL4:\n" + "\n".join(body) + "\n" + p[m.end():]
        p = p.replace("\t.reg .b64 \t%rd<32>;", "\t.reg .b64 \t%rd<32>;\n\t.reg .b64 \t%rs<8>;\n\t.reg .b64 \t%rt<8>;\n\t.reg .b32 \t%w<32>;")
    p = p.replace("ld.global.nc.v4.u32", "ld.global." + ld + ".v4.u32")
    p = p.replace("st.global.v4.u32", "st.global" + st + ".v4.u32")
    return p

def load(ptx):
    mod = ctypes.c_void_p(); f = ctypes.c_void_p()
    buf = ctypes.create_string_buffer(ptx.encode() + b"\0")
    log = ctypes.create_string_buffer(8192)
    # options: error log
    opts = (ctypes.c_int * 2)(5, 6)  # CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES
    vals = (ctypes.c_void_p * 2)(ctypes.cast(log, ctypes.c_void_p), ctypes.c_void_p(8192))
    r = cu.cuModuleLoadDataEx(ctypes.byref(mod), buf, 2, opts, vals)
    if r != 0:
        raise RuntimeError("load: %d %s" % (r, log.value.decode()))
    check(cu.cuModuleGetFunction(ctypes.byref(f), mod, b"awex_copy_rows"), "getfunction")
    return f

def launch(f, src, dst, nbytes, blocks, threads, stream=0):
    nvec = nbytes // 16
    args = [ctypes.c_uint64(src), ctypes.c_uint64(dst), ctypes.c_uint64(nvec), ctypes.c_uint64(0), ctypes.c_uint64(0), ctypes.c_uint64(1)]
    arr = (ctypes.c_void_p * 6)(*[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args])
    gx = max(1, min(blocks, -(-nvec // (threads * 4))))
    check(cu.cuLaunchKernel(f, gx, 1, 1, threads, 1, 1, 0, ctypes.c_void_p(stream), arr, None), "launch")

def timeit(fn, reps=9):
    ts = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(); a.record(); fn(); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)

def bench(src, dst, label):
    n = SIZE
    streams = [torch.cuda.Stream() for _ in range(4)]
    def pieces(f, blocks, threads):
        piece = 256 << 20
        cur = torch.cuda.current_stream()
        ev = torch.cuda.Event(); ev.record(cur)
        for s in streams: s.wait_event(ev)
        for i, off in enumerate(range(0, n, piece)):
            s = streams[i % 4]
            launch(f, src.data_ptr() + off, dst.data_ptr() + off, min(piece, n - off), blocks, threads, s.cuda_stream)
        for s in streams:
            e = torch.cuda.Event(); e.record(s); cur.wait_event(e)
    t = timeit(lambda: dst.copy_(src))
    print(f"{label} torch copy_ (DtoD) {n/GIB:.0f} GiB: {t:.3f} ms  {2*n/t/1e9:.0f} GB/s r+w", flush=True)
    res = []
    for name, ld, st, un in [("base", "nc", "", 4), ("cs", "nc", ".cs", 4), ("noalloc+cs", "nc.L1::no_allocate", ".cs", 4),
                             ("u8", "nc", "", 8), ("u8+cs", "nc", ".cs", 8)]:
        f = load(variant(ld, st, un))
        for blocks, threads in [(1024, 256), (1056, 256), (528, 512), (2112, 256), (264, 1024)]:
            t1 = timeit(lambda: launch(f, src.data_ptr(), dst.data_ptr(), n, blocks, threads))
            t4 = timeit(lambda: pieces(f, blocks, threads))
            ok = torch.equal(dst[:1 << 20], src[:1 << 20]) and torch.equal(dst[-(1 << 20):], src[-(1 << 20):])
            print(f"{label} {name:11s} blocks {blocks:5d} x {threads:4d}: one launch {t1:.3f} ms, 256MiB pieces/4 streams {t4:.3f} ms  ({'ok' if ok else 'WRONG'})", flush=True)
            res.append((t4, name, blocks, threads))
            dst.zero_()
    res.sort()
    print(label, "best pieces:", res[:3], flush=True)

def child(q, done):
    torch.cuda.set_device(0)
    src = torch.randint(0, 255, (SIZE,), dtype=torch.uint8, device="cuda")
    q.put(src)
    done.wait()

if __name__ == "__main__":
    torch.cuda.set_device(0); torch.zeros(1, device="cuda")
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    src = torch.randint(0, 255, (SIZE,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    bench(src, dst, "local")
    del src
    mp.set_start_method("spawn")
    q = mp.Queue(); done = mp.Event()
    p = mp.Process(target=child, args=(q, done)); p.start()
    rsrc = q.get()
    bench(rsrc, dst, "ipc")
    del rsrc; done.set(); p.join()
