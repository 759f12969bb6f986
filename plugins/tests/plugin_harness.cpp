// Drives every edgemem plugin through the calls TensorRT makes, without TensorRT's library: only its
// headers, and the few interfaces TensorRT would hand in implemented here (an IExprBuilder over
// symbolic dimensions, an ILoggerFinder, an IPluginResourceContext).
//
//   plugin_harness            build and runtime calls, on the CPU: getCreators, the creator's
//                             fields, createPlugin from a PluginFieldCollection, capabilities,
//                             getOutputDataTypes, getOutputShapes, supportsFormatCombination,
//                             configurePlugin, getWorkspaceSize, metadata, clone,
//                             getFieldsToSerialize -> createPlugin (deserialize), onShapeChange,
//                             attachToContext, and the refusals (a bad field, a wrong shape)
//   plugin_harness --enqueue  the same, then enqueue on the GPU, compared with the op's kernel
//                             called through its C ABI (em_cuda_<op>) and with the CPU reference
//                             (em_ref_<op>) on the same inputs
//
// Prints one line per failed check and a summary line `harness: {"plugins": N, "calls": N, ...}`;
// exits 1 if a check failed. One case per op of ops.def (a new op adds its case below).
#include <NvInferRuntime.h>

#include "banded_attention/launch.h"
#include "linear_attention/launch.h"
#include "neural_memory/launch.h"
#include "window_attention/launch.h"

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

using namespace nvinfer1;

extern "C" IPluginCreatorInterface* const* getCreators(int32_t& nbCreators);
extern "C" void setLoggerFinder(ILoggerFinder* finder);

