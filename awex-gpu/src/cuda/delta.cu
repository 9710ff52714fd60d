// awex's GPU delta kernels (the source of delta.ptx and delta.sm_90.cubin; see delta.rs for how
// to rebuild them). The encoding room's CPU reference is awex-core/src/encoding/delta.rs.
//
// awex_diff_tiles: the tile kernel (copy_tiles.ptx, awex-gpu/src/cuda/tiles.rs) with the
// destination read first: a 16-byte vector is written only where its bytes differ from the
// source's. The destination ends holding exactly the source's bytes, whatever it held before,
// so a receiver needs no record of the version it holds; it writes only what changed and
// counts the vectors it wrote in *changed (one atomic add per warp at the end). Same table,
// same scheduling: each block takes the next tile from *counter (zeroed before the launch).
//
// awex_step_bf16: a synthetic optimiser step for benchmarks and tests: element i of n bf16
// values changes by one unit in the last place (its lowest bit flipped) where a hash of
// (seed, i) falls below `threshold` / 2^32, so about that fraction of the elements change,
// spread element by element as an optimiser's small updates spread them.
//
// Every address and pitch of a tile is a multiple of 16 bytes (the engine checks).

#include <stdint.h>

struct Tile {
    uint64_t src;
    uint64_t dst;
    uint32_t nvec;
    uint32_t rows;
    uint32_t spitch;
    uint32_t dpitch;
};

__device__ __forceinline__ uint4 load_src(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"((uint64_t)__cvta_generic_to_global(p)));
    return v;
}

__device__ __forceinline__ uint4 load_dst(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"((uint64_t)__cvta_generic_to_global(p)));
    return v;
}

__device__ __forceinline__ void store(uint4* p, uint4 v) {
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"((uint64_t)__cvta_generic_to_global(p)), "r"(v.x), "r"(v.y),
                 "r"(v.z), "r"(v.w)
                 : "memory");
}

__device__ __forceinline__ bool same(uint4 a, uint4 b) {
    return ((a.x ^ b.x) | (a.y ^ b.y) | (a.z ^ b.z) | (a.w ^ b.w)) == 0;
}

// Writes `a` at `p` where it differs from `b` (counting it in `mine`), and also where the
// vector of the lane that holds the other half of the same 32-byte sector differs (`partner`,
// 32 or more where that half is in another warp's step): HBM with ECC turns a half-sector
// write into a read, merge and write, so a sector that changes is written whole. Writing a
// vector that already equals the source changes nothing; only differing vectors are counted.
__device__ __forceinline__ void put(uint4* p, uint4 a, uint4 b, uint32_t partner,
                                    unsigned long long& mine) {
    const bool differs = !same(a, b);
    // lanes outside the loop's last partial step are inactive: their bits read 0
    const uint32_t m = __ballot_sync(__activemask(), differs);
    if (differs) ++mine;
    if (differs || (partner < 32u && ((m >> partner) & 1u))) store(p, a);
}

extern "C" __global__ void __launch_bounds__(256, 4)
awex_diff_tiles(const Tile* __restrict__ tiles, uint32_t* counter, uint32_t ntiles,
                unsigned long long* changed) {
    __shared__ uint32_t s_tile;
    const uint64_t stride = blockDim.x;
    const uint32_t lane = threadIdx.x & 31u;
    unsigned long long mine = 0;
    for (;;) {
        if (threadIdx.x == 0) s_tile = atomicAdd(counter, 1u);
        __syncthreads();
        const uint32_t t = s_tile;
        // every thread has read it before thread 0 may write the next one
        __syncthreads();
        if (t >= ntiles) break;
        const Tile e = tiles[t];
        const uint64_t nvec = e.nvec;
        for (uint32_t r = 0; r < e.rows; ++r) {
            const uint4* s = reinterpret_cast<const uint4*>(e.src + (uint64_t)r * e.spitch);
            uint4* d = reinterpret_cast<uint4*>(e.dst + (uint64_t)r * e.dpitch);
            uint64_t v = threadIdx.x;
            // the lane holding the other half of this lane's sector: lane ^ 1 where the row
            // starts on a 32-byte boundary, the lane before or after where it starts halfway
            const uint32_t o = (uint32_t)((e.dst + (uint64_t)r * e.dpitch) >> 4) & 1u;
            const uint32_t partner = ((lane + o) ^ 1u) - o;
            // four vectors a step, all loads first, so that enough are in flight
            for (; v + 3 * stride < nvec; v += 4 * stride) {
                const uint4 a0 = load_src(s + v), a1 = load_src(s + v + stride),
                            a2 = load_src(s + v + 2 * stride), a3 = load_src(s + v + 3 * stride);
                const uint4 b0 = load_dst(d + v), b1 = load_dst(d + v + stride),
                            b2 = load_dst(d + v + 2 * stride), b3 = load_dst(d + v + 3 * stride);
                put(d + v, a0, b0, partner, mine);
                put(d + v + stride, a1, b1, partner, mine);
                put(d + v + 2 * stride, a2, b2, partner, mine);
                put(d + v + 3 * stride, a3, b3, partner, mine);
            }
            for (; v < nvec; v += stride) {
                const uint4 a = load_src(s + v), b = load_dst(d + v);
                put(d + v, a, b, partner, mine);
            }
        }
    }
    // one atomic per warp
    for (int o = 16; o > 0; o >>= 1) mine += __shfl_down_sync(0xffffffffu, mine, o);
    if ((threadIdx.x & 31) == 0 && mine != 0) atomicAdd(changed, mine);
}

__device__ __forceinline__ uint64_t splitmix(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    uint64_t z = x;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

extern "C" __global__ void __launch_bounds__(256)
awex_step_bf16(uint16_t* p, uint64_t n, uint64_t seed, uint32_t threshold) {
    const uint64_t step = (uint64_t)gridDim.x * blockDim.x;
    for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) {
        if ((uint32_t)(splitmix(seed ^ i) >> 32) < threshold) p[i] ^= (uint16_t)1;
    }
}
