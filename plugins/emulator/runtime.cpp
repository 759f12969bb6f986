// The emulator's runtime (emulator.h): fibers for a block's threads (Boost.Context), the barrier
// and warp collectives that switch between them, and the few CUDA runtime calls the launchers and
// the plugin harness make.
#include "emulator/emulator.h"

#include <boost/context/fiber.hpp>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

namespace emu
{
namespace
{

constexpr size_t kStack = 256 * 1024;

enum class State
{
    kRun,
    kBarrier,
    kWarp,
    kDone,
};

namespace context = boost::context;

// Hands fiber i the stack it had in the last block: a block's fibers are made anew, their stacks not.
struct Stack
{
    char* base;
    context::stack_context allocate()
    {
        context::stack_context s;
        s.size = kStack;
        s.sp = base + kStack;
        return s;
    }
    void deallocate(context::stack_context&) {}
};

struct Fiber
{
    Thread t;
    context::fiber self, scheduler; // this thread's context while the scheduler runs, and the other way round
    std::unique_ptr<char[]> stack;
    State state = State::kRun;
    void const* in = nullptr;
    void* out = nullptr;
    void (*fn)(void const* const*, void* const*) = nullptr;
};

struct Launch
{
    Block block;
    std::vector<Fiber> fibers;
    std::vector<unsigned char> smem;
    std::function<void()> const* body = nullptr;
    Fiber* current = nullptr;
};

Launch* g_launch = nullptr;
cudaError_t g_error = cudaSuccess;

void yield(State s)
{
    Fiber* f = g_launch->current;
    f->state = s;
    f->scheduler = std::move(f->scheduler).resume();
}

std::string where(Launch const& l)
{
    char buf[96];
    std::snprintf(buf, sizeof buf, "block (%u, %u, %u) of (%u, %u, %u)", l.block.idx.x, l.block.idx.y, l.block.idx.z,
        l.block.grid.x, l.block.grid.y, l.block.grid.z);
    return buf;
}

// After a pass in which every thread ran until it waited or exited: releases the warp collectives
// every lane of the warp is at, else the barrier once every live thread is at it. Returns false
// with a message where nothing can go on.
bool resolve(Launch& l, std::string& why)
{
    bool progress = false;
    size_t const n = l.fibers.size();
    for (size_t w = 0; w < n; w += 32)
    {
        size_t const end = w + 32 < n ? w + 32 : n;
        bool any = false, all = true;
        for (size_t i = w; i < end; ++i)
        {
            any |= l.fibers[i].state == State::kWarp;
            all &= l.fibers[i].state == State::kWarp && l.fibers[i].fn == l.fibers[w].fn;
        }
        if (!any)
            continue;
        if (!all || end - w != 32)
        {
            why = "warp " + std::to_string(w / 32) + " of " + where(l)
                + ": a warp collective that not every lane of the warp reached (a lane exited, waits at a "
                  "barrier or at another collective)";
            return false;
        }
        void const* ins[32];
        void* outs[32];
        for (size_t i = 0; i < 32; ++i)
        {
            ins[i] = l.fibers[w + i].in;
            outs[i] = l.fibers[w + i].out;
        }
        l.fibers[w].fn(ins, outs);
        for (size_t i = w; i < end; ++i)
            l.fibers[i].state = State::kRun;
        progress = true;
    }
    if (progress)
        return true;
    size_t live = 0, waiting = 0;
    for (auto const& f : l.fibers)
    {
        live += f.state != State::kDone;
        waiting += f.state == State::kBarrier;
    }
    if (live == 0)
        return true;
    if (waiting == live)
    {
        for (auto& f : l.fibers)
            if (f.state == State::kBarrier)
                f.state = State::kRun;
        return true;
    }
    why = where(l) + ": " + std::to_string(waiting) + " of " + std::to_string(live)
        + " live threads wait at __syncthreads and the others at a warp collective";
    return false;
}

} // namespace

Thread const& thread() { return g_launch->current->t; }
Block const& block() { return g_launch->block; }
void* dynamicSharedBytes() // 128-byte aligned, as the kernels declare it
{
    return reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(g_launch->smem.data()) + 127) & ~uintptr_t(127));
}

void syncthreads() { yield(State::kBarrier); }

