// awex's GPU kernels for the delta wire format (the source of delta_wire.ptx and
// delta_wire.sm_90.cubin; see delta_wire.rs for how to rebuild them and for the algorithm).
// The format and its CPU reference: awex-core/src/encoding/delta.rs (a segment) and
// delta_frame.rs (a bucket's frame: count, u32 lengths, segments).
//
// A table of segments (Seg) lists a frame's segments in order; chunk k of the table is the
// 256-element chunk of the segment whose first chunk index is the largest at or below k.
//
// Encode (new against base, into a frame), four launches on one stream:
//   awex_wire_compare    one warp per chunk, a warp's work a run of RUN (256) chunks at a time
//                        (runs w, w + warps, ...): a mask of changed elements per lane (8
//                        each), their popcounts scanned over the warp; a word per chunk
//                        (payload bytes | count byte << 16); a sparse chunk's offsets and
//                        values appended to the run's stream, a 2048-byte ring in shared
//                        memory written out 512 bytes (16 a lane) at a time to the run's place
//                        in the scratch (its first chunk's region: 256 s bytes a chunk, so
//                        the run's stream fits), whole aligned lines only; a dense chunk's
//                        values are read from new later. The changed elements summed, one
//                        atomicAdd a block into status[2].
//   awex_wire_tile_sums  per tile of 1024 chunks: the sum of their payload bytes, and the
//                        in-tile prefix at each segment's first chunk
//   awex_wire_plan       one block: the tiles' prefix, each segment's form (unchanged if no
//                        chunk changed, dense if n * s < 1 + chunks + payload as the CPU
//                        decides, sparse otherwise), lengths, offsets, header and tags
//   awex_wire_write      per tile: two prefixes of the chunks (payload bytes, and staged bytes
//                        restarting at each run), each chunk's count byte; a warp's 32 chunks'
//                        payloads of up to 64 bytes copied together (the group's bytes one
//                        after another, COOP_BYTES (4) a lane, every load in flight before
//                        the stores), larger ones (whole chunks, dense segments) by the warp a
//                        word a lane
// Why this shape: at optimiser densities (about 1 % of bf16 elements) nearly every chunk is
// sparse with a payload of a few bytes; writing each to its own region of the scratch (the
// first version) left a partly written 32-byte sector per chunk, scattered: measured on an
// H100 at 1 % of the elements changed, that made the compare 15.7 ms against 11.5 with
// nothing changed. A run's stream is written in whole lines, read once by the write pass, and
// the frame's payload is written in order.
// Decode (a frame applied to the destination in place), four launches:
//   awex_wire_read_header  one block: count, lengths, offsets, tags (0-2; 3 refused), the
//                          lengths of dense and unchanged segments
//   awex_wire_decode_sums  per tile: each chunk's payload bytes from its count byte (checked
//                          against the chunk) and the tile sums
//   awex_wire_decode_plan  one block: every sparse segment ends where its length says
//   awex_wire_apply        per tile, nothing at all if a check failed: each chunk's values
//                          written, its offsets checked (increasing, in the chunk) first
//
// Errors go to status[1] as atomicMin(seg * 256 + code): the lowest segment's.

#include <stdint.h>

#define CHUNK 256u
#define TILE 1024u
#define DENSE_CHUNK 255u

// error codes (delta_wire.rs: WireStatus)
#define E_HEADER 1u   // frame shorter than its header
#define E_COUNT 2u    // segment count differs from the table's
#define E_LENGTHS 3u  // lengths do not sum to the frame's bytes
#define E_EMPTY 4u    // a zero length
#define E_TAG 5u      // a tag none of 0-3
#define E_GAPS 6u     // a gaps segment (tag 3)
#define E_CHUNK 7u    // a chunk count above its chunk's elements
#define E_SEGLEN 8u   // a segment whose payload ends elsewhere than its length
#define E_OFFSET 9u   // offsets not increasing or outside their chunk
#define E_TOOLONG 10u // an encoded segment above 2^32 - 1 bytes

struct Seg {
    uint64_t src;     // encode: the new version; decode: the destination
    uint64_t base;    // encode: the base version
    uint64_t n;       // elements
    uint64_t chunk;   // the table's index of its first chunk
    uint64_t scratch; // encode: byte offset of its first chunk's region (256 s bytes a chunk)
    uint32_t elem;    // 1, 2 or 4
    uint32_t pad;
};

struct Plan {
    uint64_t off;   // where the segment starts in the frame
    uint64_t start; // payload bytes of the table's chunks before its first
    uint32_t tag;
    uint32_t len;   // its bytes
};

__device__ __forceinline__ void fail(uint64_t* status, uint64_t seg, uint32_t code) {
    atomicMin((unsigned long long*)&status[1], (unsigned long long)(seg * 256u + code));
}

__device__ __forceinline__ uint64_t nchunks_of(const Seg& s) { return (s.n + CHUNK - 1) / CHUNK; }

// The segment holding chunk k: the last with first chunk <= k.
__device__ __forceinline__ uint32_t seg_of(const Seg* segs, uint32_t nsegs, uint64_t k) {
    uint32_t lo = 0, hi = nsegs; // answer in [lo, hi)
    while (hi - lo > 1) {
        const uint32_t mid = (lo + hi) / 2;
        if (segs[mid].chunk <= k) lo = mid; else hi = mid;
    }
    return lo;
}

