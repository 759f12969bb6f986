#include "util.hpp"

#include <fcntl.h>
#include <openssl/evp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <onnxruntime_c_api.h>

namespace em {

namespace {
const DType DTYPES[] = {
    {"float32", ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, "F32", "<f4", 4},
    {"float16", ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16, "F16", "<f2", 2},
    {"float64", ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE, "F64", "<f8", 8},
    {"int64", ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64, "I64", "<i8", 8},
};
// Read from checkpoints and state_init files only to be refused by name and shape checks later.
const DType OTHER[] = {
    {"int32", ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32, "I32", "<i4", 4},   {"int16", ONNX_TENSOR_ELEMENT_DATA_TYPE_INT16, "I16", "<i2", 2},
    {"int8", ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8, "I8", "|i1", 1},      {"uint8", ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8, "U8", "|u1", 1},
    {"uint16", ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT16, "U16", "<u2", 2}, {"uint32", ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT32, "U32", "<u4", 4},
    {"uint64", ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT64, "U64", "<u8", 8}, {"bool", ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL, "BOOL", "|b1", 1},
};

struct DigestFree {
    void operator()(EVP_MD_CTX *ctx) const { EVP_MD_CTX_free(ctx); }
};

class Sha256 {
  public:
    Sha256() : ctx_(EVP_MD_CTX_new()) {
        if (!ctx_ || EVP_DigestInit_ex(ctx_.get(), EVP_sha256(), nullptr) != 1) fail(EM_ERR_INTERNAL, "sha256: OpenSSL failed to start");
    }
    void update(const void *data, size_t size) { EVP_DigestUpdate(ctx_.get(), data, size); }
    std::string hex() {
        unsigned char out[EVP_MAX_MD_SIZE];
        unsigned int n = 0;
        EVP_DigestFinal_ex(ctx_.get(), out, &n);
        static const char digits[] = "0123456789abcdef";
        std::string text;
        for (unsigned int i = 0; i < n; ++i) {
            text += digits[out[i] >> 4];
            text += digits[out[i] & 15];
        }
        return text;
    }

  private:
    std::unique_ptr<EVP_MD_CTX, DigestFree> ctx_;
};

float half_to_float(uint16_t h) {
    const uint32_t sign = (h >> 15) & 1, exponent = (h >> 10) & 31, mantissa = h & 1023;
    if (exponent == 31) return mantissa ? NAN : (sign ? -INFINITY : INFINITY);
    float value = exponent ? std::ldexp(1024.0f + mantissa, int(exponent) - 25) : std::ldexp(float(mantissa), -24);
    return sign ? -value : value;
}
}  // namespace

bool is_dir(const std::string &path) {
    struct stat info {};
    return ::stat(path.c_str(), &info) == 0 && S_ISDIR(info.st_mode);
}

bool is_file(const std::string &path) {
    struct stat info {};
    return ::stat(path.c_str(), &info) == 0 && S_ISREG(info.st_mode);
}

void to_float(const uint8_t *src, const DType *dtype, size_t n, float *dst) {
    if (dtype->onnx == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) {
        std::memcpy(dst, src, n * 4);
        return;
    }
    for (size_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        dst[i] = half_to_float(h);
    }
}

const DType *dtype_named(const std::string &name) {
    for (const auto &d : DTYPES)
        if (d.name == name) return &d;
    return nullptr;
}

const DType *dtype_of_safetensors(const std::string &code) {
    for (const auto &d : DTYPES)
        if (d.safetensors == code) return &d;
    for (const auto &d : OTHER)
        if (d.safetensors == code) return &d;
    return nullptr;
}

const DType *dtype_of_onnx(int onnx) {
    for (const auto &d : DTYPES)
        if (d.onnx == onnx) return &d;
    return nullptr;
}

int64_t elements(const std::vector<int64_t> &shape) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
}

bool all_finite(const Blob &blob) {
    const size_t n = blob.data.size() / blob.dtype->size;
    const uint8_t *p = blob.data.data();
    if (blob.dtype->name == "float32") {
        for (size_t i = 0; i < n; ++i) {
            float v;
            std::memcpy(&v, p + 4 * i, 4);
            if (!std::isfinite(v)) return false;
        }
    } else if (blob.dtype->name == "float64") {
        for (size_t i = 0; i < n; ++i) {
            double v;
            std::memcpy(&v, p + 8 * i, 8);
            if (!std::isfinite(v)) return false;
        }
    } else if (blob.dtype->name == "float16") {
        for (size_t i = 0; i < n; ++i) {
            uint16_t v;
            std::memcpy(&v, p + 2 * i, 2);
            if (!std::isfinite(half_to_float(v))) return false;
        }
    }
    return true;
}