void warpCollective(void const* in, void* out, void (*fn)(void const* const*, void* const*))
{
    Fiber* f = g_launch->current;
    f->in = in;
    f->out = out;
    f->fn = fn;
    yield(State::kWarp);
}

void syncwarp()
{
    warpCollective(nullptr, nullptr, [](void const* const*, void* const*) {});
}

void fail(char const* why)
{
    std::fprintf(stderr, "emulator: %s\n", why);
    std::abort();
}

void unknown(char const* text) { fail(("no emulation of the PTX \"" + std::string(text) + "\"").c_str()); }

namespace
{
constexpr uint32_t kHandles = 1u << 16;
void const* g_shared[kHandles];
uint32_t g_next_handle = 0;

float half(uint32_t bits, bool bf16)
{
    if (bf16)
    {
        __nv_bfloat16_raw r;
        r.x = static_cast<unsigned short>(bits);
        return __bfloat162float(__nv_bfloat16(r));
    }
    __half_raw r;
    r.x = static_cast<unsigned short>(bits);
    return __half2float(__half(r));
}

float tf32Bits(uint32_t bits)
{
    float f;
    std::memcpy(&f, &bits, 4);
    return tf32Operand(f);
}

enum class Mma
{
    kF16,
    kBF16,
    kTF32,
};

struct MmaIn
{
    Mma kind;
    float c[4];
    uint32_t a[4], b0, b1;
};

// mma.sync's fragments (lane = 4 g + q; core/mma.cuh): C and D c[0], c[1] row g, columns 2q, 2q + 1 and
// c[2], c[3] row g + 8. m16n8k16: A a[0] row g, columns 2q, 2q + 1 (low half first), a[1] row g + 8,
// a[2], a[3] the same rows 8 columns on; B b0 rows 2q, 2q + 1 of column g, b1 8 rows on. m16n8k8
// (TF32): A a[0] row g column q, a[1] row g + 8, a[2], a[3] the same rows column q + 4; B b0 row q of
// column g, b1 row q + 4.
void mmaWarp(void const* const* ins, void* const* outs)
{
    auto in = [&](int l) { return *static_cast<MmaIn const*>(ins[l]); };
    Mma const kind = in(0).kind;
    int const k = kind == Mma::kTF32 ? 8 : 16;
    float A[16][16] = {}, B[16][8] = {}, C[16][8] = {};
    for (int l = 0; l < 32; ++l)
    {
        MmaIn const x = in(l);
        if (x.kind != kind)
            fail("lanes of one warp run different mma.sync shapes");
        int const g = l / 4, q = l % 4;
        C[g][2 * q] = x.c[0], C[g][2 * q + 1] = x.c[1], C[g + 8][2 * q] = x.c[2], C[g + 8][2 * q + 1] = x.c[3];
        if (kind == Mma::kTF32)
        {
            A[g][q] = tf32Bits(x.a[0]), A[g + 8][q] = tf32Bits(x.a[1]);
            A[g][q + 4] = tf32Bits(x.a[2]), A[g + 8][q + 4] = tf32Bits(x.a[3]);
            B[q][g] = tf32Bits(x.b0), B[q + 4][g] = tf32Bits(x.b1);
            continue;
        }
        bool const bf = kind == Mma::kBF16;
        for (int r = 0; r < 4; ++r)
        {
            int const row = g + (r % 2) * 8, col = 2 * q + (r / 2) * 8;
            A[row][col] = half(x.a[r] & 0xffffu, bf), A[row][col + 1] = half(x.a[r] >> 16, bf);
        }
        B[2 * q][g] = half(x.b0 & 0xffffu, bf), B[2 * q + 1][g] = half(x.b0 >> 16, bf);
        B[2 * q + 8][g] = half(x.b1 & 0xffffu, bf), B[2 * q + 9][g] = half(x.b1 >> 16, bf);
    }
    for (int i = 0; i < 16; ++i)
        for (int j = 0; j < 8; ++j)
            for (int kk = 0; kk < k; ++kk)
                C[i][j] += A[i][kk] * B[kk][j];
    for (int l = 0; l < 32; ++l)
    {
        int const g = l / 4, q = l % 4;
        float* c = static_cast<float*>(outs[l]);
        c[0] = C[g][2 * q], c[1] = C[g][2 * q + 1], c[2] = C[g + 8][2 * q], c[3] = C[g + 8][2 * q + 1];
    }
}

struct LdIn
{
    bool trans;
    uint16_t const* row;
};

// ldmatrix .x4: lane 8 m + i passes row i of matrix m; register m of lane 4 g + q gets row g,
// columns 2q, 2q + 1 of matrix m (low half first), or with .trans rows 2q, 2q + 1 of column g.
void ldmatrixWarp(void const* const* ins, void* const* outs)
{
    auto in = [&](int l) { return *static_cast<LdIn const*>(ins[l]); };
    for (int l = 0; l < 32; ++l)
    {
        int const g = l / 4, q = l % 4;
        uint32_t* r = static_cast<uint32_t*>(outs[l]);
        for (int m = 0; m < 4; ++m)
        {
            uint16_t lo, hi;
            if (in(l).trans)
                lo = in(8 * m + 2 * q).row[g], hi = in(8 * m + 2 * q + 1).row[g];
            else
                lo = in(8 * m + g).row[2 * q], hi = in(8 * m + g).row[2 * q + 1];
            r[m] = uint32_t(lo) | uint32_t(hi) << 16;
        }
    }
}
} // namespace

