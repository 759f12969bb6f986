// What every op's C ABI shares: the I/O element types, the export macros and the stream type.
// Each op's tensors (its <Op>IO struct: pointers in the order of the ONNX node's inputs and
// outputs) are declared in <op>/launch.h. Plain pointers: the CPU reference takes host memory,
// the CUDA launchers device memory; the launchers take the dtypes separately.
#pragma once

#include <cstddef>
#include <cstdint>

// cudaStream_t as CUDA declares it, so the headers need no CUDA installation (CPU reference).
typedef struct CUstream_st* cudaStream_t;

#if defined(_WIN32)
#define EM_CUDA_API extern "C" __declspec(dllexport)
#define EM_REF_API extern "C" __declspec(dllexport)
#else
#define EM_CUDA_API extern "C" __attribute__((visibility("default")))
#define EM_REF_API extern "C" __attribute__((visibility("default")))
#endif

namespace edgemem
{

enum DType : int32_t
{
    kFloat32 = 0,
    kFloat16 = 1,
    kBFloat16 = 2,
};

} // namespace edgemem