// The first segment whose first chunk is >= k.
__device__ __forceinline__ uint32_t first_seg_at_or_after(const Seg* segs, uint32_t nsegs, uint64_t k) {
    uint32_t lo = 0, hi = nsegs;
    while (lo < hi) {
        const uint32_t mid = (lo + hi) / 2;
        if (segs[mid].chunk < k) lo = mid + 1; else hi = mid;
    }
    return lo;
}

// Inclusive scan of one value per lane over the warp (every lane of the warp must call it).
template <typename T>
__device__ __forceinline__ T warp_inclusive_scan(T v, uint32_t lane) {
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const T y = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= (uint32_t)o) v += y;
    }
    return v;
}

// Exclusive scan of one value per thread over the block (blockDim.x a multiple of 32, at most
// 1024); *total gets the sum. Every thread of the block must call it.
__device__ uint64_t block_scan(uint64_t v, uint64_t* total) {
    __shared__ uint64_t warp_sums[33];
    const uint32_t lane = threadIdx.x & 31u, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const uint64_t inc = warp_inclusive_scan<uint64_t>(v, lane);
    __syncthreads();
    if (lane == 31) warp_sums[wid] = inc;
    __syncthreads();
    if (wid == 0) {
        const uint64_t w = lane < nw ? warp_sums[lane] : 0;
        const uint64_t wi = warp_inclusive_scan<uint64_t>(w, lane);
        if (lane < nw) warp_sums[lane] = wi - w;
        if (lane == 31) warp_sums[32] = wi;
    }
    __syncthreads();
    const uint64_t ex = warp_sums[wid] + inc - v;
    *total = warp_sums[32];
    // every thread has read the sums before the next call writes them
    __syncthreads();
    return ex;
}

// ---------------------------------------------------------------------------------------
// encode

// Lane `lane` of a chunk holds its elements 8 lane .. 8 lane + 7: `a` their new bytes, `x`
// new xor base, as little-endian words (S = 1: words 0-1, 2: 0-3, 4: 0-7).
template <int S>
__device__ __forceinline__ void load_lane(const uint8_t* nw, const uint8_t* bs, uint32_t valid,
                                          bool aligned, uint32_t a[8], uint32_t x[8]) {
#pragma unroll
    for (int i = 0; i < 8; ++i) { a[i] = 0; x[i] = 0; }
    if (valid == 8 && aligned) {
        if (S == 1) {
            const uint2 p = *reinterpret_cast<const uint2*>(nw);
            const uint2 q = *reinterpret_cast<const uint2*>(bs);
            a[0] = p.x; a[1] = p.y; x[0] = p.x ^ q.x; x[1] = p.y ^ q.y;
        } else {
#pragma unroll
            for (int h = 0; h < S / 2; ++h) {
                const uint4 p = reinterpret_cast<const uint4*>(nw)[h];
                const uint4 q = reinterpret_cast<const uint4*>(bs)[h];
                a[4 * h] = p.x; a[4 * h + 1] = p.y; a[4 * h + 2] = p.z; a[4 * h + 3] = p.w;
                x[4 * h] = p.x ^ q.x; x[4 * h + 1] = p.y ^ q.y;
                x[4 * h + 2] = p.z ^ q.z; x[4 * h + 3] = p.w ^ q.w;
            }
        }
        return;
    }
#pragma unroll
    for (int k = 0; k < 8 * S; ++k) {
        if ((uint32_t)k < valid * S) {
            const uint32_t p = nw[k], q = bs[k];
            a[k / 4] |= p << (8 * (k % 4));
            x[k / 4] |= (p ^ q) << (8 * (k % 4));
        }
    }
}

template <int S>
__device__ __forceinline__ uint32_t elem_word(const uint32_t w[8], int j) {
    if (S == 4) return w[j];
    if (S == 2) return (w[j / 2] >> (16 * (j & 1))) & 0xffffu;
    return (w[j / 4] >> (8 * (j & 3))) & 0xffu;
}

// Element j (not known at compile time) of a lane's words, by selects (no local memory).
template <int S>
__device__ __forceinline__ uint32_t pick(const uint32_t w[8], uint32_t j) {
    if (S == 4) {
        uint32_t v = w[0];
#pragma unroll
        for (uint32_t i = 1; i < 8; ++i) v = j == i ? w[i] : v;
        return v;
    }
    if (S == 2) {
        const uint32_t h = j >> 1;
        uint32_t v = w[0];
#pragma unroll
        for (uint32_t i = 1; i < 4; ++i) v = h == i ? w[i] : v;
        return (v >> (16 * (j & 1))) & 0xffffu;
    }
    const uint32_t v = (j >> 2) ? w[1] : w[0];
    return (v >> (8 * (j & 3))) & 0xffu;
}

// Lane `lane`'s elements of chunk `local` of `sg` (zeros past the segment's end).
template <int S>
__device__ __forceinline__ void load_chunk(const Seg& sg, uint64_t local, uint32_t lane, bool aligned,
                                           uint32_t a[8], uint32_t x[8]) {
    const uint64_t first = local * CHUNK;
    const uint32_t len = (uint32_t)min((uint64_t)CHUNK, sg.n - first);
    const uint32_t lo = 8 * lane;
    const uint32_t valid = len > lo ? min(8u, len - lo) : 0u;
    if (valid > 0) {
        const uint64_t at = (first + lo) * S;
        load_lane<S>(reinterpret_cast<const uint8_t*>(sg.src) + at,
                     reinterpret_cast<const uint8_t*>(sg.base) + at, valid, aligned, a, x);
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) { a[i] = 0; x[i] = 0; }
    }
}