uint32_t sharedHandle(void const* p)
{
    uint32_t const h = g_next_handle++ % kHandles;
    g_shared[h] = p;
    return h;
}

void* sharedPointer(uint32_t handle) { return const_cast<void*>(g_shared[handle % kHandles]); }

void mma(char const* text, float* c, uint32_t const* a, uint32_t b0, uint32_t b1)
{
    MmaIn in{};
    if (starts(text, "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "))
        in.kind = Mma::kF16;
    else if (starts(text, "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "))
        in.kind = Mma::kBF16;
    else if (starts(text, "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "))
        in.kind = Mma::kTF32;
    else
        unknown(text);
    std::memcpy(in.c, c, sizeof in.c);
    std::memcpy(in.a, a, sizeof in.a);
    in.b0 = b0, in.b1 = b1;
    warpCollective(&in, c, mmaWarp);
}

void ldmatrix(char const* text, uint32_t* r, uint32_t handle)
{
    LdIn in{};
    if (starts(text, "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 "))
        in.trans = true;
    else if (!starts(text, "ldmatrix.sync.aligned.m8n8.x4.shared.b16 "))
        unknown(text);
    in.row = static_cast<uint16_t const*>(sharedPointer(handle));
    warpCollective(&in, r, ldmatrixWarp);
}

unsigned ballot(int pred)
{
    int const in = pred != 0;
    unsigned out = 0;
    warpCollective(&in, &out,
        [](void const* const* ins, void* const* outs)
        {
            unsigned bits = 0;
            for (int l = 0; l < 32; ++l)
                bits |= unsigned(*static_cast<int const*>(ins[l])) << l;
            for (int l = 0; l < 32; ++l)
                *static_cast<unsigned*>(outs[l]) = bits;
        });
    return out;
}

void launch(dim3 grid, dim3 blockDim_, size_t smem, cudaStream_t, std::function<void()> const& body)
{
    size_t const threads = size_t(blockDim_.x) * blockDim_.y * blockDim_.z;
    if (threads == 0 || threads > 1024 || grid.x == 0 || grid.y == 0 || grid.z == 0)
    {
        g_error = cudaErrorInvalidConfiguration;
        return;
    }
    Launch l;
    l.block.dim = blockDim_;
    l.block.grid = grid;
    l.body = &body;
    l.smem.resize(smem + 128);
    l.fibers.resize(threads);
    for (auto& f : l.fibers)
        f.stack.reset(new char[kStack]);
    Launch* outer = g_launch;
    g_launch = &l;
    for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
            for (unsigned x = 0; x < grid.x; ++x)
            {
                l.block.idx = dim3(x, y, z);
                std::memset(l.smem.data(), 0xff, l.smem.size()); // unwritten shared floats read as NaN
                for (size_t i = 0; i < threads; ++i)
                {
                    Fiber& f = l.fibers[i];
                    f.t.tid = dim3(unsigned(i % blockDim_.x), unsigned(i / blockDim_.x % blockDim_.y),
                        unsigned(i / (size_t(blockDim_.x) * blockDim_.y)));
                    f.state = State::kRun;
                    f.self = context::fiber(std::allocator_arg, Stack{f.stack.get()},
                        [&f, &l](context::fiber&& scheduler)
                        {
                            f.scheduler = std::move(scheduler);
                            (*l.body)();
                            f.state = State::kDone;
                            return std::move(f.scheduler);
                        });
                }
                for (;;)
                {
                    for (auto& f : l.fibers)
                        if (f.state == State::kRun)
                        {
                            l.current = &f;
                            f.self = std::move(f.self).resume();
                        }
                    std::string why;
                    if (!resolve(l, why))
                    {
                        std::fprintf(stderr, "emulator: %s\n", why.c_str());
                        g_error = cudaErrorLaunchFailure;
                        g_launch = outer;
                        return;
                    }
                    bool done = true;
                    for (auto const& f : l.fibers)
                        done &= f.state == State::kDone;
                    if (done)
                        break;
                }
            }
    g_launch = outer;
}

} // namespace emu