namespace
{

// ---------------------------------------------------------------------------------------------
// What TensorRT hands a plugin

// A dimension expression: a constant, or a symbol / an operation on symbols kept as text.
struct ExprImpl : apiv::VDimensionExpr
{
    std::string text;
    int64_t value = 0;
    bool constant = false;
    bool isConstant() const override { return constant; }
    int64_t getConstantValue() const override { return constant ? value : std::numeric_limits<int64_t>::min(); }
    bool isSizeTensor() const override { return false; }
};

struct Expr : IDimensionExpr
{
    ExprImpl impl;
    Expr() { mImpl = &impl; }
    ExprImpl const& get() const { return impl; }
};

ExprImpl const& implOf(IDimensionExpr const& e) { return static_cast<Expr const&>(e).get(); }

struct BuilderImpl : apiv::VExprBuilder
{
    std::deque<std::unique_ptr<Expr>> exprs;
    Expr* make(std::string text, int64_t value, bool constant)
    {
        exprs.emplace_back(new Expr);
        Expr* e = exprs.back().get();
        e->impl.text = std::move(text);
        e->impl.value = value;
        e->impl.constant = constant;
        return e;
    }
    IDimensionExpr const* constant(int64_t value) override { return make(std::to_string(value), value, true); }
    IDimensionExpr const* symbol(std::string const& name) { return make(name, 0, false); }
    IDimensionExpr const* operation(
        DimensionOperation op, IDimensionExpr const& first, IDimensionExpr const& second) override
    {
        ExprImpl const& a = implOf(first);
        ExprImpl const& b = implOf(second);
        static char const* const names[] = {"+", "*", "max", "min", "-", "==", "<", "/", "ceil/"};
        int const k = int(op);
        if (a.constant && b.constant)
        {
            int64_t const x = a.value, y = b.value;
            int64_t r = 0;
            switch (op)
            {
            case DimensionOperation::kSUM: r = x + y; break;
            case DimensionOperation::kPROD: r = x * y; break;
            case DimensionOperation::kMAX: r = std::max(x, y); break;
            case DimensionOperation::kMIN: r = std::min(x, y); break;
            case DimensionOperation::kSUB: r = x - y; break;
            case DimensionOperation::kEQUAL: r = x == y; break;
            case DimensionOperation::kLESS: r = x < y; break;
            case DimensionOperation::kFLOOR_DIV: r = y ? (x >= 0 ? x / y : -((-x + y - 1) / y)) : 0; break;
            case DimensionOperation::kCEIL_DIV: r = y ? (x + y - 1) / y : 0; break;
            }
            return constant(r);
        }
        return make("(" + a.text + " " + (k >= 0 && k < 9 ? names[k] : "?") + " " + b.text + ")", 0, false);
    }
    IDimensionExpr const* declareSizeTensor(int32_t, IDimensionExpr const&, IDimensionExpr const&) override
    {
        return nullptr;
    }
};

struct Builder : IExprBuilder
{
    BuilderImpl impl;
    Builder() { mImpl = &impl; }
};

struct Logger : ILogger
{
    std::vector<std::string> errors;
    void log(Severity severity, char const* msg) noexcept override
    {
        if (severity <= Severity::kERROR)
            errors.emplace_back(msg);
    }
};

struct Finder : ILoggerFinder
{
    Logger logger;
    ILogger* findLogger() override { return &logger; }
};

struct Resources : IPluginResourceContext
{
    IGpuAllocator* getGpuAllocator() const noexcept override { return nullptr; }
    IErrorRecorder* getErrorRecorder() const noexcept override { return nullptr; }
};

// ---------------------------------------------------------------------------------------------
// The cases: one per op

struct Field
{
    std::string name;
    PluginFieldType type;
    std::vector<int32_t> ints;
    float real = 0.0f;
    std::string text;
};

Field ints(char const* n, std::vector<int32_t> v) { return {n, PluginFieldType::kINT32, std::move(v), 0.0f, {}}; }
Field real(char const* n, float v) { return {n, PluginFieldType::kFLOAT32, {}, v, {}}; }
Field text(char const* n, char const* v) { return {n, PluginFieldType::kCHAR, {}, 0.0f, v}; }

struct Tensor
{
    std::vector<std::string> dims; // "B", "T" symbolic at build time; numbers otherwise
    DataType type;
    bool io = false; // an activation: float16 when the plugin runs in float16
};

constexpr int64_t kB = 2; // the concrete batch and sequence of the runtime calls
constexpr int64_t kT = 3;

Dims concrete(std::vector<std::string> const& dims, int64_t t = kT)
{
    Dims d{};
    d.nbDims = int32_t(dims.size());
    for (size_t i = 0; i < dims.size(); ++i)
        d.d[i] = dims[i] == "B" ? kB : dims[i] == "T" ? t : std::stoll(dims[i]);
    return d;
}

std::string show(DimsExprs const& d)
{
    std::string s = "[";
    for (int32_t i = 0; i < d.nbDims; ++i)
        s += (i ? ", " : "") + (d.d[i] ? implOf(*d.d[i]).text : std::string("null"));
    return s + "]";
}

// Runs the op's kernel (gpu) or CPU reference on device / host buffers in node order.
using Direct = std::function<int(bool gpu, void* const* inputs, void* const* outputs)>;

struct Case
{
    char const* op;
    std::vector<Field> fields;
    std::string metadata; // getMetadataString after parsing the fields
    std::vector<Tensor> inputs;
    std::vector<Tensor> outputs; // expected types (float32 activations) and shapes
    char const* required;        // a required field: without it createPlugin refuses
    int wrongInput;              // an input whose runtime shape onShapeChange must refuse
    size_t workspaceLong;        // getWorkspaceSize for a profile up to 4096 tokens (1 token: 0)
    Direct direct;
};

std::vector<Case> cases()
{
    using DT = DataType;
    std::vector<Case> out;
    // LinearAttention: 4 query heads over 2 kv heads (GQA), d_k 8, d_v 6, gated delta rule.
    out.push_back({"LinearAttention",
        {text("update_rule", "gated_delta"), real("scale", 0.5f), ints("q_num_heads", {4}), ints("kv_num_heads", {2}),
            ints("chunk_size", {64})},
        "update_rule=gated_delta;scale=0.5;q_num_heads=4;kv_num_heads=2;chunk_size=64",
        {{{"B", "T", "32"}, DT::kFLOAT, true}, {{"B", "T", "16"}, DT::kFLOAT, true},
            {{"B", "T", "12"}, DT::kFLOAT, true}, {{"B", "2", "8", "6"}, DT::kFLOAT},
            {{"B", "T", "2"}, DT::kFLOAT, true}, {{"B", "T", "2"}, DT::kFLOAT, true}},
        {{{"B", "T", "24"}, DT::kFLOAT, true}, {{"B", "2", "8", "6"}, DT::kFLOAT}}, "kv_num_heads", 3,
        size_t(edgemem::la::kChunkBudget), [](bool gpu, void* const* in, void* const* out)
        {
            edgemem::la::Params p{int32_t(kB), int32_t(kT), 4, 2, 8, 6, edgemem::la::kGatedDelta, 0.5f, 0, 1};
            edgemem::LinearAttentionIO io{in[0], in[1], in[2], static_cast<float const*>(in[3]), in[4], in[5], out[0],
                static_cast<float*>(out[1])};
            return gpu ? em_cuda_linear_attention(&p, &io, 0, 0, nullptr, 0, nullptr)
                       : em_ref_linear_attention(&p, &io);
        }});
    // NeuralMemory: 2 heads, D 4, hidden 8, depth 2, chunks of 2, residual LayerNorm, GELU.
    std::vector<Tensor> nmIn = {{{"B", "T", "8"}, DT::kFLOAT, true}, {{"B", "T", "8"}, DT::kFLOAT, true},
        {{"B", "T", "8"}, DT::kFLOAT, true}, {{"B", "T", "2"}, DT::kFLOAT, true}, {{"B", "T", "2"}, DT::kFLOAT, true},
        {{"B", "T", "2"}, DT::kFLOAT, true}, {{"B"}, DT::kINT64}, {{"2", "4"}, DT::kFLOAT}, {{"2", "4"}, DT::kFLOAT}};
    for (int i = 0; i < 3; ++i)
        nmIn.push_back({{"B", "2", "4", "8"}, DT::kFLOAT});
    for (int i = 0; i < 3; ++i)
        nmIn.push_back({{"B", "2", "8", "4"}, DT::kFLOAT});
    std::vector<Tensor> nmOut = {{{"B", "T", "8"}, DT::kFLOAT, true}, {{"B"}, DT::kINT64}};
    for (int i = 9; i < 15; ++i)
        nmOut.push_back(nmIn[i]);
    out.push_back({"NeuralMemory",
        {ints("num_heads", {2}), ints("chunk_size", {2}), ints("depth", {2}), ints("residual_norm", {1}),
            text("activation", "gelu")},
        "num_heads=2;chunk_size=2;depth=2;residual_norm=1;activation=gelu", nmIn, nmOut, "depth", 9, 0,
        [](bool gpu, void* const* in, void* const* out)
        {
            edgemem::nm::Params p{int32_t(kB), int32_t(kT), 2, 4, 8, 2, 2, edgemem::nm::kGelu, 1, 1};
            auto f = [&](int i) { return static_cast<float const*>(in[i]); };
            auto g = [&](int i) { return static_cast<float*>(out[i]); };
            edgemem::NeuralMemoryIO io{in[0], in[1], in[2], in[3], in[4], in[5], static_cast<int64_t const*>(in[6]),
                f(7), f(8), {f(9), f(12)}, {f(10), f(13)}, {f(11), f(14)}, out[0], static_cast<int64_t*>(out[1]),
                {g(2), g(5)}, {g(3), g(6)}, {g(4), g(7)}};
            return gpu ? em_cuda_neural_memory(&p, &io, 0, 0, 0, nullptr) : em_ref_neural_memory(&p, &io);
        }});
    // BandedAttention: 2 heads, D 4, D_v 3, window 1, dilation 1 and 2, global tokens, 1 persistent token.
    out.push_back({"BandedAttention",
        {ints("num_heads", {2}), ints("window", {1}), ints("dilation", {1, 2}), ints("causal", {0}),
            real("scale", 0.5f)},
        "num_heads=2;window=1;dilation=1,2;causal=0;scale=0.5",
        {{{"B", "T", "8"}, DT::kFLOAT, true}, {{"B", "T", "8"}, DT::kFLOAT, true}, {{"B", "T", "6"}, DT::kFLOAT, true},
            {{"B", "T"}, DT::kBOOL}, {{"B", "2", "1", "4"}, DT::kFLOAT}, {{"B", "2", "1", "3"}, DT::kFLOAT}},
        {{{"B", "T", "6"}, DT::kFLOAT, true}}, "window", 3, 0, [](bool gpu, void* const* in, void* const* out)
        {
            edgemem::attn::BandedParams p{int32_t(kB), int32_t(kT), 2, 4, 3, 1, 0, 1, 0.5f};
            int32_t const dilation[] = {1, 2};
            edgemem::BandedAttentionIO io{in[0], in[1], in[2], static_cast<bool const*>(in[3]), in[4], in[5], out[0]};
            return gpu ? em_cuda_banded_attention(&p, dilation, &io, 0, 0, 0, nullptr)
                       : em_ref_banded_attention(&p, dilation, &io);
        }});
    // WindowAttention: 2 heads, D 4, D_v 3, window 2, dilation 1 and 2 (a ring of 4), 1 persistent token.
    out.push_back({"WindowAttention",
        {ints("num_heads", {2}), ints("window", {2}), ints("dilation", {1, 2}), real("scale", 0.25f)},
        "num_heads=2;window=2;dilation=1,2;scale=0.25",
        {{{"B", "T", "8"}, DT::kFLOAT, true}, {{"B", "T", "8"}, DT::kFLOAT, true}, {{"B", "T", "6"}, DT::kFLOAT, true},
            {{"B", "2", "4", "4"}, DT::kFLOAT}, {{"B", "2", "4", "3"}, DT::kFLOAT}, {{"B"}, DT::kINT64},
            {{"B", "2", "1", "4"}, DT::kFLOAT}, {{"B", "2", "1", "3"}, DT::kFLOAT}},
        {{{"B", "T", "6"}, DT::kFLOAT, true}, {{"B", "2", "4", "4"}, DT::kFLOAT}, {{"B", "2", "4", "3"}, DT::kFLOAT}},
        "num_heads", 3, 0, [](bool gpu, void* const* in, void* const* out)
        {
            edgemem::attn::WindowParams p{int32_t(kB), int32_t(kT), 2, 4, 3, 2, 4, 1, 0.25f};
            int32_t const dilation[] = {1, 2};
            edgemem::WindowAttentionIO io{in[0], in[1], in[2], in[3], in[4], static_cast<int64_t const*>(in[5]), in[6],
                in[7], out[0], out[1], out[2]};
            return gpu ? em_cuda_window_attention(&p, dilation, &io, 0, 0, 0, nullptr, 0, nullptr)
                       : em_ref_window_attention(&p, dilation, &io);
        }});
    return out;
}

// ---------------------------------------------------------------------------------------------
// The run

struct Run
{
    Finder finder;
    std::map<std::string, int> calls; // TensorRT entry point -> times called
    int checks = 0;
    int failed = 0;
    std::string op;

