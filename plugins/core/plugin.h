// Shared TensorRT glue of the edgemem plugins: logging through the ILoggerFinder TensorRT
// hands the library, attribute (plugin field) parsing and serialisation, and a base class
// implementing the IPluginV3 capability plumbing common to every edgemem plugin.
//
// The library links no TensorRT library: it implements TensorRT's interfaces only, and
// TensorRT finds its creators through the exported getCreators() (register.cpp).
#pragma once

#include <NvInferRuntime.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace edgemem
{
namespace trt
{

constexpr char const* kNamespace = "edgemem";
constexpr char const* kVersion = "1";

void setLoggerFinder(nvinfer1::ILoggerFinder* finder) noexcept;
// Logs "edgemem::<op> [layer]: message" through the logger of the calling TensorRT object
// (or stderr for errors when TensorRT gave no logger finder).
void log(nvinfer1::ILogger::Severity severity, char const* op, char const* layer, std::string const& message) noexcept;

enum class FieldKind
{
    kInt,    // ONNX INT    -> PluginFieldType::kINT32, length 1
    kFloat,  // ONNX FLOAT  -> kFLOAT32, length 1
    kString, // ONNX STRING -> kCHAR, length = characters
    kInts,   // ONNX INTS   -> kINT32 array
};

struct FieldSpec
{
    char const* name;
    FieldKind kind;
    bool required;
};

// The attributes of one plugin instance: parsed from the PluginFieldCollection TensorRT (or
// its ONNX parser) passes to createPlugin, and written back by getFieldsToSerialize.
class Attributes
{
public:
    // Parses `fc` against `specs`. Unknown fields are ignored; a missing required field or
    // a field of a type no ONNX attribute maps to is an error (logged; returns false).
    bool parse(nvinfer1::PluginFieldCollection const* fc, std::vector<FieldSpec> const& specs, char const* op,
        char const* layer) noexcept;

    bool has(std::string const& name) const { return mValues.count(name) != 0; }
    int32_t getInt(std::string const& name, int32_t fallback) const;
    float getFloat(std::string const& name, float fallback) const;
    std::string getString(std::string const& name, std::string const& fallback) const;
    std::vector<int32_t> getInts(std::string const& name) const;

    void setInt(std::string const& name, int32_t value);
    void setFloat(std::string const& name, float value);
    void setString(std::string const& name, std::string const& value);
    void setInts(std::string const& name, std::vector<int32_t> const& values);

    // "name=value;..." in insertion order (ints arrays comma-separated, floats as %.9g).
    std::string describe() const;

    // Fields pointing into this object (valid until it changes or dies), in insertion order.
    nvinfer1::PluginFieldCollection const* collection();

private:
    struct Value
    {
        FieldKind kind;
        std::vector<int32_t> ints;
        float real = 0.0f;
        std::string text;
    };
    Value& slot(std::string const& name, FieldKind kind);
    std::map<std::string, Value> mValues;
    std::vector<std::string> mOrder;
    std::vector<nvinfer1::PluginField> mFields;
    nvinfer1::PluginFieldCollection mCollection{0, nullptr};
};

// The creator's advertised field list for `specs`.
class FieldList
{
public:
    explicit FieldList(std::vector<FieldSpec> const& specs);
    nvinfer1::PluginFieldCollection const* collection() const { return &mCollection; }

private:
    std::vector<nvinfer1::PluginField> mFields;
    nvinfer1::PluginFieldCollection mCollection{0, nullptr};
};

// IPluginV3 with the OneCore, OneBuild (V2: I/O aliasing query) and OneRuntime capabilities.
class PluginBase : public nvinfer1::IPluginV3,
                   public nvinfer1::IPluginV3OneCore,
                   public nvinfer1::IPluginV3OneBuildV2,
                   public nvinfer1::IPluginV3OneRuntime
{
public:
    explicit PluginBase(std::string layer)
        : mLayer(std::move(layer))
    {
    }
    ~PluginBase() override = default;

    // IPluginV3
    nvinfer1::IPluginCapability* getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept override;

    // IPluginV3OneCore
    char const* getPluginVersion() const noexcept override { return kVersion; }
    char const* getPluginNamespace() const noexcept override { return kNamespace; }

    // IPluginV3OneBuild
    int32_t configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept override;
    size_t getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const*, int32_t, nvinfer1::DynamicPluginTensorDesc const*,
        int32_t) const noexcept override
    {
        return 0;
    }
    // The attributes as text: the metadata shown in engine inspection and the timing-cache
    // key of this plugin's creation state.
    char const* getMetadataString() noexcept override;
    char const* getTimingCacheID() noexcept override { return getMetadataString(); }
    // No declared aliasing: the kernels read past state and write present state through
    // separate pointers and are also correct when the two are one buffer.
    int32_t getAliasedInput(int32_t) noexcept override { return -1; }

    // IPluginV3OneRuntime
    int32_t onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs, nvinfer1::PluginTensorDesc const* out,
        int32_t nbOutputs) noexcept override;
    nvinfer1::IPluginV3* attachToContext(nvinfer1::IPluginResourceContext*) noexcept override { return clone(); }
    nvinfer1::PluginFieldCollection const* getFieldsToSerialize() noexcept override;

protected:
    // The op's own attributes as fields (getFieldsToSerialize, getMetadataString).
    virtual void writeAttributes(Attributes& out) const = 0;
    virtual int32_t expectedInputs() const = 0;
    // Checks the resolved shapes of one call; returns an empty string or what is wrong.
    virtual std::string checkShapes(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs) const = 0;

    void error(std::string const& message) const noexcept;
    // Logs a launcher status; returns 0 for success.
    int32_t status(int launch_status) const noexcept;

    std::string mLayer;
    Attributes mSerialized;
    std::string mMetadata;
};

