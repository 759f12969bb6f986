// The reference library's own C functions; each op's are in its <op>/reference.cpp.
#include "core/reference.h"
#include "core/abi.h"

namespace
{
constexpr int kAbiVersion = 4;
} // namespace

EM_REF_API int em_ref_abi_version() { return kAbiVersion; }

EM_REF_API char const* em_ref_abi_layout()
{
    static std::string const text = []
    {
        edgemem::ref::Layout out;
#define EM_OP(Name, op) edgemem::ref::layout_##op(out);
#include "ops.def"
#undef EM_OP
        return out.text;
    }();
    return text.c_str();
}