// A warp's stream of staged bytes: the sparse chunks of one run, their offsets and values
// appended in chunk order to a ring of 2048 bytes in shared memory, written to the run's
// place in the scratch buffer 512 bytes (one 16-byte vector a lane) at a time, so that every
// write to the scratch is a whole, aligned line.
#define RUN 256u
#define RING 2048u
#define LINE 512u

struct Stream {
    uint8_t* ring;  // RING bytes, 16-byte aligned
    uint8_t* dst;   // the run's place in the scratch
    uint32_t fill;  // bytes appended
    uint32_t flushed; // bytes written out (a multiple of LINE)
};

__device__ __forceinline__ void stream_flush(Stream& st, uint32_t lane, bool all) {
    __syncwarp();
    while (st.fill - st.flushed >= LINE) {
        const uint4 v = reinterpret_cast<const uint4*>(st.ring + (st.flushed & (RING - 1)))[lane];
        reinterpret_cast<uint4*>(st.dst + st.flushed)[lane] = v;
        st.flushed += LINE;
    }
    if (all) {
        // the rest, rounded up to 16 bytes (inside the run's region: a multiple of 256 bytes)
        if (lane * 16 < st.fill - st.flushed) {
            const uint4 v = reinterpret_cast<const uint4*>(st.ring + (st.flushed & (RING - 1)))[lane];
            reinterpret_cast<uint4*>(st.dst + st.flushed)[lane] = v;
        }
        st.fill = st.flushed = 0;
    }
    __syncwarp();
}

// One chunk by one warp, its lanes' elements loaded: writes its word; appends a sparse
// chunk's offsets and values to the warp's stream. Returns the chunk's changed elements.
template <int S>
__device__ __forceinline__ uint32_t compare_chunk(const uint32_t a[8], const uint32_t x[8], uint32_t len,
                                                  uint32_t lane, Stream& st, uint32_t* word) {
    const uint32_t lo = 8 * lane;
    uint32_t m = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) m |= (elem_word<S>(x, j) != 0 ? 1u : 0u) << j;
    const uint32_t mine = __popc(m);
    const uint32_t inc = warp_inclusive_scan<uint32_t>(mine, lane);
    const uint32_t c = __shfl_sync(0xffffffffu, inc, 31);
    const uint32_t before = inc - mine;
    // the CPU's rule (delta::dense_chunk): whole where c (1 + s) >= len s, or c >= 255
    const bool dense = c * (1 + S) >= len * S || c >= DENSE_CHUNK;
    const uint32_t size = dense ? len * S : c * (1 + S);
    if (lane == 0) *word = size | ((dense ? DENSE_CHUNK : c) << 16);
    if (dense || c == 0) return c;
    // offsets, then values, in element order, at the stream's end: a lane's changed elements
    // one after another (at optimiser densities a lane holds at most one or two)
    uint32_t p = before;
    const uint32_t f = st.fill;
    for (uint32_t mm = m; mm != 0; mm &= mm - 1) {
        const uint32_t j = __ffs(mm) - 1;
        st.ring[(f + p) & (RING - 1)] = (uint8_t)(lo + j);
        const uint32_t v = pick<S>(a, j);
#pragma unroll
        for (int b = 0; b < S; ++b) st.ring[(f + c + p * S + b) & (RING - 1)] = (uint8_t)(v >> (8 * b));
        ++p;
    }
    st.fill = f + size;
    if (st.fill - st.flushed >= LINE) stream_flush(st, lane, false);
    return c;
}

// Chunks l0 .. l1 - 1 of `sg` by one warp, the next chunk's loads issued before the current
// one is compared (two chunks' bytes in flight per warp). Returns their changed elements.
template <int S>
__device__ __forceinline__ uint64_t compare_run(const Seg& sg, uint64_t l0, uint64_t l1, uint32_t lane,
                                               Stream& st, uint32_t* words) {
    const uint64_t align = S == 1 ? 8 : 16;
    const bool aligned = ((sg.src | sg.base) & (align - 1)) == 0;
    uint64_t changed = 0;
    uint32_t a[8], x[8];
    load_chunk<S>(sg, l0, lane, aligned, a, x);
    for (uint64_t l = l0; l < l1; ++l) {
        uint32_t an[8], xn[8];
        if (l + 1 < l1) {
            load_chunk<S>(sg, l + 1, lane, aligned, an, xn);
        } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) { an[i] = 0; xn[i] = 0; }
        }
        const uint32_t len = (uint32_t)min((uint64_t)CHUNK, sg.n - l * CHUNK);
        changed += compare_chunk<S>(a, x, len, lane, st, &words[sg.chunk + l]);
#pragma unroll
        for (int i = 0; i < 8; ++i) { a[i] = an[i]; x[i] = xn[i]; }
    }
    return changed;
}