// The CUDA runtime calls the launchers and the plugin harness (tests/plugin_harness.cpp) make, on host memory.
extern "C"
{
    cudaError_t cudaGetLastError()
    {
        cudaError_t const e = emu::g_error;
        emu::g_error = cudaSuccess;
        return e;
    }
    cudaError_t cudaPeekAtLastError() { return emu::g_error; }
    cudaError_t cudaMalloc(void** p, size_t bytes)
    {
        *p = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
        return *p || bytes == 0 ? cudaSuccess : cudaErrorMemoryAllocation;
    }
    cudaError_t cudaFree(void* p)
    {
        std::free(p);
        return cudaSuccess;
    }
    cudaError_t cudaMemcpy(void* dst, void const* src, size_t count, cudaMemcpyKind)
    {
        std::memmove(dst, src, count);
        return cudaSuccess;
    }
    cudaError_t cudaStreamCreate(cudaStream_t* stream)
    {
        *stream = nullptr; // work runs when it is launched: one stream is all streams
        return cudaSuccess;
    }
    cudaError_t cudaStreamDestroy(cudaStream_t) { return cudaSuccess; }
    cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
    cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }
    cudaError_t cudaMemcpyAsync(void* dst, void const* src, size_t count, cudaMemcpyKind, cudaStream_t)
    {
        std::memmove(dst, src, count);
        return cudaSuccess;
    }
    cudaError_t cudaMemsetAsync(void* dst, int value, size_t count, cudaStream_t)
    {
        std::memset(dst, value, count);
        return cudaSuccess;
    }
    cudaError_t cudaGetDevice(int* device)
    {
        *device = 0;
        return cudaSuccess;
    }
    // The device stands for an H100's SM count and opt-in shared memory per block unless
    // EDGEMEM_EMULATE_SMS and EDGEMEM_EMULATE_SMEM (bytes) name others, so that a check can take the
    // launch forms a smaller device gets; a value that is not a positive integer ends the process.
    cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int)
    {
        auto setting = [](char const* name, int fallback)
        {
            char const* text = std::getenv(name);
            if (text == nullptr || *text == '\0')
                return fallback;
            char* end = nullptr;
            long const v = std::strtol(text, &end, 10);
            if (*end != '\0' || v <= 0 || v > (1L << 30))
            {
                std::fprintf(stderr, "emulator: %s is '%s'; expected a positive integer\n", name, text);
                std::exit(2);
            }
            return int(v);
        };
        switch (attr)
        {
        case cudaDevAttrComputeCapabilityMajor: *value = EMU_ARCH / 100; return cudaSuccess;
        case cudaDevAttrComputeCapabilityMinor: *value = EMU_ARCH / 10 % 10; return cudaSuccess;
        case cudaDevAttrMaxSharedMemoryPerBlockOptin:
            *value = setting("EDGEMEM_EMULATE_SMEM", 227 * 1024);
            return cudaSuccess;
        case cudaDevAttrMultiProcessorCount: *value = setting("EDGEMEM_EMULATE_SMS", 132); return cudaSuccess;
        default: return cudaErrorInvalidValue;
        }
    }
    cudaError_t cudaFuncSetAttribute(void const*, cudaFuncAttribute, int) { return cudaSuccess; }
    // One block of any kernel resident an SM: a launcher sizing its grid by the device then takes the
    // form with the fewest blocks a wave.
    cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* blocks, void const*, int, size_t)
    {
        *blocks = 1;
        return cudaSuccess;
    }
}