    void call(char const* name) { ++calls[name]; }
    bool check(bool ok, std::string const& what)
    {
        ++checks;
        if (!ok)
        {
            ++failed;
            std::printf("FAIL %s: %s\n", op.c_str(), what.c_str());
        }
        return ok;
    }
    // The next logged error contains `needle` (and is consumed).
    bool logged(std::string const& needle, std::string const& what)
    {
        auto& errors = finder.logger.errors;
        bool found = false;
        for (auto const& e : errors)
            found = found || e.find(needle) != std::string::npos;
        std::string const seen = errors.empty() ? "nothing" : errors.back();
        errors.clear();
        return check(found, what + " (logged: " + seen + ")");
    }
};

struct Collection
{
    std::vector<PluginField> fields;
    PluginFieldCollection fc{};
    explicit Collection(std::vector<Field> const& in, char const* skip = nullptr)
    {
        for (Field const& f : in)
        {
            if (skip && f.name == skip)
                continue;
            void const* data = f.type == PluginFieldType::kINT32 ? static_cast<void const*>(f.ints.data())
                : f.type == PluginFieldType::kFLOAT32            ? static_cast<void const*>(&f.real)
                                                                 : static_cast<void const*>(f.text.c_str());
            int32_t const length = f.type == PluginFieldType::kINT32 ? int32_t(f.ints.size())
                : f.type == PluginFieldType::kFLOAT32                ? 1
                                                                     : int32_t(f.text.size());
            fields.emplace_back(f.name.c_str(), data, f.type, length);
        }
        fc.nbFields = int32_t(fields.size());
        fc.fields = fields.data();
    }
};

// A PluginFieldCollection as comparable text (what getFieldsToSerialize wrote).
std::string fieldsText(PluginFieldCollection const* fc)
{
    if (!fc)
        return "null";
    std::string s;
    for (int32_t i = 0; i < fc->nbFields; ++i)
    {
        PluginField const& f = fc->fields[i];
        s += std::string(f.name) + ":" + std::to_string(int(f.type)) + "=";
        if (f.type == PluginFieldType::kINT32)
            for (int32_t j = 0; j < f.length; ++j)
                s += std::to_string(static_cast<int32_t const*>(f.data)[j]) + ",";
        else if (f.type == PluginFieldType::kFLOAT32)
            s += std::to_string(*static_cast<float const*>(f.data));
        else if (f.type == PluginFieldType::kCHAR)
            s += std::string(static_cast<char const*>(f.data), f.length);
        s += ";";
    }
    return s;
}

struct Capabilities
{
    IPluginV3OneCore* core;
    IPluginV3OneBuildV2* build;
    IPluginV3OneRuntime* runtime;
};

Capabilities capabilities(Run& r, IPluginV3* p)
{
    r.call("getCapabilityInterface");
    r.call("getCapabilityInterface");
    r.call("getCapabilityInterface");
    return {static_cast<IPluginV3OneCore*>(p->getCapabilityInterface(PluginCapabilityType::kCORE)),
        static_cast<IPluginV3OneBuildV2*>(p->getCapabilityInterface(PluginCapabilityType::kBUILD)),
        static_cast<IPluginV3OneRuntime*>(p->getCapabilityInterface(PluginCapabilityType::kRUNTIME))};
}

// The activation types the plugins take; an activation tensor gets `io`, every other its own type.
DataType const kIoTypes[] = {DataType::kFLOAT, DataType::kHALF, DataType::kBF16};
char const* typeName(DataType t)
{
    return t == DataType::kHALF ? "float16" : t == DataType::kBF16 ? "bfloat16" : "float32";
}
DataType asIo(Tensor const& t, DataType io) { return t.io ? io : t.type; }

std::vector<DynamicPluginTensorDesc> dynamicDescs(std::vector<Tensor> const& ts, DataType io, int64_t maxT)
{
    std::vector<DynamicPluginTensorDesc> out;
    for (Tensor const& t : ts)
    {
        DynamicPluginTensorDesc d{};
        d.desc.type = asIo(t, io);
        d.desc.format = TensorFormat::kLINEAR;
        d.desc.dims = concrete(t.dims);
        for (int32_t i = 0; i < d.desc.dims.nbDims; ++i)
            if (t.dims[i] == "B" || t.dims[i] == "T")
                d.desc.dims.d[i] = -1;
        d.min = concrete(t.dims, 1);
        d.opt = concrete(t.dims);
        d.max = concrete(t.dims, maxT);
        for (int32_t i = 0; i < d.min.nbDims; ++i)
            if (t.dims[i] == "B")
                d.min.d[i] = 1;
        out.push_back(d);
    }
    return out;
}

std::vector<PluginTensorDesc> runtimeDescs(std::vector<Tensor> const& ts)
{
    std::vector<PluginTensorDesc> out;
    for (Tensor const& t : ts)
    {
        PluginTensorDesc d{};
        d.dims = concrete(t.dims);
        d.type = t.type;
        d.format = TensorFormat::kLINEAR;
        d.scale = 1.0f;
        out.push_back(d);
    }
    return out;
}

size_t bytesOf(DataType t)
{
    return t == DataType::kINT64 ? 8 : t == DataType::kBOOL ? 1 : t == DataType::kHALF || t == DataType::kBF16 ? 2 : 4;
}
size_t count(Dims const& d)
{
    size_t n = 1;
    for (int32_t i = 0; i < d.nbDims; ++i)
        n *= size_t(d.d[i]);
    return n;
}

// Host inputs in node order: random floats (decay-like inputs negative, gates in (0, 1)), positions, a mask.
std::vector<std::vector<char>> hostInputs(Case const& c, std::mt19937& rng)
{
    std::uniform_real_distribution<float> u(-0.5f, 0.5f);
    std::vector<std::vector<char>> out;
    for (Tensor const& t : c.inputs)
    {
        Dims const d = concrete(t.dims);
        std::vector<char> buf(count(d) * bytesOf(t.type));
        if (t.type == DataType::kFLOAT)
        {
            float* f = reinterpret_cast<float*>(buf.data());
            for (size_t i = 0; i < count(d); ++i)
                f[i] = u(rng);
        }
        else if (t.type == DataType::kINT64)
        {
            int64_t* p = reinterpret_cast<int64_t*>(buf.data());
            for (size_t i = 0; i < count(d); ++i)
                p[i] = int64_t(5 * i); // position 0 and 5: an empty and a wrapped ring
        }
        else if (t.type == DataType::kBOOL)
        {
            for (size_t i = 0; i < count(d); ++i)
                buf[i] = i % 3 == 0;
        }
        out.push_back(std::move(buf));
    }
    // gates: LinearAttention decay (log-space, < 0) and beta in (0, 1); NeuralMemory theta, eta, alpha in (0, 1)
    auto positive = [&](int i, float scale)
    {
        float* f = reinterpret_cast<float*>(out[i].data());
        for (size_t j = 0; j < out[i].size() / 4; ++j)
            f[j] = scale * (0.5f + f[j]);
    };
    if (std::string(c.op) == "LinearAttention")
    {
        positive(4, -0.2f);
        positive(5, 1.0f);
    }
    if (std::string(c.op) == "NeuralMemory")
    {
        positive(3, 0.1f);
        positive(4, 0.9f);
        positive(5, 0.05f);
    }
    return out;
}

double maxRelDiff(std::vector<char> const& a, std::vector<char> const& b, DataType t)
{
    if (t == DataType::kINT64)
        return std::memcmp(a.data(), b.data(), a.size()) == 0 ? 0.0 : 1.0;
    float const* x = reinterpret_cast<float const*>(a.data());
    float const* y = reinterpret_cast<float const*>(b.data());
    double diff = 0.0, scale = 1.0;
    for (size_t i = 0; i < a.size() / 4; ++i)
    {
        diff = std::max(diff, std::fabs(double(x[i]) - double(y[i])));
        scale = std::max(scale, std::fabs(double(y[i])));
        if (std::isnan(x[i]) != std::isnan(y[i]))
            return INFINITY;
    }
    return diff / scale;
}

// enqueue on the GPU vs the kernel through its C ABI (same inputs) and the CPU reference.
void enqueueCheck(Run& r, Case const& c, IPluginV3OneRuntime* rt, std::mt19937& rng)
{
    auto const host = hostInputs(c, rng);
    auto const inDesc = runtimeDescs(c.inputs);
    auto const outDesc = runtimeDescs(c.outputs);
    std::vector<void*> dIn, dOutPlugin, dOutKernel;
    auto alloc = [&](size_t n)
    {
        void* p = nullptr;
        r.check(cudaMalloc(&p, std::max<size_t>(n, 1)) == cudaSuccess, "cudaMalloc");
        return p;
    };
    for (size_t i = 0; i < host.size(); ++i)
    {
        dIn.push_back(alloc(host[i].size()));
        cudaMemcpy(dIn.back(), host[i].data(), host[i].size(), cudaMemcpyHostToDevice);
    }
    std::vector<size_t> outBytes;
    for (auto const& d : outDesc)
    {
        outBytes.push_back(count(d.dims) * bytesOf(d.type));
        dOutPlugin.push_back(alloc(outBytes.back()));
        dOutKernel.push_back(alloc(outBytes.back()));
    }
    cudaStream_t stream = nullptr;
    cudaStreamCreate(&stream);
    r.call("onShapeChange");
    r.check(rt->onShapeChange(inDesc.data(), int32_t(inDesc.size()), outDesc.data(), int32_t(outDesc.size())) == 0,
        "onShapeChange before enqueue");
    size_t const wsBytes = c.workspaceLong ? size_t(edgemem::la::kChunkBudget) : 0;
    void* ws = wsBytes ? alloc(wsBytes) : nullptr;
    std::vector<void const*> inPtrs(dIn.begin(), dIn.end());
    r.call("enqueue");
    int const st = rt->enqueue(inDesc.data(), outDesc.data(), inPtrs.data(), dOutPlugin.data(), ws, stream);
    r.check(st == 0 && cudaStreamSynchronize(stream) == cudaSuccess, "enqueue returned " + std::to_string(st));
    r.check(c.direct(true, dIn.data(), dOutKernel.data()) == 0 && cudaDeviceSynchronize() == cudaSuccess,
        "the kernel through em_cuda_" + std::string(c.op));
    // the CPU reference on host copies
    std::vector<std::vector<char>> hIn = host, hOut;
    std::vector<void*> hInPtrs, hOutPtrs;
    for (auto& b : hIn)
        hInPtrs.push_back(b.data());
    for (size_t n : outBytes)
        hOut.emplace_back(n);
    for (auto& b : hOut)
        hOutPtrs.push_back(b.data());
    r.check(c.direct(false, hInPtrs.data(), hOutPtrs.data()) == 0, "the CPU reference");
    for (size_t i = 0; i < outDesc.size(); ++i)
    {
        std::vector<char> plugin(outBytes[i]), kernel(outBytes[i]);
        cudaMemcpy(plugin.data(), dOutPlugin[i], outBytes[i], cudaMemcpyDeviceToHost);
        cudaMemcpy(kernel.data(), dOutKernel[i], outBytes[i], cudaMemcpyDeviceToHost);
        double const dk = maxRelDiff(plugin, kernel, outDesc[i].type);
        double const dr = maxRelDiff(plugin, hOut[i], outDesc[i].type);
        std::printf("enqueue %s output %zu: vs kernel %.3g, vs CPU reference %.3g\n", c.op, i, dk, dr);
        r.check(dk == 0.0, "enqueue output " + std::to_string(i) + " differs from the kernel's: " + std::to_string(dk));
        r.check(dr <= 5e-5, "enqueue output " + std::to_string(i) + " vs the CPU reference: " + std::to_string(dr));
    }
    for (void* p : dIn)
        cudaFree(p);
    for (void* p : dOutPlugin)
        cudaFree(p);
    for (void* p : dOutKernel)
        cudaFree(p);
    cudaFree(ws);
    cudaStreamDestroy(stream);
}

void drive(Run& r, IPluginCreatorV3One* creator, Case const& c, bool enqueue, std::mt19937& rng)
{
    r.op = c.op;
    int32_t const nIn = int32_t(c.inputs.size());
    int32_t const nOut = int32_t(c.outputs.size());

    // the creator: identity and the fields the ONNX parser maps attributes onto
    r.call("getPluginVersion");
    r.call("getPluginNamespace");
    r.check(std::string(creator->getPluginVersion()) == "1" && std::string(creator->getPluginNamespace()) == "edgemem",
        "creator version 1, namespace edgemem");
    r.call("getFieldNames");
    PluginFieldCollection const* names = creator->getFieldNames();
    std::set<std::string> advertised;
    for (int32_t i = 0; names && i < names->nbFields; ++i)
        advertised.insert(names->fields[i].name);
    for (Field const& f : c.fields)
        r.check(advertised.count(f.name) == 1, "field " + f.name + " advertised by getFieldNames");

    // a required field missing: refused and logged
    Collection const missing(c.fields, c.required);
    r.call("createPlugin");
    IPluginV3* none = creator->createPlugin("harness", &missing.fc, TensorRTPhase::kBUILD);
    r.check(none == nullptr, "createPlugin without " + std::string(c.required) + " refused");
    delete none;
    r.logged(std::string("missing required field '") + c.required + "'", "the missing field is named");

    Collection const fields(c.fields);
    r.call("createPlugin");
    std::unique_ptr<IPluginV3> plugin(creator->createPlugin("harness", &fields.fc, TensorRTPhase::kBUILD));
    if (!r.check(plugin != nullptr, "createPlugin (BUILD)"))
        return;
    Capabilities const cap = capabilities(r, plugin.get());
    if (!r.check(cap.core && cap.build && cap.runtime, "core, build and runtime capabilities"))
        return;
    r.call("getPluginName");
    r.call("getPluginVersion");
    r.call("getPluginNamespace");
    r.check(std::string(cap.core->getPluginName()) == c.op && std::string(cap.core->getPluginVersion()) == "1"
            && std::string(cap.core->getPluginNamespace()) == "edgemem",
        "plugin name, version, namespace");
    r.call("getNbOutputs");
    r.check(cap.build->getNbOutputs() == nOut, "getNbOutputs");
    r.call("getMetadataString");
    std::string const meta = cap.build->getMetadataString() ? cap.build->getMetadataString() : "";
    r.check(meta == c.metadata, "getMetadataString: " + meta);
    r.call("getTimingCacheID");
    r.check(cap.build->getTimingCacheID() && meta == cap.build->getTimingCacheID(), "getTimingCacheID");
    r.call("getAliasedInput");
    r.check(cap.build->getAliasedInput(0) == -1, "no declared I/O aliasing");

    // output types, for float32, float16 and bfloat16 activations
    for (DataType io : kIoTypes)
    {
        std::vector<DataType> in, out(nOut);
        for (Tensor const& t : c.inputs)
            in.push_back(asIo(t, io));
        r.call("getOutputDataTypes");
        int32_t const st = cap.build->getOutputDataTypes(out.data(), nOut, in.data(), nIn);
        bool ok = st == 0;
        for (int32_t i = 0; i < nOut; ++i)
            ok = ok && out[i] == asIo(c.outputs[i], io);
        r.check(ok, std::string("getOutputDataTypes, ") + typeName(io) + " activations");
    }
    r.call("getOutputDataTypes");
    {
        std::vector<DataType> in(nIn, DataType::kFLOAT), out(nOut);
        r.check(cap.build->getOutputDataTypes(out.data(), nOut, in.data(), nIn - 1) != 0,
            "getOutputDataTypes, one input short");
    }

    // output shapes over symbolic batch and sequence
    {
        Builder eb;
        std::vector<DimsExprs> in(nIn), out(nOut);
        for (int32_t i = 0; i < nIn; ++i)
        {
            in[i].nbDims = int32_t(c.inputs[i].dims.size());
            for (int32_t j = 0; j < in[i].nbDims; ++j)
            {
                std::string const& s = c.inputs[i].dims[j];
                in[i].d[j] = s == "B" || s == "T" ? eb.impl.symbol(s) : eb.constant(std::stoll(s));
            }
        }
        r.call("getOutputShapes");
        int32_t const st = cap.build->getOutputShapes(in.data(), nIn, nullptr, 0, out.data(), nOut, eb);
        r.check(st == 0, "getOutputShapes");
        for (int32_t i = 0; st == 0 && i < nOut; ++i)
        {
            DimsExprs want{};
            want.nbDims = int32_t(c.outputs[i].dims.size());
            std::string w = "[";
            for (int32_t j = 0; j < want.nbDims; ++j)
                w += (j ? ", " : "") + c.outputs[i].dims[j];
            w += "]";
            r.check(show(out[i]) == w, "output " + std::to_string(i) + " shape " + show(out[i]) + ", expected " + w);
        }
    }

    // formats: the float32, float16 and bfloat16 combinations, linear only; state dtypes fixed
    for (DataType io : kIoTypes)
    {
        std::vector<Tensor> all(c.inputs);
        all.insert(all.end(), c.outputs.begin(), c.outputs.end());
        auto descs = dynamicDescs(all, io, kT);
        for (int32_t pos = 0; pos < nIn + nOut; ++pos)
        {
            r.call("supportsFormatCombination");
            r.check(cap.build->supportsFormatCombination(pos, descs.data(), nIn, nOut),
                "supportsFormatCombination accepts position " + std::to_string(pos) + " (" + typeName(io) + ")");
        }
        descs[0].desc.format = TensorFormat::kCHW32;
        r.call("supportsFormatCombination");
        r.check(!cap.build->supportsFormatCombination(0, descs.data(), nIn, nOut), "a vectorized format refused");
        descs[0].desc.format = TensorFormat::kLINEAR;
        descs[0].desc.type = DataType::kINT8;
        r.call("supportsFormatCombination");
        r.check(!cap.build->supportsFormatCombination(0, descs.data(), nIn, nOut), "INT8 activations refused");
    }
    {
        std::vector<Tensor> all(c.inputs);
        all.insert(all.end(), c.outputs.begin(), c.outputs.end());
        auto descs = dynamicDescs(all, DataType::kFLOAT, kT);
        int32_t pos = -1; // a state-like tensor (a float32 input that is no activation) stays float32
        for (int32_t i = 0; i < nIn && pos < 0; ++i)
            if (!c.inputs[i].io && c.inputs[i].type == DataType::kFLOAT)
                pos = i;
        std::string const name = c.op;
        if (pos >= 0 && name != "WindowAttention" && name != "BandedAttention")
        {
            descs[pos].desc.type = DataType::kHALF;
            r.call("supportsFormatCombination");
            r.check(!cap.build->supportsFormatCombination(pos, descs.data(), nIn, nOut), "float16 state refused");
        }
        else if (pos >= 0) // a ring or persistent K/V: float32 or the activations' 16-bit type
            for (DataType io : kIoTypes)
                for (DataType state : kIoTypes)
                {
                    auto d = dynamicDescs(all, io, kT);
                    d[pos].desc.type = state;
                    bool const want = state == DataType::kFLOAT
                        || state == (io == DataType::kBF16 ? DataType::kBF16 : DataType::kHALF);
                    r.call("supportsFormatCombination");
                    r.check(cap.build->supportsFormatCombination(pos, d.data(), nIn, nOut) == want,
                        std::string(want ? "accepts " : "refuses ") + "a " + typeName(state) + " state beside "
                            + typeName(io) + " activations");
                }
    }

    // configure and workspace for a profile up to 4096 tokens, and one of single tokens
    for (int64_t maxT : {int64_t(4096), int64_t(1)})
    {
        auto in = dynamicDescs(c.inputs, DataType::kFLOAT, maxT);
        auto out = dynamicDescs(c.outputs, DataType::kFLOAT, maxT);
        r.call("configurePlugin");
        r.check(cap.build->configurePlugin(in.data(), nIn, out.data(), nOut) == 0, "configurePlugin");
        r.call("getWorkspaceSize");
        size_t const ws = cap.build->getWorkspaceSize(in.data(), nIn, out.data(), nOut);
        size_t const want = maxT > 1 ? c.workspaceLong : 0;
        r.check(ws == want,
            "getWorkspaceSize up to " + std::to_string(maxT) + " tokens: " + std::to_string(ws) + ", expected "
                + std::to_string(want));
    }
    {
        auto in = dynamicDescs(c.inputs, DataType::kFLOAT, kT);
        auto out = dynamicDescs(c.outputs, DataType::kFLOAT, kT);
        r.call("configurePlugin");
        r.check(
            cap.build->configurePlugin(in.data(), nIn - 1, out.data(), nOut) != 0, "configurePlugin, one input short");
        r.logged("expected " + std::to_string(nIn) + " inputs", "the input count is named");
    }

    // serialize: the fields, and a plugin created from them in the runtime phase
    r.call("getFieldsToSerialize");
    std::string const serialized = fieldsText(cap.runtime->getFieldsToSerialize());
    r.call("getFieldsToSerialize");
    PluginFieldCollection const* again = cap.runtime->getFieldsToSerialize();
    r.call("createPlugin");
    std::unique_ptr<IPluginV3> restored(creator->createPlugin("harness", again, TensorRTPhase::kRUNTIME));
    if (r.check(restored != nullptr, "createPlugin (RUNTIME) from getFieldsToSerialize"))
    {
        Capabilities const rc = capabilities(r, restored.get());
        r.call("getFieldsToSerialize");
        r.check(
            fieldsText(rc.runtime->getFieldsToSerialize()) == serialized, "deserialized plugin serializes the same");
        r.call("getMetadataString");
        r.check(
            rc.build && std::string(rc.build->getMetadataString()) == c.metadata, "deserialized plugin's attributes");
    }

    // clone and attach keep the attributes
    r.call("clone");
    std::unique_ptr<IPluginV3> copy(plugin->clone());
    if (r.check(copy != nullptr, "clone"))
    {
        Capabilities const cc = capabilities(r, copy.get());
        r.call("getFieldsToSerialize");
        r.check(fieldsText(cc.runtime->getFieldsToSerialize()) == serialized, "clone serializes the same");
    }
    Resources resources;
    r.call("attachToContext");
    std::unique_ptr<IPluginV3> attached(cap.runtime->attachToContext(&resources));
    if (!r.check(attached != nullptr, "attachToContext"))
        return;
    Capabilities const ac = capabilities(r, attached.get());
    r.call("getFieldsToSerialize");
    r.check(fieldsText(ac.runtime->getFieldsToSerialize()) == serialized, "attached plugin serializes the same");

    // runtime shapes: the case's, then one input wrong
    auto in = runtimeDescs(c.inputs);
    auto out = runtimeDescs(c.outputs);
    r.call("onShapeChange");
    r.check(ac.runtime->onShapeChange(in.data(), nIn, out.data(), nOut) == 0, "onShapeChange");
    r.check(r.finder.logger.errors.empty(), "no error logged so far");
    in[c.wrongInput].dims.d[in[c.wrongInput].dims.nbDims - 1] += 1;
    r.call("onShapeChange");
    r.check(ac.runtime->onShapeChange(in.data(), nIn, out.data(), nOut) != 0,
        "onShapeChange refuses input " + std::to_string(c.wrongInput) + " one wider");
    r.logged(std::string("edgemem::") + c.op + " [harness]: ", "the refusal is logged with the op and layer");

    if (enqueue)
        enqueueCheck(r, c, ac.runtime, rng);
}

} // namespace