// Where run r's stream lies in the scratch: the scratch offset of its first chunk.
__device__ __forceinline__ uint64_t run_scratch(const Seg* segs, uint32_t nsegs, uint64_t r) {
    const uint64_t k = r * RUN;
    const Seg& sg = segs[seg_of(segs, nsegs, k)];
    return sg.scratch + (k - sg.chunk) * CHUNK * sg.elem;
}

extern "C" __global__ void __launch_bounds__(256, 4)
awex_wire_compare(const Seg* __restrict__ segs, uint32_t nsegs, uint64_t nchunks,
                  uint32_t* __restrict__ words, uint8_t* __restrict__ scratch, uint64_t* status) {
    __shared__ __align__(16) uint8_t rings[8][RING];
    __shared__ uint64_t block_changed;
    const uint32_t lane = threadIdx.x & 31u, wib = threadIdx.x >> 5;
    if (threadIdx.x == 0) block_changed = 0;
    __syncthreads();
    const uint64_t warps = (uint64_t)gridDim.x * (blockDim.x >> 5);
    const uint64_t w = (uint64_t)blockIdx.x * (blockDim.x >> 5) + wib;
    const uint64_t nruns = (nchunks + RUN - 1) / RUN;
    uint64_t changed = 0;
    Stream st;
    st.ring = rings[wib];
    st.fill = st.flushed = 0;
    // runs w, w + warps, ...: each run's chunks, one segment's part at a time
    for (uint64_t r = w; r < nruns; r += warps) {
        const uint64_t k0 = r * RUN, k1 = min(nchunks, k0 + RUN);
        st.dst = scratch + run_scratch(segs, nsegs, r);
        for (uint32_t si = seg_of(segs, nsegs, k0); si < nsegs; ++si) {
            const Seg sg = segs[si];
            if (sg.chunk >= k1) break;
            const uint64_t end = sg.chunk + nchunks_of(sg);
            if (end <= k0) continue;
            const uint64_t l0 = max(k0, sg.chunk) - sg.chunk, l1 = min(k1, end) - sg.chunk;
            switch (sg.elem) {
                case 1: changed += compare_run<1>(sg, l0, l1, lane, st, words); break;
                case 2: changed += compare_run<2>(sg, l0, l1, lane, st, words); break;
                default: changed += compare_run<4>(sg, l0, l1, lane, st, words); break;
            }
        }
        stream_flush(st, lane, true);
    }
    // the changed elements: one atomic a block
    if (lane == 0 && changed > 0) atomicAdd((unsigned long long*)&block_changed, (unsigned long long)changed);
    __syncthreads();
    if (threadIdx.x == 0 && block_changed > 0)
        atomicAdd((unsigned long long*)&status[2], (unsigned long long)block_changed);
}

// The tile's chunk sizes (4 a thread) scanned: `sizes` holds each chunk's payload bytes,
// `pre` each thread's exclusive prefix; returns the tile's sum. Writes plan[i].start (the
// in-tile prefix) for every segment whose first chunk lies in the tile.
__device__ uint64_t tile_scan(const Seg* segs, uint32_t nsegs, uint64_t t0, uint64_t t1,
                              const uint32_t* sz4, uint16_t* sizes, uint64_t* pre, Plan* plan) {
    const uint32_t t = threadIdx.x;
    uint64_t mine = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        sizes[4 * t + i] = (uint16_t)sz4[i];
        mine += sz4[i];
    }
    uint64_t total;
    const uint64_t ex = block_scan(mine, &total);
    pre[t] = ex;
    __syncthreads();
    if (plan != nullptr) {
        const uint32_t lo = first_seg_at_or_after(segs, nsegs, t0);
        const uint32_t hi = first_seg_at_or_after(segs, nsegs, t1);
        for (uint32_t i = lo + t; i < hi; i += blockDim.x) {
            const uint32_t r = (uint32_t)(segs[i].chunk - t0);
            uint64_t p = pre[r / 4];
            for (uint32_t q = r & ~3u; q < r; ++q) p += sizes[q];
            plan[i].start = p;
        }
    }
    __syncthreads();
    return total;
}

extern "C" __global__ void __launch_bounds__(256)
awex_wire_tile_sums(const Seg* __restrict__ segs, uint32_t nsegs, uint64_t nchunks,
                    const uint32_t* __restrict__ words, uint64_t* __restrict__ tiles, Plan* plan) {
    __shared__ uint16_t sizes[TILE];
    __shared__ uint64_t pre[256];
    const uint64_t t0 = (uint64_t)blockIdx.x * TILE, t1 = min(nchunks, t0 + TILE);
    uint32_t sz4[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const uint64_t k = t0 + 4 * threadIdx.x + i;
        sz4[i] = k < t1 ? (words[k] & 0xffffu) : 0u;
    }
    const uint64_t total = tile_scan(segs, nsegs, t0, t1, sz4, sizes, pre, plan);
    if (threadIdx.x == 0) tiles[blockIdx.x] = total;
}

// The tiles' exclusive prefix in place; returns the sum of all.
__device__ uint64_t scan_tiles(uint64_t* tiles, uint32_t ntiles) {
    uint64_t carry = 0;
    for (uint32_t b = 0; b < ntiles; b += blockDim.x) {
        const uint32_t i = b + threadIdx.x;
        const uint64_t v = i < ntiles ? tiles[i] : 0;
        uint64_t tot;
        const uint64_t ex = block_scan(v, &tot);
        if (i < ntiles) tiles[i] = carry + ex;
        carry += tot;
    }
    __syncthreads();
    return carry;
}

