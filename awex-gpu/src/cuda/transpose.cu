// awex's transposed box copy on the GPU (the source of transpose.ptx and transpose.sm_90.cubin;
// see transpose.rs for how to rebuild them and for the job table). The CPU reference is
// awex-core/src/layout/copy.rs (copy_box_transposed).
//
// awex_transpose_table: every job of the table is one matrix of `rows` x `cols` elements of
// `elem` bytes (1, 2 or 4), element (r, c) at src + r * src_pitch + c * elem, written to
// dst + c * dst_pitch + r * elem. One block of 32 x 8 threads per 32 x 32 tile of any job:
// block b finds its job in the table by its first tile (the jobs are sorted by it), loads the
// tile with the threads of a warp along a source row, and stores it through shared memory with
// the threads of a warp along a destination row, so both ends are read and written in runs.
//
// Job entry (48 bytes, 16-byte aligned): src u64, dst u64, rows u32, cols u32, src_pitch u32,
// dst_pitch u32, first u32 (the job's first tile), tiles_x u32 (tiles along cols), elem u32,
// pad u32.

#include <stdint.h>

struct Job {
    uint64_t src;
    uint64_t dst;
    uint32_t rows;
    uint32_t cols;
    uint32_t src_pitch;
    uint32_t dst_pitch;
    uint32_t first;
    uint32_t tiles_x;
    uint32_t elem;
    uint32_t pad;
};

__device__ __forceinline__ uint32_t load_elem(const unsigned char* p, uint32_t elem) {
    if (elem == 2) return *reinterpret_cast<const uint16_t*>(p);
    if (elem == 4) return *reinterpret_cast<const uint32_t*>(p);
    return *p;
}

__device__ __forceinline__ void store_elem(unsigned char* p, uint32_t elem, uint32_t v) {
    if (elem == 2) {
        *reinterpret_cast<uint16_t*>(p) = (uint16_t)v;
    } else if (elem == 4) {
        *reinterpret_cast<uint32_t*>(p) = v;
    } else {
        *p = (unsigned char)v;
    }
}

extern "C" __global__ void __launch_bounds__(256)
awex_transpose_table(const Job* __restrict__ jobs, uint32_t njobs) {
    __shared__ uint32_t tile[32][33];
    const uint32_t b = blockIdx.x;
    // the last job whose first tile is at most b
    uint32_t lo = 0, hi = njobs;
    while (hi - lo > 1) {
        const uint32_t mid = (lo + hi) / 2;
        if (jobs[mid].first <= b) lo = mid; else hi = mid;
    }
    const Job j = jobs[lo];
    const uint32_t t = b - j.first;
    const uint32_t r0 = (t / j.tiles_x) * 32, c0 = (t % j.tiles_x) * 32;
    const uint32_t tx = threadIdx.x, ty = threadIdx.y;
    const unsigned char* src = reinterpret_cast<const unsigned char*>(j.src);
    unsigned char* dst = reinterpret_cast<unsigned char*>(j.dst);
    for (uint32_t y = ty; y < 32; y += 8) {
        const uint32_t r = r0 + y, c = c0 + tx;
        if (r < j.rows && c < j.cols)
            tile[y][tx] = load_elem(src + (uint64_t)r * j.src_pitch + (uint64_t)c * j.elem, j.elem);
    }
    __syncthreads();
    // destination row c0 + y holds source column c0 + y; its element r0 + tx is tile[tx][y]
    for (uint32_t y = ty; y < 32; y += 8) {
        const uint32_t c = c0 + y, r = r0 + tx;
        if (r < j.rows && c < j.cols)
            store_elem(dst + (uint64_t)c * j.dst_pitch + (uint64_t)r * j.elem, j.elem, tile[tx][y]);
    }
}
