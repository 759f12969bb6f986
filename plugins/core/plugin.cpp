#include "core/plugin.h"

#include "core/common.h"
#include "core/io.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <mutex>

using namespace nvinfer1;

namespace edgemem
{
namespace trt
{

namespace
{
ILoggerFinder* gLoggerFinder = nullptr;
std::mutex gLoggerMutex;
} // namespace

void setLoggerFinder(ILoggerFinder* finder) noexcept
{
    std::lock_guard<std::mutex> lock(gLoggerMutex);
    gLoggerFinder = finder;
}

void log(ILogger::Severity severity, char const* op, char const* layer, std::string const& message) noexcept
{
    try
    {
        std::string const text = std::string(kNamespace) + "::" + op
            + (layer && *layer ? std::string(" [") + layer + "]" : "") + ": " + message;
        ILogger* logger = nullptr;
        {
            std::lock_guard<std::mutex> lock(gLoggerMutex);
            if (gLoggerFinder)
                logger = gLoggerFinder->findLogger();
        }
        if (logger)
            logger->log(severity, text.c_str());
        else if (severity <= ILogger::Severity::kWARNING)
            std::fprintf(stderr, "%s\n", text.c_str());
    }
    catch (...)
    {
    }
}

// ---------------------------------------------------------------------------------------------
// Attributes

Attributes::Value& Attributes::slot(std::string const& name, FieldKind kind)
{
    auto it = mValues.find(name);
    if (it == mValues.end())
    {
        mOrder.push_back(name);
        it = mValues.emplace(name, Value{}).first;
    }
    it->second = Value{};
    it->second.kind = kind;
    return it->second;
}

void Attributes::setInt(std::string const& name, int32_t value) { slot(name, FieldKind::kInt).ints = {value}; }
void Attributes::setFloat(std::string const& name, float value) { slot(name, FieldKind::kFloat).real = value; }
void Attributes::setString(std::string const& name, std::string const& value)
{
    slot(name, FieldKind::kString).text = value;
}
void Attributes::setInts(std::string const& name, std::vector<int32_t> const& values)
{
    slot(name, FieldKind::kInts).ints = values;
}

int32_t Attributes::getInt(std::string const& name, int32_t fallback) const
{
    auto it = mValues.find(name);
    return it == mValues.end() || it->second.ints.empty() ? fallback : it->second.ints[0];
}
float Attributes::getFloat(std::string const& name, float fallback) const
{
    auto it = mValues.find(name);
    return it == mValues.end() ? fallback : it->second.real;
}
std::string Attributes::getString(std::string const& name, std::string const& fallback) const
{
    auto it = mValues.find(name);
    return it == mValues.end() ? fallback : it->second.text;
}
std::vector<int32_t> Attributes::getInts(std::string const& name) const
{
    auto it = mValues.find(name);
    return it == mValues.end() ? std::vector<int32_t>{} : it->second.ints;
}

namespace
{
bool readInts(PluginField const& f, std::vector<int32_t>& out)
{
    out.clear();
    if (f.length < 0 || (f.length > 0 && !f.data))
        return false;
    for (int32_t i = 0; i < f.length; ++i)
    {
        switch (f.type)
        {
        case PluginFieldType::kINT32: out.push_back(static_cast<int32_t const*>(f.data)[i]); break;
        case PluginFieldType::kINT64: out.push_back(int32_t(static_cast<int64_t const*>(f.data)[i])); break;
        case PluginFieldType::kINT16: out.push_back(static_cast<int16_t const*>(f.data)[i]); break;
        case PluginFieldType::kINT8: out.push_back(static_cast<int8_t const*>(f.data)[i]); break;
        default: return false;
        }
    }
    return true;
}

bool readFloat(PluginField const& f, float& out)
{
    if (f.length < 1 || !f.data)
        return false;
    switch (f.type)
    {
    case PluginFieldType::kFLOAT32: out = static_cast<float const*>(f.data)[0]; return true;
    case PluginFieldType::kFLOAT64: out = float(static_cast<double const*>(f.data)[0]); return true;
    default: return false;
    }
}

char const* kindName(FieldKind k)
{
    switch (k)
    {
    case FieldKind::kInt: return "an INT (kINT32)";
    case FieldKind::kFloat: return "a FLOAT (kFLOAT32)";
    case FieldKind::kString: return "a STRING (kCHAR)";
    case FieldKind::kInts: return "INTS (kINT32 array)";
    }
    return "?";
}
} // namespace

bool Attributes::parse(
    PluginFieldCollection const* fc, std::vector<FieldSpec> const& specs, char const* op, char const* layer) noexcept
{
    try
    {
        int32_t const n = fc ? fc->nbFields : 0;
        for (int32_t i = 0; i < n; ++i)
        {
            PluginField const& f = fc->fields[i];
            if (!f.name)
                continue;
            for (FieldSpec const& spec : specs)
            {
                if (std::strcmp(spec.name, f.name) != 0)
                    continue;
                bool ok = true;
                switch (spec.kind)
                {
                case FieldKind::kInt:
                {
                    std::vector<int32_t> v;
                    ok = readInts(f, v) && v.size() == 1;
                    if (ok)
                        setInt(spec.name, v[0]);
                    break;
                }
                case FieldKind::kInts:
                {
                    std::vector<int32_t> v;
                    ok = readInts(f, v);
                    if (ok)
                        setInts(spec.name, v);
                    break;
                }
                case FieldKind::kFloat:
                {
                    float v = 0.0f;
                    ok = readFloat(f, v);
                    if (ok)
                        setFloat(spec.name, v);
                    break;
                }
                case FieldKind::kString:
                {
                    ok = f.type == PluginFieldType::kCHAR && f.length >= 0 && (f.length == 0 || f.data);
                    if (ok)
                    {
                        std::string s(static_cast<char const*>(f.data), static_cast<char const*>(f.data) + f.length);
                        s = s.substr(0, s.find('\0'));
                        setString(spec.name, s);
                    }
                    break;
                }
                }
                if (!ok)
                {
                    log(ILogger::Severity::kERROR, op, layer,
                        std::string("field '") + spec.name + "' must be " + kindName(spec.kind));
                    return false;
                }
            }
        }
        for (FieldSpec const& spec : specs)
        {
            if (spec.required && !has(spec.name))
            {
                log(ILogger::Severity::kERROR, op, layer, std::string("missing required field '") + spec.name + "'");
                return false;
            }
        }
        return true;
    }
    catch (std::exception const& e)
    {
        log(ILogger::Severity::kERROR, op, layer, e.what());
    }
    return false;
}

PluginFieldCollection const* Attributes::collection()
{
    mFields.clear();
    for (std::string const& name : mOrder)
    {
        Value const& v = mValues.at(name);
        switch (v.kind)
        {
        case FieldKind::kInt:
        case FieldKind::kInts:
            mFields.emplace_back(name.c_str(), v.ints.data(), PluginFieldType::kINT32, int32_t(v.ints.size()));
            break;
        case FieldKind::kFloat: mFields.emplace_back(name.c_str(), &v.real, PluginFieldType::kFLOAT32, 1); break;
        case FieldKind::kString:
            mFields.emplace_back(name.c_str(), v.text.c_str(), PluginFieldType::kCHAR, int32_t(v.text.size()));
            break;
        }
    }
    mCollection.nbFields = int32_t(mFields.size());
    mCollection.fields = mFields.data();
    return &mCollection;
}

std::string Attributes::describe() const
{
    std::string out;
    for (std::string const& name : mOrder)
    {
        Value const& v = mValues.at(name);
        if (!out.empty())
            out += ';';
        out += name + '=';
        switch (v.kind)
        {
        case FieldKind::kInt:
        case FieldKind::kInts:
            for (size_t i = 0; i < v.ints.size(); ++i)
                out += (i ? "," : "") + std::to_string(v.ints[i]);
            break;
        case FieldKind::kFloat:
        {
            char buf[32];
            std::snprintf(buf, sizeof(buf), "%.9g", double(v.real));
            out += buf;
            break;
        }
        case FieldKind::kString: out += v.text; break;
        }
    }
    return out;
}

FieldList::FieldList(std::vector<FieldSpec> const& specs)
{
    for (FieldSpec const& s : specs)
    {
        PluginFieldType type = PluginFieldType::kINT32;
        if (s.kind == FieldKind::kFloat)
            type = PluginFieldType::kFLOAT32;
        else if (s.kind == FieldKind::kString)
            type = PluginFieldType::kCHAR;
        mFields.emplace_back(s.name, nullptr, type, s.kind == FieldKind::kInts || s.kind == FieldKind::kString ? 0 : 1);
    }
    mCollection.nbFields = int32_t(mFields.size());
    mCollection.fields = mFields.data();
}

// ---------------------------------------------------------------------------------------------
// PluginBase

IPluginCapability* PluginBase::getCapabilityInterface(PluginCapabilityType type) noexcept
{
    switch (type)
    {
    case PluginCapabilityType::kCORE: return static_cast<IPluginV3OneCore*>(this);
    case PluginCapabilityType::kBUILD: return static_cast<IPluginV3OneBuildV2*>(this);
    case PluginCapabilityType::kRUNTIME: return static_cast<IPluginV3OneRuntime*>(this);
    }
    return nullptr;
}

int32_t PluginBase::configurePlugin(
    DynamicPluginTensorDesc const*, int32_t nbInputs, DynamicPluginTensorDesc const*, int32_t nbOutputs) noexcept
{
    if (nbInputs != expectedInputs() || nbOutputs != getNbOutputs())
    {
        error("expected " + std::to_string(expectedInputs()) + " inputs and " + std::to_string(getNbOutputs())
            + " outputs; got " + std::to_string(nbInputs) + " and " + std::to_string(nbOutputs));
        return -1;
    }
    return 0;
}

int32_t PluginBase::onShapeChange(
    PluginTensorDesc const* in, int32_t nbInputs, PluginTensorDesc const*, int32_t nbOutputs) noexcept
{
    try
    {
        if (nbInputs != expectedInputs() || nbOutputs != getNbOutputs())
        {
            error("unexpected number of inputs or outputs");
            return -1;
        }
        std::string const why = checkShapes(in, nbInputs);
        if (!why.empty())
        {
            error(why);
            return -1;
        }
        return 0;
    }
    catch (std::exception const& e)
    {
        error(e.what());
    }
    return -1;
}

PluginFieldCollection const* PluginBase::getFieldsToSerialize() noexcept
{
    try
    {
        mSerialized = Attributes{};
        writeAttributes(mSerialized);
        return mSerialized.collection();
    }
    catch (std::exception const& e)
    {
        error(e.what());
    }
    return nullptr;
}

char const* PluginBase::getMetadataString() noexcept
{
    try
    {
        Attributes a;
        writeAttributes(a);
        mMetadata = a.describe();
        return mMetadata.c_str();
    }
    catch (...)
    {
    }
    return nullptr;
}

void PluginBase::error(std::string const& message) const noexcept
{
    log(ILogger::Severity::kERROR, getPluginName(), mLayer.c_str(), message);
}

int32_t PluginBase::status(int launch_status) const noexcept
{
    switch (launch_status)
    {
    case kOk: return 0;
    case kBadArgument: error("a size or attribute is outside the op's contract"); break;
    case kUnsupported: error("this shape or type combination is not supported by the kernels"); break;
    case kCudaError: error("a CUDA kernel launch or copy failed"); break;
    default: error("kernel launch failed"); break;
    }
    return -1;
}

bool isLinear(PluginTensorDesc const& d) { return d.format == TensorFormat::kLINEAR; }
bool isFloatType(DataType t) { return t == DataType::kFLOAT || t == DataType::kHALF || t == DataType::kBF16; }
int dtypeOf(DataType t) { return t == DataType::kHALF ? kFloat16 : t == DataType::kBF16 ? kBFloat16 : kFloat32; }
bool isStateType(DataType state, DataType io)
{
    return state == DataType::kFLOAT || state == (io == DataType::kBF16 ? DataType::kBF16 : DataType::kHALF);
}

std::string checkHeadsWindowDilation(int32_t heads, int32_t window, std::vector<int32_t> const& dilation)
{
    if (heads <= 0 || window < 1)
        return "num_heads must be positive and window >= 1";
    if (heads > 128)
        return "more than 128 heads is not supported";
    if (int32_t(dilation.size()) != heads || *std::min_element(dilation.begin(), dilation.end()) < 1)
        return "dilation must hold one positive int per head";
    return {};
}

} // namespace trt
} // namespace edgemem