// Every segment's plan[i].start from the in-tile prefix to the table's.
__device__ void segment_starts(const Seg* segs, uint32_t nsegs, uint64_t nchunks,
                               const uint64_t* tiles, uint64_t total, Plan* plan) {
    for (uint32_t i = threadIdx.x; i < nsegs; i += blockDim.x) {
        const uint64_t k = segs[i].chunk;
        plan[i].start = k >= nchunks ? total : tiles[k / TILE] + plan[i].start;
    }
    __syncthreads();
}

extern "C" __global__ void __launch_bounds__(1024)
awex_wire_plan(const Seg* __restrict__ segs, uint32_t nsegs, uint64_t nchunks,
               uint64_t* tiles, uint32_t ntiles, Plan* plan, uint8_t* frame, uint64_t* status) {
    const uint64_t total = scan_tiles(tiles, ntiles);
    segment_starts(segs, nsegs, nchunks, tiles, total, plan);
    const uint64_t head = 4 + 4 * (uint64_t)nsegs;
    uint64_t carry = head;
    for (uint32_t b = 0; b < nsegs; b += blockDim.x) {
        const uint32_t i = b + threadIdx.x;
        uint64_t len = 0;
        uint32_t tag = 0;
        if (i < nsegs) {
            const Seg sg = segs[i];
            const uint64_t end = i + 1 < nsegs ? plan[i + 1].start : total;
            const uint64_t body = end - plan[i].start;
            const uint64_t sparse = 1 + nchunks_of(sg) + body;
            if (body == 0) { tag = 2; len = 1; }
            else if (sg.n * sg.elem < sparse) { tag = 0; len = 1 + sg.n * sg.elem; }
            else { tag = 1; len = sparse; }
            if (len > 0xffffffffull) fail(status, i, E_TOOLONG);
        }
        uint64_t tot;
        const uint64_t ex = block_scan(len, &tot);
        if (i < nsegs) {
            plan[i].off = carry + ex;
            plan[i].tag = tag;
            plan[i].len = (uint32_t)len;
            reinterpret_cast<uint32_t*>(frame)[1 + i] = (uint32_t)len;
            frame[carry + ex] = (uint8_t)tag;
        }
        carry += tot;
    }
    if (threadIdx.x == 0) {
        reinterpret_cast<uint32_t*>(frame)[0] = nsegs;
        status[0] = carry;
    }
}

// Copies `len` bytes by one warp (the decoder's copies).
__device__ __forceinline__ void warp_copy(uint8_t* dst, const uint8_t* src, uint32_t len, uint32_t lane) {
    for (uint32_t k = lane; k < len; k += 32) dst[k] = src[k];
}

// Copies `len` bytes by one warp, 4 bytes a lane at a time: whole aligned words of `dst`,
// each made of two aligned words of `src` (any alignment of either), the ends byte by byte.
__device__ __forceinline__ void warp_copy_words(uint8_t* __restrict__ dst, const uint8_t* __restrict__ src,
                                                uint32_t len, uint32_t lane) {
    const uint32_t head = min(len, (uint32_t)((4 - ((uintptr_t)dst & 3)) & 3));
    if (lane < head) dst[lane] = src[lane];
    const uint32_t body = (len - head) / 4;
    const uint8_t* s0 = src + head;
    const uint32_t sh = (uint32_t)((uintptr_t)s0 & 3);
    const uint32_t* sw = reinterpret_cast<const uint32_t*>((uintptr_t)s0 & ~(uintptr_t)3);
    uint32_t* dw = reinterpret_cast<uint32_t*>(dst + head);
    for (uint32_t i = lane; i < body; i += 32) {
        uint32_t v;
        if (sh == 0) {
            v = sw[i];
        } else {
            // sw[i + 1] lies inside the source: its bytes up to s0 + 4 i + 3 are
            v = __funnelshift_r(sw[i], sw[i + 1], 8 * sh);
        }
        dw[i] = v;
    }
    const uint32_t done = head + 4 * body;
    if (lane < len - done) dst[done + lane] = src[done + lane];
}

// A chunk's payload bytes and (<< 32) its staged bytes (a sparse chunk's payload; a whole
// chunk's bytes are new's), from its word.
__device__ __forceinline__ uint64_t both_sizes(uint32_t wd) {
    const uint64_t size = wd & 0xffffu;
    return size | ((wd >> 16) == DENSE_CHUNK ? 0ull : size << 32);
}

// Byte b (< T) of a group's payloads laid one after another (lane j's from its exclusive
// prefix ex_j): its destination (0 for b >= T) and its value, the lane found by a binary
// search over the lanes' prefixes. Every lane of the warp must call it.
__device__ __forceinline__ void coop_load(uint32_t b, uint32_t T, uint32_t ex, uint8_t* dst,
                                          const uint8_t* src, uint64_t& d, uint32_t& v) {
    uint32_t j = 0;
#pragma unroll
    for (uint32_t step = 16; step > 0; step >>= 1) {
        const uint32_t e = __shfl_sync(0xffffffffu, ex, j + step);
        if (e <= b) j += step;
    }
    const uint32_t ej = __shfl_sync(0xffffffffu, ex, j);
    const uint64_t dj = __shfl_sync(0xffffffffu, (unsigned long long)dst, j);
    const uint64_t sj = __shfl_sync(0xffffffffu, (unsigned long long)src, j);
    d = b < T ? dj + (b - ej) : 0;
    v = b < T ? *reinterpret_cast<const uint8_t*>(sj + (b - ej)) : 0;
}

