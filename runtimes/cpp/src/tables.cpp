// The tables of a compiled sparse program, stored beside it in a safetensors file (artifacts.sparse.constants;
// docs/PACKAGE.md "Tables outside the program"), read as hstu_export/package/tables.py reads them: the file mapped
// read-only, its header checked against the manifest (AOTInductor checks neither the shape nor the dtype of a
// constant it is given, so a short table would be read past its end), each tensor a view of the mapping on CPU or
// one copy on the device.
#include "tables.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <set>

#include "json.h"

namespace hstu_export::detail {

namespace {

constexpr uint64_t kHeaderLimit = uint64_t{100} << 20;  // safetensors' own limit on the JSON header

struct TableType {
  const char* name;  // the manifest's dtype name
  const char* code;  // safetensors'
  at::ScalarType type;
};
constexpr TableType kTableTypes[] = {
    {"float64", "F64", at::kDouble}, {"float32", "F32", at::kFloat}, {"float16", "F16", at::kHalf},
    {"bfloat16", "BF16", at::kBFloat16}, {"int64", "I64", at::kLong}, {"int32", "I32", at::kInt},
    {"int16", "I16", at::kShort},     {"int8", "I8", at::kChar},     {"uint8", "U8", at::kByte},
    {"bool", "BOOL", at::kBool},
};

const TableType* by_name(const std::string& name) {
  for (const auto& t : kTableTypes) {
    if (name == t.name) return &t;
  }
  return nullptr;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

}  // namespace

bool is_table_dtype(const std::string& name) { return by_name(name) != nullptr; }

std::unordered_map<std::string, at::Tensor> read_tables(const std::string& path, const std::vector<TableSpec>& specs,
                                                        c10::Device device, const std::string& what) {
  auto fail = [&](const std::string& problem) -> void {
    throw PackageError(what + " " + problem + "; re-export the package");
  };
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("cannot be opened (" + std::string(std::strerror(errno)) + ")");
  struct stat info {};
  if (::fstat(fd, &info) != 0 || info.st_size < 8) {
    ::close(fd);
    fail("is not a safetensors file (shorter than its header length)");
  }
  const auto size = static_cast<uint64_t>(info.st_size);
  void* base = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (base == MAP_FAILED) fail("cannot be mapped (" + std::string(std::strerror(errno)) + ")");
  std::shared_ptr<void> mapping(base, [size](void* p) { ::munmap(p, size); });
  const auto* bytes = static_cast<const unsigned char*>(base);

  uint64_t length = 0;
  for (int i = 7; i >= 0; --i) length = (length << 8) | bytes[i];  // little-endian
  if (length < 2 || length > size - 8 || length > kHeaderLimit || length % 8 != 0) {
    fail("is not a safetensors file (its header length " + std::to_string(length) + " does not fit its " +
         std::to_string(size) + " bytes, or is not padded to 8)");
  }
  json::Value header;
  try {
    header = json::parse(std::string_view(reinterpret_cast<const char*>(bytes + 8), length));
  } catch (const json::ParseError& exc) {
    fail("has a header that is not valid JSON (" + std::string(exc.what()) + ")");
  }
  if (header.type != json::Value::Type::Object) fail("has a header that is not a JSON object");
  std::set<std::string> held;
  for (const auto& [key, value] : header.object) {
    if (key != "__metadata__") held.insert(key);
  }
  std::set<std::string> wanted;
  for (const auto& spec : specs) wanted.insert(spec.name);
  if (held != wanted) {
    for (const auto& name : wanted) {
      if (!held.count(name)) fail("lacks the table " + in_quotes(name));
    }
    for (const auto& name : held) {
      if (!wanted.count(name)) fail("holds " + in_quotes(name) + ", which the manifest does not list");
    }
  }

  const uint64_t data_start = 8 + length, data_bytes = size - data_start;
  const bool on_host = device.is_cpu();
  std::unordered_map<std::string, at::Tensor> tables;
  for (const auto& spec : specs) {
    const std::string where = "table " + in_quotes(spec.name);
    const json::Value& entry = *header.find(spec.name);
    const json::Value* code = entry.find("dtype");
    const json::Value* shape = entry.find("shape");
    const json::Value* offsets = entry.find("data_offsets");
    const TableType* type = by_name(spec.dtype);
    if (type == nullptr || code == nullptr || code->type != json::Value::Type::String || code->string != type->code) {
      fail("has " + where + " of another dtype than the manifest's " + spec.dtype);
    }
    std::vector<int64_t> found;
    if (shape != nullptr && shape->type == json::Value::Type::Array) {
      for (const auto& dim : shape->array) found.push_back(dim.integer && *dim.integer >= 0 ? *dim.integer : -1);
    }
    if (shape == nullptr || found != spec.shape) {
      fail("has " + where + " of another shape than the manifest's " + shape_text(spec.shape) +
           " (the shape its program was compiled for)");
    }
    const int64_t itemsize = static_cast<int64_t>(c10::elementSize(type->type));
    uint64_t numel = 1;
    for (int64_t dim : spec.shape) numel *= static_cast<uint64_t>(dim);
    bool fits = offsets != nullptr && offsets->type == json::Value::Type::Array && offsets->array.size() == 2 &&
                offsets->array[0].integer && offsets->array[1].integer && *offsets->array[0].integer >= 0;
    uint64_t begin = 0, end = 0;
    if (fits) {
      begin = static_cast<uint64_t>(*offsets->array[0].integer);
      end = static_cast<uint64_t>(*offsets->array[1].integer);
      fits = begin <= end && end <= data_bytes && end - begin == numel * itemsize && begin % itemsize == 0;
    }
    if (!fits) fail("has " + where + " whose bytes are not " + std::to_string(numel) + " aligned values inside the file");
    auto options = at::TensorOptions().dtype(type->type).device(at::kCPU);
    at::Tensor view = numel == 0 ? at::empty(spec.shape, options)
                                 : at::from_blob(const_cast<unsigned char*>(bytes + data_start + begin), spec.shape,
                                                 [mapping](void*) {}, options);
    tables.emplace(spec.name, on_host ? view : view.to(device));
  }
  return tables;
}

}  // namespace hstu_export::detail
