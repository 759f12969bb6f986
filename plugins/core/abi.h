// What the two C libraries export beside each op's functions (<op>/launch.h): their ABI version and
// the layout of every struct the C ABI takes, so a binding (python/edgemem_native.py) checks its
// mirror of the structs against the compiled ones.
#pragma once

#include "core/io.h"

EM_REF_API int em_ref_abi_version();
// Every struct of the C ABI, one line per struct and per field, for the ops of ops.def:
//   "<struct> <sizeof>\n" then "<struct>.<field> <offsetof>\n" per field, in declaration order.
EM_REF_API char const* em_ref_abi_layout();

EM_CUDA_API int em_cuda_abi_version();
// Peak DRAM bandwidth of a device in GB/s from its memory clock and bus width (0 on error).
EM_CUDA_API double em_cuda_peak_bandwidth_gbs(int device);
