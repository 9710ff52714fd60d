// awex's element-wise box moves on the GPU: transposed boxes and boxes that convert dtypes
// (the source of transpose.ptx and transpose.sm_90.cubin; see transpose.rs for how to rebuild
// them and for the job table). The CPU references are awex-core/src/layout/copy.rs
// (copy_box_transposed) and awex-core/src/dtype.rs (convert), which these conversions equal bit
// for bit (NaN payloads included; a widened f16 NaN comes out quiet, as through f64).
//
// awex_transpose_table: every job of the table is one matrix of `rows` x `cols` source elements
// of `elem` bytes (1, 2 or 4), element (r, c) at src + r * src_pitch + c * elem, written to
// dst + c * dst_pitch + r * delem (transposed) or dst + r * dst_pitch + c * delem (straight),
// converted by `mode` (delem is the converted element's bytes). One block of 32 x 8 threads per
// 32 x 32 tile of any job: block b finds its job in the table by its first tile (the jobs are
// sorted by it), loads the tile with the threads of a warp along a source row, and stores it
// through shared memory with the threads of a warp along a destination row, so both ends are
// read and written in runs.
//
// Job entry (48 bytes, 16-byte aligned): src u64, dst u64, rows u32, cols u32, src_pitch u32,
// dst_pitch u32, first u32 (the job's first tile), tiles_x u32 (tiles along cols), elem u32,
// mode u32: bits 0-7 the conversion (0 none, 1 bf16 -> f32, 2 f32 -> bf16, 3 f16 -> f32,
// 4 f32 -> f16), bit 8 straight (not transposed). A mode of 0 is the transposed copy.

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
    uint32_t mode;
};

// f32 -> bf16, round to nearest even; a NaN keeps its payload and stays a NaN (dtype.rs)
__device__ __forceinline__ uint32_t f32_to_bf16(uint32_t bits) {
    if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu) != 0) {
        const uint32_t t = bits >> 16;
        return (t & 0x7fu) == 0 ? (t | 0x40u) : t;
    }
    return (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
}

// f32 -> IEEE half, round to nearest even, overflow to infinity (dtype.rs)
__device__ __forceinline__ uint32_t f32_to_f16(uint32_t bits) {
    const uint32_t sign = (bits >> 16) & 0x8000u;
    const int32_t exp = (int32_t)((bits >> 23) & 0xffu);
    const uint32_t man = bits & 0x007fffffu;
    if (exp == 0xff) return sign | 0x7c00u | (man != 0 ? (0x0200u | (man >> 13)) : 0u);
    const int32_t e = exp - 127 + 15;
    if (e >= 0x1f) return sign | 0x7c00u;
    if (e <= 0) {
        if (e < -10) return sign;
        const uint32_t m = man | 0x00800000u;
        const uint32_t shift = (uint32_t)(14 - e);
        const uint32_t half = 1u << (shift - 1);
        const uint32_t rem = m & ((1u << shift) - 1u);
        uint32_t out = m >> shift;
        if (rem > half || (rem == half && (out & 1u))) out += 1;
        return sign | out;
    }
    uint32_t out = ((uint32_t)e << 10) | (man >> 13);
    const uint32_t rem = man & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (out & 1u))) out += 1;
    return sign | out;
}

// IEEE half -> f32, exact; a NaN quiet (dtype.rs's convert, which goes through f64)
__device__ __forceinline__ uint32_t f16_to_f32(uint32_t h) {
    const uint32_t sign = (h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu;
    const uint32_t man = h & 0x03ffu;
    if (exp == 0) {
        if (man == 0) return sign;
        uint32_t e = 127 - 15 + 1, m = man;
        while ((m & 0x0400u) == 0) {
            m <<= 1;
            e -= 1;
        }
        return sign | (e << 23) | ((m & 0x03ffu) << 13);
    }
    // a NaN comes out quiet, as the CPU's conversion (through f64) makes it
    if (exp == 0x1f) return sign | 0x7f800000u | (man << 13) | (man != 0 ? 0x00400000u : 0u);
    return sign | ((exp + 127 - 15) << 23) | (man << 13);
}

__device__ __forceinline__ uint32_t convert(uint32_t v, uint32_t conv) {
    switch (conv) {
        case 1: return v << 16;
        case 2: return f32_to_bf16(v);
        case 3: return f16_to_f32(v);
        case 4: return f32_to_f16(v);
        default: return v;
    }
}

// bytes of an element after conversion `conv` of one of `elem` bytes
__device__ __forceinline__ uint32_t converted_elem(uint32_t elem, uint32_t conv) {
    if (conv == 1 || conv == 3) return 4;
    if (conv == 2 || conv == 4) return 2;
    return elem;
}

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
    const uint32_t conv = j.mode & 0xffu, delem = converted_elem(j.elem, conv);
    if (j.mode & 0x100u) {
        // straight: destination row r holds source row r
        for (uint32_t y = ty; y < 32; y += 8) {
            const uint32_t r = r0 + y, c = c0 + tx;
            if (r < j.rows && c < j.cols)
                store_elem(dst + (uint64_t)r * j.dst_pitch + (uint64_t)c * delem, delem,
                           convert(tile[y][tx], conv));
        }
        return;
    }
    // destination row c0 + y holds source column c0 + y; its element r0 + tx is tile[tx][y]
    for (uint32_t y = ty; y < 32; y += 8) {
        const uint32_t c = c0 + y, r = r0 + tx;
        if (r < j.rows && c < j.cols)
            store_elem(dst + (uint64_t)c * j.dst_pitch + (uint64_t)r * delem, delem,
                       convert(tile[tx][y], conv));
    }
}