// Payloads up to this many bytes are copied byte by byte by the warp together (the group's
// payloads one after another, a lane a byte), larger ones by the whole warp a word a lane.
#define COOP 64u
// Bytes a lane loads before it stores them, in the copy of small payloads.
#ifndef COOP_BYTES
#define COOP_BYTES 4u
#endif

extern "C" __global__ void __launch_bounds__(256)
awex_wire_write(const Seg* __restrict__ segs, uint32_t nsegs, uint64_t nchunks,
                const uint32_t* __restrict__ words, const uint64_t* __restrict__ tiles,
                const Plan* __restrict__ plan, const uint8_t* __restrict__ scratch,
                uint8_t* __restrict__ frame, const uint64_t* status) {
    // per chunk: its word; per thread (4 chunks): the prefixes of payload and staged bytes
    __shared__ uint32_t sizes[TILE];
    __shared__ uint64_t pre[256];
    if (status[1] != ~0ull) return;
    const uint64_t t0 = (uint64_t)blockIdx.x * TILE, t1 = min(nchunks, t0 + TILE);
    uint64_t mine = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const uint64_t k = t0 + 4 * threadIdx.x + i;
        const uint32_t v = k < t1 ? words[k] : 0u;
        sizes[4 * threadIdx.x + i] = v;
        mine += both_sizes(v);
    }
    uint64_t total;
    pre[threadIdx.x] = block_scan(mine, &total);
    __syncthreads();
    const uint64_t tile_pre = tiles[blockIdx.x];
    const uint32_t lane = threadIdx.x & 31u, wib = threadIdx.x >> 5;
    // warp wib takes the tile's chunks wib * 128 .. wib * 128 + 127 (half a run), 32 at a
    // time: a lane per chunk finds its place and its source
    const uint64_t k0 = t0 + wib * (TILE / 8), k1 = min(t1, k0 + TILE / 8);
    if (k0 >= k1) return;
    // the run's stream: its place in the scratch, and the staged bytes before it in the tile
    const uint64_t run0 = k0 / RUN * RUN;
    const uint8_t* stream = scratch + run_scratch(segs, nsegs, k0 / RUN);
    const uint32_t run_staged = (uint32_t)(pre[(run0 - t0) / 4] >> 32);
    for (uint64_t g = k0; g < k1; g += 32) {
        const uint64_t k = g + lane;
        uint8_t* dst = nullptr;
        const uint8_t* src = nullptr;
        uint32_t size = 0;
        if (k < k1) {
            const uint32_t si = seg_of(segs, nsegs, k);
            const Seg sg = segs[si];
            const Plan p = plan[si];
            const uint32_t S = sg.elem;
            const uint64_t local = k - sg.chunk;
            const uint64_t first = local * CHUNK;
            const uint32_t len = (uint32_t)min((uint64_t)CHUNK, sg.n - first);
            const uint8_t* nw = reinterpret_cast<const uint8_t*>(sg.src) + first * S;
            if (p.tag == 0) {
                dst = frame + p.off + 1 + first * S;
                src = nw;
                size = len * S;
            } else if (p.tag == 1) {
                const uint32_t r = (uint32_t)(k - t0);
                const uint32_t wd = sizes[r];
                const uint32_t count = wd >> 16;
                size = wd & 0xffffu;
                frame[p.off + 1 + local] = (uint8_t)count;
                if (size > 0) {
                    uint64_t at = pre[r / 4];
                    for (uint32_t q = r & ~3u; q < r; ++q) at += both_sizes(sizes[q]);
                    dst = frame + p.off + 1 + nchunks_of(sg) + (tile_pre + (uint32_t)at - p.start);
                    src = count == DENSE_CHUNK ? nw : stream + ((uint32_t)(at >> 32) - run_staged);
                }
            }
        }
        // small payloads: the group's bytes one after another, a lane a byte
        const bool big = size > COOP;
        const uint32_t small = big ? 0u : size;
        const uint32_t inc = warp_inclusive_scan<uint32_t>(small, lane);
        const uint32_t T = __shfl_sync(0xffffffffu, inc, 31);
        const uint32_t ex = inc - small;
        for (uint32_t b0 = 0; b0 < T; b0 += COOP_BYTES * 32) {
            // COOP_BYTES bytes a lane: all the loads in flight before the stores
            uint64_t d[COOP_BYTES];
            uint32_t v[COOP_BYTES];
#pragma unroll
            for (uint32_t u = 0; u < COOP_BYTES; ++u) coop_load(b0 + 32 * u + lane, T, ex, dst, src, d[u], v[u]);
#pragma unroll
            for (uint32_t u = 0; u < COOP_BYTES; ++u)
                if (d[u] != 0) *reinterpret_cast<uint8_t*>(d[u]) = (uint8_t)v[u];
        }
        uint32_t m = __ballot_sync(0xffffffffu, big);
        while (m != 0) {
            const int j = __ffs(m) - 1;
            m &= m - 1;
            uint8_t* d = reinterpret_cast<uint8_t*>(__shfl_sync(0xffffffffu, (unsigned long long)dst, j));
            const uint8_t* sp = reinterpret_cast<const uint8_t*>(__shfl_sync(0xffffffffu, (unsigned long long)src, j));
            const uint32_t z = __shfl_sync(0xffffffffu, size, j);
            warp_copy_words(d, sp, z, lane);
        }
    }
}