// Shared helpers for the build-phase methods.
bool isLinear(nvinfer1::PluginTensorDesc const& d);
bool isFloatType(nvinfer1::DataType t); // kFLOAT, kHALF or kBF16
int dtypeOf(nvinfer1::DataType t);      // edgemem::DType for kFLOAT / kHALF / kBF16
// A ring or persistent tensor beside I/O of type `io`: kFLOAT or io's 16-bit type (kBF16 beside kBF16,
// else kHALF), the combinations the kernels are built for.
bool isStateType(nvinfer1::DataType state, nvinfer1::DataType io);
// The attention ops' common attributes: "" or what is wrong with num_heads, window, dilation.
std::string checkHeadsWindowDilation(int32_t heads, int32_t window, std::vector<int32_t> const& dilation);

// The IPluginV3 entry points every edgemem op implements the same way, for an op class P
// deriving from PluginImpl<P> (and befriending it) that provides:
//   static constexpr kName, kInputs, kOutputs; a copy constructor;
//   void outputTypes(DataType* out, DataType const* in) const;
//   std::string outputShapes(DimsExprs const* in, DimsExprs* out, IExprBuilder&) const;  // "" or what is wrong
//   bool supports(int32_t pos, DynamicPluginTensorDesc const* inOut) const;  // pos in range, linear format
//   int32_t launch(PluginTensorDesc const* in, void const* const* inputs, void* const* outputs, void* workspace,
//                  cudaStream_t);  // workspace: getWorkspaceSize bytes (0 unless the op overrides it)
// The entry points check the tensor counts, catch every exception and log what went wrong.
template <class P>
class PluginImpl : public PluginBase
{
public:
    using PluginBase::PluginBase;

    nvinfer1::IPluginV3* clone() noexcept override
    {
        try
        {
            return new P(static_cast<P const&>(*this));
        }
        catch (...)
        {
            error("clone failed");
        }
        return nullptr;
    }
    char const* getPluginName() const noexcept override { return P::kName; }
    int32_t getNbOutputs() const noexcept override { return P::kOutputs; }