std::vector<uint8_t> read_file(const std::string &path, int code, const std::string &what) {
    std::ifstream in(path, std::ios::binary);
    struct stat info {};
    if (::stat(path.c_str(), &info) != 0) fail(code, path + ": no such " + what);
    if (S_ISDIR(info.st_mode)) fail(code, path + " is a directory, not a " + what);
    if (!in) fail(code, path + ": cannot read the " + what + " (" + std::strerror(errno) + ")");
    std::vector<uint8_t> data(static_cast<size_t>(info.st_size));
    if (!data.empty() && !in.read(reinterpret_cast<char *>(data.data()), std::streamsize(data.size())))
        fail(code, path + ": cannot read the " + what);
    return data;
}

void write_atomic(const std::string &path, const std::vector<uint8_t> &data) {
    struct stat info {};
    if (::stat(path.c_str(), &info) == 0 && S_ISDIR(info.st_mode))
        fail(EM_ERR_IO, path + " is a directory; give a file name for the state checkpoint");
    const size_t slash = path.find_last_of('/');
    const std::string folder = slash == std::string::npos ? "." : path.substr(0, slash + 1);
    const std::string name = slash == std::string::npos ? path : path.substr(slash + 1);
    std::string tmp = folder + (slash == std::string::npos ? "/." : ".") + name + "." + std::to_string(::getpid()) + ".XXXXXX.tmp";
    std::vector<char> buffer(tmp.begin(), tmp.end());
    buffer.push_back('\0');
    const int fd = ::mkstemps(buffer.data(), 4);
    if (fd < 0) fail(EM_ERR_IO, "cannot write " + path + ": " + std::strerror(errno));
    tmp = buffer.data();
    const mode_t mask = ::umask(0);
    ::umask(mask);
    bool ok = ::fchmod(fd, 0666 & ~mask) == 0;
    size_t done = 0;
    while (ok && done < data.size()) {
        const ssize_t n = ::write(fd, data.data() + done, data.size() - done);
        if (n < 0 && errno == EINTR) continue;
        ok = n > 0;
        if (ok) done += size_t(n);
    }
    const int error = errno;
    ok = ok && ::fsync(fd) == 0;
    ok = (::close(fd) == 0) && ok;
    if (!ok || ::rename(tmp.c_str(), path.c_str()) != 0) {
        const int last = ok ? errno : error;
        ::unlink(tmp.c_str());
        fail(EM_ERR_IO, "cannot write " + path + ": " + std::strerror(last));
    }
}

std::string sha256_hex(const void *data, size_t size) {
    Sha256 digest;
    digest.update(data, size);
    return digest.hex();
}

std::string sha256_file(const std::string &path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) return "";
    Sha256 digest;
    std::vector<char> block(1 << 20);
    while (in) {
        in.read(block.data(), std::streamsize(block.size()));
        if (in.gcount() > 0) digest.update(block.data(), size_t(in.gcount()));
    }
    return digest.hex();
}

std::string py_json_string(const std::string &text) {
    std::string out = "\"";
    char buf[16];
    auto escape = [&](uint32_t unit) {
        std::snprintf(buf, sizeof buf, "\\u%04x", unit);
        out += buf;
    };
    for (size_t i = 0; i < text.size();) {
        const auto c = static_cast<unsigned char>(text[i]);
        uint32_t code = c;
        size_t length = 1;
        if (c >= 0x80) {  // UTF-8 (the manifest and metadata are JSON text, so valid UTF-8)
            length = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : 2;
            code = c & (length == 4 ? 0x07 : length == 3 ? 0x0F : 0x1F);
            for (size_t k = 1; k < length && i + k < text.size(); ++k) code = (code << 6) | (text[i + k] & 0x3F);
        }
        i += length;
        switch (code) {
        case '"': out += "\\\""; break;
        case '\\': out += "\\\\"; break;
        case '\n': out += "\\n"; break;
        case '\r': out += "\\r"; break;
        case '\t': out += "\\t"; break;
        case '\b': out += "\\b"; break;
        case '\f': out += "\\f"; break;
        default:
            if (code < 0x20 || (code >= 0x7F && code < 0x10000)) {
                if (code == 0x7F) out += char(code);
                else escape(code);
            } else if (code >= 0x10000) {
                code -= 0x10000;
                escape(0xD800 + (code >> 10));
                escape(0xDC00 + (code & 0x3FF));
            } else {
                out += char(code);
            }
        }
    }
    return out + "\"";
}

std::string state_checksum(const std::map<std::string, std::string> &metadata, const std::map<std::string, Blob> &tensors) {
    std::string text = "{";
    for (const auto &[key, value] : metadata) {
        if (key == "sha256") continue;
        text += (text.size() > 1 ? ", " : "") + py_json_string(key) + ": " + py_json_string(value);
    }
    text += "}";
    Sha256 digest;
    digest.update(text.data(), text.size());
    for (const auto &[name, blob] : tensors) {
        const std::string head =
            "[" + py_json_string(name) + ", " + py_json_string(blob.dtype->numpy) + ", " + py_json_shape(blob.shape) + "]";
        digest.update(head.data(), head.size());
        digest.update(blob.data.data(), blob.data.size());
    }
    return digest.hex();
}