// ---------------------------------------------------------------------------------------
// decode

// The decoder's payloads up to this many bytes are copied by the lane that owns the chunk,
// larger ones by the whole warp, one chunk after another.
#define SMALL 32u

extern "C" __global__ void __launch_bounds__(1024)
awex_wire_read_header(const Seg* __restrict__ segs, uint32_t nsegs, const uint8_t* __restrict__ frame,
                      uint64_t frame_len, Plan* plan, uint64_t* status) {
    const uint64_t head = 4 + 4 * (uint64_t)nsegs;
    if (frame_len < head) {
        if (threadIdx.x == 0) fail(status, 0, E_HEADER);
        return;
    }
    const uint32_t* hw = reinterpret_cast<const uint32_t*>(frame);
    if (hw[0] != nsegs) {
        if (threadIdx.x == 0) fail(status, 0, E_COUNT);
        return;
    }
    uint64_t carry = head;
    for (uint32_t b = 0; b < nsegs; b += blockDim.x) {
        const uint32_t i = b + threadIdx.x;
        const uint64_t len = i < nsegs ? hw[1 + i] : 0;
        uint64_t tot;
        const uint64_t ex = block_scan(len, &tot);
        if (i < nsegs) {
            plan[i].off = carry + ex;
            plan[i].len = (uint32_t)len;
            if (len == 0) fail(status, i, E_EMPTY);
        }
        carry += tot;
    }
    if (carry != frame_len) {
        if (threadIdx.x == 0) fail(status, 0, E_LENGTHS);
        return;
    }
    for (uint32_t i = threadIdx.x; i < nsegs; i += blockDim.x) {
        const Seg sg = segs[i];
        const Plan p = plan[i];
        if (p.len == 0) continue;
        const uint32_t tag = frame[p.off];
        plan[i].tag = tag;
        if (tag == 3) fail(status, i, E_GAPS);
        else if (tag > 3) fail(status, i, E_TAG);
        else if (tag == 2 && p.len != 1) fail(status, i, E_SEGLEN);
        else if (tag == 0 && p.len != 1 + sg.n * sg.elem) fail(status, i, E_SEGLEN);
        else if (tag == 1 && p.len < 1 + nchunks_of(sg)) fail(status, i, E_SEGLEN);
    }
}

extern "C" __global__ void __launch_bounds__(256)
awex_wire_decode_sums(const Seg* __restrict__ segs, uint32_t nsegs, uint64_t nchunks,
                      const uint8_t* __restrict__ frame, Plan* plan, uint64_t* status,
                      uint32_t* __restrict__ words, uint64_t* __restrict__ tiles) {
    __shared__ uint16_t sizes[TILE];
    __shared__ uint64_t pre[256];
    if (status[1] != ~0ull) return;
    const uint64_t t0 = (uint64_t)blockIdx.x * TILE, t1 = min(nchunks, t0 + TILE);
    uint32_t sz4[4];
    uint32_t si = t0 + 4 * threadIdx.x < t1 ? seg_of(segs, nsegs, t0 + 4 * threadIdx.x) : 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const uint64_t k = t0 + 4 * threadIdx.x + i;
        sz4[i] = 0;
        if (k >= t1) continue;
        while (k >= segs[si].chunk + nchunks_of(segs[si])) ++si;
        const Seg& sg = segs[si];
        const uint32_t tag = plan[si].tag;
        if (tag != 1) { words[k] = 0; continue; }
        const uint64_t local = k - sg.chunk;
        const uint32_t len = (uint32_t)min((uint64_t)CHUNK, sg.n - local * CHUNK);
        const uint32_t count = frame[plan[si].off + 1 + local];
        uint32_t size;
        if (count == DENSE_CHUNK) size = len * sg.elem;
        else {
            if (count > len) fail(status, si, E_CHUNK);
            size = count * (1 + sg.elem);
        }
        sz4[i] = size;
        words[k] = size | (count << 16);
    }
    const uint64_t total = tile_scan(segs, nsegs, t0, t1, sz4, sizes, pre, plan);
    if (threadIdx.x == 0) tiles[blockIdx.x] = total;
}

extern "C" __global__ void __launch_bounds__(1024)
awex_wire_decode_plan(const Seg* __restrict__ segs, uint32_t nsegs, uint64_t nchunks,
                      uint64_t* tiles, uint32_t ntiles, Plan* plan, uint64_t* status) {
    if (status[1] != ~0ull) return;
    const uint64_t total = scan_tiles(tiles, ntiles);
    segment_starts(segs, nsegs, nchunks, tiles, total, plan);
    for (uint32_t i = threadIdx.x; i < nsegs; i += blockDim.x) {
        const Plan p = plan[i];
        if (p.tag != 1) continue;
        const uint64_t end = i + 1 < nsegs ? plan[i + 1].start : total;
        if (1 + nchunks_of(segs[i]) + (end - p.start) != p.len) fail(status, i, E_SEGLEN);
    }
}