    int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs, nvinfer1::DataType const* inputTypes,
        int32_t nbInputs) const noexcept override
    {
        if (nbInputs != P::kInputs || nbOutputs != P::kOutputs)
            return -1;
        self().outputTypes(outputTypes, inputTypes);
        return 0;
    }
    int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs, nvinfer1::DimsExprs const*, int32_t,
        nvinfer1::DimsExprs* outputs, int32_t nbOutputs, nvinfer1::IExprBuilder& exprBuilder) noexcept override
    {
        try
        {
            std::string const why = nbInputs != P::kInputs || nbOutputs != P::kOutputs
                ? "expected " + std::to_string(P::kInputs) + " inputs and " + std::to_string(P::kOutputs) + " outputs"
                : self().outputShapes(inputs, outputs, exprBuilder);
            if (why.empty())
                return 0;
            error(why);
        }
        catch (std::exception const& e)
        {
            error(e.what());
        }
        return -1;
    }
    bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
        int32_t nbOutputs) noexcept override
    {
        if (nbInputs != P::kInputs || nbOutputs != P::kOutputs || pos < 0 || pos >= P::kInputs + P::kOutputs)
            return false;
        return isLinear(inOut[pos].desc) && self().supports(pos, inOut);
    }
    int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const*,
        void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept override
    {
        try
        {
            std::string const why = checkShapes(inputDesc, P::kInputs);
            if (why.empty())
                return static_cast<P*>(this)->launch(inputDesc, inputs, outputs, workspace, stream);
            error(why);
        }
        catch (std::exception const& e)
        {
            error(e.what());
        }
        return -1;
    }

protected:
    int32_t expectedInputs() const override { return P::kInputs; }

private:
    P const& self() const { return static_cast<P const&>(*this); }
};

// Creator of one plugin type P, which provides:
//   static char const* kName;  static std::vector<FieldSpec> fieldSpecs();
//   P(std::string layer, Attributes const& attrs);  std::string invalid() const ("" or what is wrong)
template <class P>
class Creator : public nvinfer1::IPluginCreatorV3One
{
public:
    Creator()
        : mSpecs(P::fieldSpecs())
        , mFields(mSpecs)
    {
    }
    nvinfer1::IPluginV3* createPlugin(
        char const* name, nvinfer1::PluginFieldCollection const* fc, nvinfer1::TensorRTPhase) noexcept override
    {
        try
        {
            char const* layer = name ? name : "";
            Attributes attrs;
            if (!attrs.parse(fc, mSpecs, P::kName, layer))
                return nullptr;
            std::unique_ptr<P> plugin(new P(layer, attrs));
            std::string const why = plugin->invalid();
            if (why.empty())
                return plugin.release();
            log(nvinfer1::ILogger::Severity::kERROR, P::kName, layer, why);
        }
        catch (std::exception const& e)
        {
            log(nvinfer1::ILogger::Severity::kERROR, P::kName, name ? name : "", e.what());
        }
        catch (...)
        {
            log(nvinfer1::ILogger::Severity::kERROR, P::kName, name ? name : "", "unknown exception");
        }
        return nullptr;
    }
    nvinfer1::PluginFieldCollection const* getFieldNames() noexcept override { return mFields.collection(); }
    char const* getPluginName() const noexcept override { return P::kName; }
    char const* getPluginVersion() const noexcept override { return kVersion; }
    char const* getPluginNamespace() const noexcept override { return kNamespace; }

private:
    std::vector<FieldSpec> mSpecs;
    FieldList mFields;
};

// The creator of each op of ops.def (in <op>/<Name>Plugin.cpp), for getCreators (core/register.cpp).
#define EM_OP(Name, op) nvinfer1::IPluginCreatorInterface* Name##Creator();
#include "ops.def"
#undef EM_OP

} // namespace trt
} // namespace edgemem