int main(int argc, char** argv)
{
    bool const enqueue = argc > 1 && std::string(argv[1]) == "--enqueue";
    Run r;
    setLoggerFinder(&r.finder);
    int32_t n = 0;
    r.call("getCreators");
    IPluginCreatorInterface* const* creators = getCreators(n);
    std::map<std::string, IPluginCreatorV3One*> byName;
    for (int32_t i = 0; i < n; ++i)
    {
        r.call("getInterfaceInfo");
        InterfaceInfo const info = creators[i]->getInterfaceInfo();
        r.check(std::string(info.kind) == "PLUGIN CREATOR_V3ONE",
            "creator " + std::to_string(i) + " is an IPluginCreatorV3One");
        auto* c = static_cast<IPluginCreatorV3One*>(creators[i]);
        r.call("getPluginName");
        byName[c->getPluginName()] = c;
    }
    std::mt19937 rng(0);
    int plugins = 0;
    auto const all = cases();
    for (Case const& c : all)
    {
        r.op = c.op;
        if (!r.check(byName.count(c.op) == 1, "getCreators has a creator"))
            continue;
        drive(r, byName[c.op], c, enqueue, rng);
        ++plugins;
    }
    r.op = "harness";
    r.check(int32_t(all.size()) == n, "one case per creator (" + std::to_string(n) + " creators)");
    int total = 0;
    std::string entries;
    for (auto const& [name, times] : r.calls)
    {
        total += times;
        entries += std::string(entries.empty() ? "" : ", ") + "\"" + name + "\": " + std::to_string(times);
    }
    std::printf("harness: {\"plugins\": %d, \"calls\": %d, \"entry_points\": %zu, \"checks\": %d, \"failed\": %d, "
                "\"enqueue\": %s, \"by_entry_point\": {%s}}\n",
        plugins, total, r.calls.size(), r.checks, r.failed, enqueue ? "true" : "false", entries.c_str());
    return r.failed ? 1 : 0;
}