// Writes a sparse chunk's `count` values (offsets at `src`, then values) into `dst` after
// checking its offsets, lanes `lane0, lane0 + step, ...` of the work; false if they are bad.
__device__ __forceinline__ bool offsets_ok(const uint8_t* src, uint32_t count, uint32_t len,
                                           uint32_t j0, uint32_t step) {
    bool ok = true;
    for (uint32_t j = j0; j < count; j += step) {
        const uint32_t o = src[j];
        ok &= o < len && (j == 0 || o > (uint32_t)src[j - 1]);
    }
    return ok;
}

__device__ __forceinline__ void put_values(uint8_t* dst, const uint8_t* src, uint32_t count,
                                           uint32_t S, uint32_t j0, uint32_t step) {
    for (uint32_t j = j0; j < count; j += step) {
        uint8_t* d = dst + (uint64_t)src[j] * S;
        const uint8_t* v = src + count + j * S;
        for (uint32_t b = 0; b < S; ++b) d[b] = v[b];
    }
}

extern "C" __global__ void __launch_bounds__(256)
awex_wire_apply(const Seg* __restrict__ segs, uint32_t nsegs, uint64_t nchunks,
                const uint8_t* __restrict__ frame, const uint32_t* __restrict__ words,
                const uint64_t* __restrict__ tiles, const Plan* __restrict__ plan,
                uint64_t* status) {
    __shared__ uint16_t sizes[TILE];
    __shared__ uint64_t pre[256];
    if (status[1] != ~0ull) return;
    const uint64_t t0 = (uint64_t)blockIdx.x * TILE, t1 = min(nchunks, t0 + TILE);
    uint32_t sz4[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const uint64_t k = t0 + 4 * threadIdx.x + i;
        sz4[i] = k < t1 ? (words[k] & 0xffffu) : 0u;
    }
    tile_scan(segs, nsegs, t0, t1, sz4, sizes, pre, nullptr);
    const uint64_t tile_pre = tiles[blockIdx.x];
    const uint32_t lane = threadIdx.x & 31u, wib = threadIdx.x >> 5;
    const uint64_t k0 = t0 + wib * (TILE / 8), k1 = min(t1, k0 + TILE / 8);
    for (uint64_t g = k0; g < k1; g += 32) {
        const uint64_t k = g + lane;
        // what this lane's chunk needs: a copy of `size` bytes, or `count` sparse values
        uint8_t* dst = nullptr;
        const uint8_t* src = nullptr;
        uint32_t size = 0, count = 0, len = 0, S = 1, si = 0;
        bool sparse = false;
        if (k < k1) {
            si = seg_of(segs, nsegs, k);
            const Seg sg = segs[si];
            const Plan p = plan[si];
            S = sg.elem;
            const uint64_t local = k - sg.chunk;
            const uint64_t first = local * CHUNK;
            len = (uint32_t)min((uint64_t)CHUNK, sg.n - first);
            dst = reinterpret_cast<uint8_t*>(sg.src) + first * S;
            if (p.tag == 0) {
                src = frame + p.off + 1 + first * S;
                size = len * S;
            } else if (p.tag == 1) {
                const uint32_t wd = words[k];
                size = wd & 0xffffu;
                count = wd >> 16;
                if (size > 0) {
                    const uint32_t r = (uint32_t)(k - t0);
                    uint64_t at = pre[r / 4];
                    for (uint32_t q = r & ~3u; q < r; ++q) at += sizes[q];
                    src = frame + p.off + 1 + nchunks_of(sg) + (tile_pre + at - p.start);
                    sparse = count != DENSE_CHUNK;
                }
            }
        }
        const bool big = size > SMALL;
        if (!big && size > 0) {
            if (!sparse) {
                for (uint32_t b = 0; b < size; ++b) dst[b] = src[b];
            } else if (offsets_ok(src, count, len, 0, 1)) {
                put_values(dst, src, count, S, 0, 1);
            } else {
                fail(status, si, E_OFFSET);
            }
        }
        uint32_t m = __ballot_sync(0xffffffffu, big);
        while (m != 0) {
            const int j = __ffs(m) - 1;
            m &= m - 1;
            uint8_t* d = reinterpret_cast<uint8_t*>(__shfl_sync(0xffffffffu, (unsigned long long)dst, j));
            const uint8_t* sp = reinterpret_cast<const uint8_t*>(__shfl_sync(0xffffffffu, (unsigned long long)src, j));
            const uint32_t z = __shfl_sync(0xffffffffu, size, j);
            const bool sj = __shfl_sync(0xffffffffu, sparse, j);
            if (!sj) {
                warp_copy(d, sp, z, lane);
                continue;
            }
            const uint32_t cj = __shfl_sync(0xffffffffu, count, j);
            const uint32_t lj = __shfl_sync(0xffffffffu, len, j);
            const uint32_t Sj = __shfl_sync(0xffffffffu, S, j);
            const uint32_t sij = __shfl_sync(0xffffffffu, si, j);
            // offsets strictly increasing and inside the chunk, checked before any write
            if (!__all_sync(0xffffffffu, offsets_ok(sp, cj, lj, lane, 32))) {
                if (lane == 0) fail(status, sij, E_OFFSET);
                continue;
            }
            put_values(d, sp, cj, Sj, lane, 32);
        }
    }
}