std::string py_json_shape(const std::vector<int64_t> &shape) {
    std::string out = "[";
    for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
    return out + "]";
}

std::map<std::string, Blob> read_safetensors(const std::vector<uint8_t> &bytes, const std::string &where, int code,
                                             std::map<std::string, std::string> *metadata) {
    const std::string invalid = where + " is not a valid safetensors file";
    if (bytes.size() < 8) fail(code, invalid + " (truncated: " + std::to_string(bytes.size()) + " bytes)");
    uint64_t size = 0;
    for (int i = 7; i >= 0; --i) size = (size << 8) | bytes[size_t(i)];
    if (size > bytes.size() - 8)
        fail(code, invalid + " (truncated, or not safetensors at all: its header claims " + std::to_string(size) + " bytes, the file has " +
                       std::to_string(bytes.size()) + ")");
    nlohmann::json header = nlohmann::json::parse(bytes.begin() + 8, bytes.begin() + 8 + long(size), nullptr, false);
    if (header.is_discarded() || !header.is_object()) fail(code, invalid + " (corrupt header)");
    const size_t start = 8 + size, length = bytes.size() - start;
    std::map<std::string, Blob> tensors;
    std::vector<std::pair<uint64_t, uint64_t>> spans;
    for (auto it = header.begin(); it != header.end(); ++it) {
        if (it.key() == "__metadata__") {
            if (!it->is_object()) fail(code, invalid + " (its metadata is not a map of strings)");
            for (auto m = it->begin(); m != it->end(); ++m) {
                if (!m->is_string()) fail(code, invalid + " (its metadata is not a map of strings)");
                if (metadata) (*metadata)[m.key()] = m->get<std::string>();
            }
            continue;
        }
        const nlohmann::json &entry = *it;
        const std::string bad = invalid + " (tensor " + it.key() + ": ";
        if (!entry.is_object() || !entry.contains("dtype") || !entry["dtype"].is_string() || !entry.contains("shape") ||
            !entry["shape"].is_array() || !entry.contains("data_offsets") || !entry["data_offsets"].is_array() ||
            entry["data_offsets"].size() != 2)
            fail(code, bad + "needs dtype, shape and data_offsets)");
        Blob blob;
        blob.dtype = dtype_of_safetensors(entry["dtype"].get<std::string>());
        if (!blob.dtype) fail(code, bad + "dtype " + entry["dtype"].get<std::string>() + " is not one edgemem reads)");
        uint64_t count = 1;
        for (const auto &d : entry["shape"]) {
            if (!d.is_number_unsigned() || d.get<uint64_t>() > (uint64_t(1) << 40)) fail(code, bad + "bad shape)");
            blob.shape.push_back(int64_t(d.get<uint64_t>()));
            count *= d.get<uint64_t>();
            if (count > (uint64_t(1) << 40)) fail(code, bad + "bad shape)");
        }
        const auto &offsets = entry["data_offsets"];
        if (!offsets[0].is_number_unsigned() || !offsets[1].is_number_unsigned()) fail(code, bad + "bad data_offsets)");
        const uint64_t begin = offsets[0].get<uint64_t>(), end = offsets[1].get<uint64_t>();
        if (begin > end || end > length || end - begin != count * blob.dtype->size)
            fail(code, bad + "its data_offsets do not fit its shape or the file; corrupt or truncated)");
        blob.data.assign(bytes.begin() + long(start + begin), bytes.begin() + long(start + end));
        spans.emplace_back(begin, end);
        tensors.emplace(it.key(), std::move(blob));
    }
    std::sort(spans.begin(), spans.end());
    uint64_t at = 0;
    for (const auto &span : spans) {
        if (span.first != at) fail(code, invalid + " (its tensors overlap or leave gaps; corrupt)");
        at = span.second;
    }
    if (at != length) fail(code, invalid + " (its data does not end where its tensors do; corrupt or truncated)");
    return tensors;
}

std::vector<uint8_t> write_safetensors(const std::map<std::string, Blob> &tensors, const std::map<std::string, std::string> &metadata) {
    nlohmann::json header = nlohmann::json::object();
    header["__metadata__"] = metadata;
    uint64_t offset = 0;
    for (const auto &[name, blob] : tensors) {  // data in name order
        header[name] = {{"dtype", blob.dtype->safetensors}, {"shape", blob.shape}, {"data_offsets", {offset, offset + blob.data.size()}}};
        offset += blob.data.size();
    }
    std::string text = header.dump();
    text.append((8 - text.size() % 8) % 8, ' ');  // the data starts 8-byte aligned, as safetensors writes it
    std::vector<uint8_t> out;
    out.reserve(8 + text.size() + offset);
    for (int i = 0; i < 8; ++i) out.push_back(uint8_t(uint64_t(text.size()) >> (8 * i)));
    out.insert(out.end(), text.begin(), text.end());
    for (const auto &entry : tensors) out.insert(out.end(), entry.second.data.begin(), entry.second.data.end());
    return out;
}

}  // namespace em
