// Package::open and Package::run: the package contract of docs/PACKAGE.md, read from C++.
#include "hstu_export/runtime.h"

#include <c10/core/DeviceGuard.h>
#include <c10/core/InferenceMode.h>
#include <dlfcn.h>
#include <torch/csrc/jit/ir/constants.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/cuda.h>
#include <torch/version.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <mutex>
#include <regex>
#include <set>
#include <sstream>
#include <streambuf>
#include <tuple>

#include "json.h"
#include "package_impl.h"
#include "sha256.h"

#ifndef HSTU_EXPORT_DEFAULT_OP_LIBRARY_DIRS
#define HSTU_EXPORT_DEFAULT_OP_LIBRARY_DIRS ""
#endif

namespace hstu_export {

namespace fs = std::filesystem;
using json::Value;

namespace {

std::string first_line(const std::string& text) {
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    auto start = line.find_first_not_of(" \t\r");
    if (start == std::string::npos) continue;
    line = line.substr(start);
    return line.size() > 400 ? line.substr(0, 397) + "..." : line;
  }
  return "unknown error";
}

}  // namespace

namespace detail {

std::string error_text(const std::exception& exc) {
  std::string text = exc.what();
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&exc)) text = c10_error->what_without_backtrace();
  // A TorchScript error opens with a fixed sentence and its tracebacks; what was raised is its last line.
  if (first_line(text).starts_with("The following operation failed in the TorchScript interpreter")) {
    auto end = text.find_last_not_of(" \t\r\n");
    if (end != std::string::npos) {
      auto newline = text.rfind('\n', end);
      size_t start = newline == std::string::npos ? 0 : newline + 1;
      return first_line(text.substr(start, end + 1 - start));
    }
  }
  return first_line(text);
}

std::string in_quotes(const std::string& text) { return "'" + text.substr(0, 200) + "'"; }

std::optional<at::ScalarType> scalar_type(const std::string& name) {
  static const std::pair<const char*, at::ScalarType> kTypes[] = {
      {"int64", at::kLong},     {"int32", at::kInt},      {"float32", at::kFloat}, {"bfloat16", at::kBFloat16},
      {"float16", at::kHalf},   {"float64", at::kDouble}, {"bool", at::kBool},
  };
  for (const auto& [text, type] : kTypes) {
    if (name == text) return type;
  }
  return std::nullopt;
}

NamedTensors named_outputs(const c10::IValue& value, const std::vector<std::string>& names, const std::string& what) {
  NamedTensors out;
  auto add = [&](const std::string& name, const c10::IValue& item) {
    if (!item.isTensor()) throw Error(what + " returned a non-tensor for " + in_quotes(name));
    out.emplace_back(name, item.toTensor());
  };
  if (value.isGenericDict()) {
    auto dict = value.toGenericDict();
    for (const auto& name : names) {
      auto it = dict.find(c10::IValue(name));
      if (it == dict.end()) throw Error(what + " returned no output " + in_quotes(name));
      add(name, it->value());
    }
    return out;
  }
  std::vector<c10::IValue> items;
  if (value.isTuple()) {
    items = value.toTupleRef().elements().vec();
  } else if (value.isList()) {
    items = value.toListRef().vec();
  } else {
    items = {value};
  }
  if (items.size() != names.size()) {
    throw Error(what + " returned " + std::to_string(items.size()) + " outputs, the manifest names " +
                std::to_string(names.size()));
  }
  for (size_t i = 0; i < names.size(); ++i) add(names[i], items[i]);
  return out;
}

namespace {

// A compiled program that raises also writes "Error: <what>" to std::cerr itself (AOTInductor's model
// interface) before the error reaches us; we report the error once, as the one line a refusal is. std::cerr
// keeps its buffer but drops what a thread writes while that thread runs a program; installed once, never swapped
// back, so threads never race on the stream's buffer.
thread_local bool running_program = false;

class QuietWhileRunning : public std::streambuf {
 public:
  explicit QuietWhileRunning(std::streambuf* out) : out_(out) {}

 protected:
  int overflow(int c) override {
    if (traits_type::eq_int_type(c, traits_type::eof())) return traits_type::not_eof(c);
    return running_program ? c : out_->sputc(traits_type::to_char_type(c));
  }
  std::streamsize xsputn(const char* s, std::streamsize n) override { return running_program ? n : out_->sputn(s, n); }
  int sync() override { return out_->pubsync(); }

 private:
  std::streambuf* out_;
};

void quiet_program_errors() {
  static std::once_flag once;
  std::call_once(once, [] { std::cerr.rdbuf(new QuietWhileRunning(std::cerr.rdbuf())); });
}

struct RunningProgram {
  RunningProgram() { running_program = true; }
  ~RunningProgram() { running_program = false; }
};

}  // namespace

AotiProgram::AotiProgram(const std::string& path, c10::Device device, size_t concurrency, const std::string& model)
    : serialised_(device.is_cuda()) {
  quiet_program_errors();
  c10::DeviceIndex index = device.is_cuda() ? device.index() : -1;
  loader_ = std::make_unique<torch::inductor::AOTIModelPackageLoader>(path, model, /*run_single_threaded=*/serialised_,
                                                                     serialised_ ? 1 : concurrency, index);
}

void AotiProgram::use_constants(std::unordered_map<std::string, at::Tensor> tables, const std::string& what) {
  auto* runner = loader_->get_runner();
  std::unordered_map<std::string, int32_t> dtypes;
  if (runner != nullptr) {
    auto types = runner->getConstantNamesToDtypes();
    for (const auto& [name, fqn] : runner->getConstantNamesToOriginalFQNs()) {
      if (types.count(name)) dtypes[fqn] = types.at(name);
    }
  }
  for (const auto& fqn : loader_->get_constant_fqns()) {
    auto table = tables.find(fqn);
    if (table == tables.end()) {
      throw PackageError(what + " lacks the table " + in_quotes(fqn) + " its program takes; re-export the package");
    }
    auto dtype = dtypes.find(fqn);
    if (dtype != dtypes.end() && dtype->second != static_cast<int32_t>(table->second.scalar_type())) {
      throw PackageError(what + " holds the table " + in_quotes(fqn) + " as " +
                         std::string(c10::toString(table->second.scalar_type())) +
                         ", not the dtype its program takes; re-export the package");
    }
  }
  loader_->load_constants(tables, /*use_inactive=*/false, /*check_full_update=*/true, /*user_managed=*/true);
  constants_ = std::move(tables);
}

std::vector<at::Tensor> AotiProgram::run(const std::vector<at::Tensor>& inputs) const {
  RunningProgram quiet;
  if (!serialised_) return loader_->run(inputs);
  std::lock_guard<std::mutex> lock(launch_);
  return loader_->run(inputs);
}

}  // namespace detail

using detail::Artifact;
using detail::error_text;
using detail::in_quotes;
using detail::named_outputs;
using detail::scalar_type;
using detail::TensorSpec;

namespace {

constexpr const char* kFormat = "hstu-export-package";
constexpr const char* kManifest = "manifest.json";
constexpr const char* kManifestSha256 = "manifest.sha256";
constexpr size_t kMaxManifestBytes = size_t{64} << 20;

// The op libraries a package may name, and the shared library that registers each one's ops. The files
// come from this table, never from the manifest: a package cannot make the runtime load other code.
struct OpLibrary {
  const char* name;
  const char* file;         // nullptr: no C++ equivalent
  const char* no_cpp_hint;  // why not, and what to do
};
constexpr OpLibrary kOpLibraries[] = {
    {"fbgemm_gpu", "fbgemm_gpu_py.so", nullptr},
    {"torch_tensorrt", "libtorchtrt_runtime.so", nullptr},
    {"hstu_export.ops", nullptr,
     "its graphs call hstu-export's own ops, which are defined in Python only; re-export with "
     "--op-target aten (or fbgemm) to serve it from C++"},
};

// Files beside a library that hold more of its ops, loaded after it when present: fbgemm_gpu registers
// its table-batched embedding ops (the quantized lookups of --quantize-embeddings among them) from these.
struct CompanionLibrary {
  const char* name;
  const char* file;
};
constexpr CompanionLibrary kCompanionLibraries[] = {
    {"fbgemm_gpu", "fbgemm_gpu_tbe_common.so"},
    {"fbgemm_gpu", "fbgemm_gpu_tbe_inference.so"},
};

// "a, b, c"
template <typename Container>
std::string joined(const Container& items) {
  std::string out;
  for (const auto& item : items) out += (out.empty() ? "" : ", ") + std::string(item);
  return out;
}

// Typed reads of manifest fields; errors name the field.
class Fields {
 public:
  explicit Fields(std::string root) : root_(std::move(root)) {}

  [[noreturn]] void fail(const std::string& where, const std::string& what) const {
    throw PackageError(root_ + ": " + kManifest + " field '" + where + "' " + what +
                       "; the package is damaged or was not written by hstu-export: re-export it");
  }

  const Value& member(const Value& object, const std::string& key, const std::string& where) const {
    if (object.type != Value::Type::Object) fail(where, "is " + json::type_name(object.type) + ", expected an object");
    const Value* value = object.find(key);
    if (value == nullptr) fail(join(where, key), "is missing");
    return *value;
  }

  const Value& of_type(const Value& value, Value::Type type, const std::string& where) const {
    if (value.type != type) fail(where, "is " + json::type_name(value.type) + ", expected " + json::type_name(type));
    return value;
  }

  std::string string(const Value& object, const std::string& key, const std::string& where) const {
    return of_type(member(object, key, where), Value::Type::String, join(where, key)).string;
  }

  // A string, or "" for null/absent.
  std::string optional_string(const Value& object, const std::string& key, const std::string& where) const {
    const Value* value = object.find(key);
    if (value == nullptr || value->is_null()) return "";
    return of_type(*value, Value::Type::String, join(where, key)).string;
  }

  int64_t integer(const Value& value, const std::string& where) const {
    of_type(value, Value::Type::Number, where);
    if (!value.integer) fail(where, "is not an integer");
    return *value.integer;
  }

  std::optional<double> optional_number(const Value& object, const std::string& key, const std::string& where) const {
    const Value* value = object.find(key);
    if (value == nullptr || value->is_null()) return std::nullopt;
    return of_type(*value, Value::Type::Number, join(where, key)).number;
  }

  std::vector<std::string> strings(const Value& value, const std::string& where) const {
    std::vector<std::string> out;
    const auto& items = of_type(value, Value::Type::Array, where).array;
    for (size_t i = 0; i < items.size(); ++i) {
      out.push_back(of_type(items[i], Value::Type::String, where + "[" + std::to_string(i) + "]").string);
    }
    return out;
  }

  static std::string join(const std::string& where, const std::string& key) {
    return where.empty() ? key : where + "." + key;
  }

  const std::string& root() const { return root_; }

 private:
  std::string root_;
};

std::string read_small_file(const fs::path& path, size_t limit, const std::string& root) {
  std::error_code ec;
  auto status = fs::symlink_status(path, ec);
  if (ec || !fs::exists(status)) {
    throw PackageError(root + " is not an hstu-export package: " + path.filename().string() + " is missing");
  }
  if (!fs::is_regular_file(status)) {
    throw PackageError(root + ": " + path.filename().string() + " is not a regular file (links are refused)");
  }
  auto size = fs::file_size(path, ec);
  if (ec || size > limit) {
    throw PackageError(root + ": " + path.filename().string() + " is larger than " + std::to_string(limit >> 20) +
                       " MiB; it is not a manifest hstu-export wrote");
  }
  std::ifstream in(path, std::ios::binary);
  std::string data(static_cast<size_t>(size), '\0');
  if (!in.read(data.data(), static_cast<std::streamsize>(size))) {
    throw PackageError(root + ": cannot read " + path.filename().string());
  }
  return data;
}

// A plain relative POSIX path: not empty, no leading '/', no '\', no control characters, no empty,
// '.' or '..' part.
bool plain_relative_path(const std::string& path) {
  if (path.empty() || path.front() == '/' || path.back() == '/') return false;
  for (char c : path) {
    if (c == '\\' || static_cast<unsigned char>(c) < 0x20) return false;
  }
  size_t start = 0;
  while (start <= path.size()) {
    size_t end = path.find('/', start);
    if (end == std::string::npos) end = path.size();
    std::string part = path.substr(start, end - start);
    if (part.empty() || part == "." || part == "..") return false;
    start = end + 1;
  }
  return true;
}

// root/relative as a regular file reached through real directories only (no links anywhere).
fs::path inside(const fs::path& root, const std::string& relative, const std::string& what) {
  if (!plain_relative_path(relative)) {
    throw PackageError(root.string() + ": " + what + " " + in_quotes(relative) +
                       " is not a plain relative path inside the package; refusing it");
  }
  fs::path current = root;
  std::error_code ec;
  std::string rest = relative;
  while (true) {
    size_t slash = rest.find('/');
    current /= rest.substr(0, slash);
    auto status = fs::symlink_status(current, ec);
    if (ec || !fs::exists(status)) throw PackageError(root.string() + ": " + what + " " + in_quotes(relative) + " is missing");
    if (fs::is_symlink(status)) {
      throw PackageError(root.string() + ": " + what + " " + in_quotes(relative) + " goes through a link; refusing it");
    }
    if (slash == std::string::npos) {
      if (!fs::is_regular_file(status)) {
        throw PackageError(root.string() + ": " + what + " " + in_quotes(relative) + " is not a regular file");
      }
      return current;
    }
    if (!fs::is_directory(status)) {
      throw PackageError(root.string() + ": " + what + " " + in_quotes(relative) + " is missing");
    }
    rest = rest.substr(slash + 1);
  }
}

std::string dtype_name(at::ScalarType type) {
  static const std::pair<at::ScalarType, const char*> kNames[] = {
      {at::kLong, "int64"},   {at::kInt, "int32"},      {at::kFloat, "float32"}, {at::kBFloat16, "bfloat16"},
      {at::kHalf, "float16"}, {at::kDouble, "float64"}, {at::kBool, "bool"},
  };
  for (const auto& [type_, text] : kNames) {
    if (type_ == type) return text;
  }
  return c10::toString(type);
}

std::vector<std::string> split(const std::string& text, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= text.size()) {
    size_t end = text.find(sep, start);
    if (end == std::string::npos) end = text.size();
    if (end > start) out.push_back(text.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

// Loads each named op library once per process (dlopen RTLD_NOW | RTLD_GLOBAL: the library registers its
// ops with the dispatcher, and later libraries and artifacts resolve against its symbols).
void load_op_libraries(const std::vector<std::string>& names, const Options& options, const std::string& root) {
  static std::mutex mutex;
  static std::set<std::string> loaded;
  std::lock_guard<std::mutex> lock(mutex);
  std::vector<std::string> dirs = options.op_library_dirs;
  if (const char* env = std::getenv("HSTU_EXPORT_OP_LIBRARY_PATH")) {
    for (auto& dir : split(env, ':')) dirs.push_back(dir);
  }
  for (auto& dir : split(HSTU_EXPORT_DEFAULT_OP_LIBRARY_DIRS, ':')) dirs.push_back(dir);
  for (const auto& name : names) {
    if (loaded.count(name)) continue;
    const OpLibrary* library = nullptr;
    for (const auto& known : kOpLibraries) {
      if (name == known.name) library = &known;
    }
    if (library == nullptr) {
      throw PackageError(root + " names the op library " + in_quotes(name) + ", which is not one the runtime loads (" +
                         "fbgemm_gpu, torch_tensorrt); a package cannot make the runtime load other code");
    }
    if (library->file == nullptr) throw PackageError(root + " cannot be served from C++: " + library->no_cpp_hint);
    std::string found;
    for (const auto& dir : dirs) {
      std::error_code ec;
      if (fs::is_regular_file(fs::path(dir) / library->file, ec)) {
        found = (fs::path(dir) / library->file).string();
        break;
      }
    }
    if (found.empty()) {
      throw PackageError(root + " needs the op library " + name + " (" + library->file + "), found in none of [" +
                         joined(dirs) + "]; pass its directory with --op-library-dir (Options::op_library_dirs) or " +
                         "HSTU_EXPORT_OP_LIBRARY_PATH (for fbgemm_gpu: the fbgemm_gpu folder of its installed package)");
    }
    std::vector<std::string> files = {found};
    for (const auto& companion : kCompanionLibraries) {
      std::error_code ec;
      auto beside = fs::path(found).parent_path() / companion.file;
      if (name == companion.name && fs::is_regular_file(beside, ec)) files.push_back(beside.string());
    }
    for (const auto& file : files) {
      if (dlopen(file.c_str(), RTLD_NOW | RTLD_GLOBAL) == nullptr) {
        const char* why = dlerror();
        throw PackageError(root + ": loading the op library " + file + " failed: " + first_line(why ? why : "?") +
                           "; it must be the build that matches this libtorch");
      }
    }
    loaded.insert(name);
  }
}

// The manifest's kv_cache section, checked against the package it is in: the delta program is a listed
// file; each of its inputs is a sparse output, a feature fed to the dense program, or one the cache makes;
// it returns the package's outputs; the request has the features the cache's reuse checks read.
// object[key], an integer of at least 1.
int64_t positive_field(const Fields& fields, const Value& object, const std::string& key, const std::string& at) {
  int64_t value = fields.integer(fields.member(object, key, at), Fields::join(at, key));
  if (value < 1) fields.fail(Fields::join(at, key), "is below 1");
  return value;
}

// A KV-cache section's page_size: a power of two of at least 16 (a key block never straddles a page).
int64_t page_size_field(const Fields& fields, const Value& kv, const std::string& where) {
  int64_t page_size = positive_field(fields, kv, "page_size", where);
  if (page_size < 16 || (page_size & (page_size - 1)) != 0) {
    fields.fail(where + ".page_size", "is not a power of two of at least 16");
  }
  return page_size;
}

detail::KVSection read_kv_section(const Fields& fields, const Value& manifest, const Value& kv,
                                  const std::map<std::string, fs::path>& listed, const Package::Impl& impl) {
  detail::KVSection out;
  const std::string where = "kv_cache";
  out.program_file = fields.string(kv, "program", where);
  if (!listed.count(out.program_file)) fields.fail(where + ".program", "names a file that files does not list");
  out.program = listed.at(out.program_file);
  out.inputs = fields.strings(fields.member(kv, "inputs", where), where + ".inputs");
  out.outputs = fields.strings(fields.member(kv, "outputs", where), where + ".outputs");
  auto positive = [&](const Value& object, const std::string& key, const std::string& at) {
    return positive_field(fields, object, key, at);
  };
  out.page_size = page_size_field(fields, kv, where);
  out.max_seq_len = positive(kv, "max_seq_len", where);
  const Value& layout = fields.member(kv, "layout", where);
  const std::string at = where + ".layout";
  out.num_layers = positive(layout, "num_layers", at);
  out.num_heads = positive(layout, "num_heads", at);
  out.attention_dim = positive(layout, "attention_dim", at);
  out.linear_dim = positive(layout, "linear_dim", at);
  out.num_time_buckets = positive(layout, "num_time_buckets", at);
  out.contextual_features = fields.strings(fields.member(layout, "contextual_features", at), at + ".contextual_features");
  out.time_bucket_base = fields.of_type(fields.member(layout, "time_bucket_base", at), Value::Type::Number,
                                        at + ".time_bucket_base").number;
  if (!(out.time_bucket_base > 0)) fields.fail(at + ".time_bucket_base", "is not positive");
  std::string dtype = fields.string(manifest, "dtype", "");
  auto type = scalar_type(dtype);
  if (!type || !at::isFloatingType(*type)) fields.fail("dtype", "is " + in_quotes(dtype) + ", not a floating dtype");
  out.dtype = *type;
  const Value& lengths = fields.member(fields.member(manifest, "ranges", ""), "lengths", "ranges");
  if (const Value* low = fields.member(lengths, "min_lengths", "ranges.lengths").find(detail::kHistoryLengths)) {
    out.min_history = fields.integer(*low, std::string("ranges.lengths.min_lengths.") + detail::kHistoryLengths);
  }
  const Value& highs = fields.member(lengths, "max_lengths", "ranges.lengths");
  out.max_history = positive(highs, detail::kHistoryLengths, "ranges.lengths.max_lengths");
  out.max_candidates = positive(highs, detail::kCandidateLengths, "ranges.lengths.max_lengths");
  if (const Value* bounds = kv.find("bounds"); bounds != nullptr && !bounds->is_null()) {
    out.bound_batch = positive(*bounds, "batch", where + ".bounds");
    out.bound_history = positive(*bounds, "new_history", where + ".bounds");
    out.bound_candidates = positive(*bounds, "candidates", where + ".bounds");
  } else {  // written before the bounds were recorded: kv_export.py's legacy_program_bounds (16: its EXAMPLE_USERS)
    int64_t max_batch = fields.integer(fields.member(lengths, "max_batch_size", "ranges.lengths"),
                                       "ranges.lengths.max_batch_size");
    out.bound_batch = std::max<int64_t>(max_batch, 16);
    out.bound_history = std::max<int64_t>(out.bound_batch * out.max_history, 5);
    out.bound_candidates = std::max<int64_t>(out.bound_batch * out.max_candidates, 5);
  }
  if (const Value* fits = kv.find("fits_counts"); fits != nullptr) {  // absent: written before the program did
    out.fits_counts = fields.of_type(*fits, Value::Type::Bool, where + ".fits_counts").boolean;
  }

  // What the cache reads of every request: the zoo ranking model's history, candidates and times.
  std::vector<std::string> needed = {detail::kHistoryLengths, detail::kCandidateLengths, detail::kQueryTime};
  needed.insert(needed.end(), detail::kTokenRows.begin(), detail::kTokenRows.end());
  needed.insert(needed.end(), out.contextual_features.begin(), out.contextual_features.end());
  for (const auto& name : needed) {
    bool found = std::any_of(impl.features.begin(), impl.features.end(), [&](const Feature& f) { return f.name == name; });
    if (!found) fields.fail(where, "needs the request feature " + in_quotes(name) + ", which input_schema lacks");
  }
  const auto& sparse = impl.artifacts.at("sparse").outputs;
  const auto& dense = impl.artifacts.at("dense").inputs;
  const std::set<std::string> made = {"contextual_emb", "kv_cached", "kv_k_pages", "kv_v_pages", "kv_page_table"};
  for (const auto& name : out.inputs) {
    bool from_sparse = std::find(sparse.begin(), sparse.end(), name) != sparse.end();
    bool from_feature = std::any_of(dense.begin(), dense.end(), [&](const TensorSpec& s) {
      return s.name == name && !s.feature.empty();
    });
    if (!from_sparse && !from_feature && !made.count(name)) {
      fields.fail(where + ".inputs", "takes " + in_quotes(name) + ", which is neither a sparse output, a feature nor " +
                                         "a cache input (an older or newer hstu-export wrote it: re-export with --kv-cache)");
    }
  }
  for (const auto& name : made) {
    if (std::find(out.inputs.begin(), out.inputs.end(), name) == out.inputs.end()) {
      fields.fail(where + ".inputs", "lacks " + in_quotes(name) + "; an older hstu-export wrote it: re-export with --kv-cache");
    }
  }
  auto sorted = [](std::vector<std::string> names) {
    std::sort(names.begin(), names.end());
    return names;
  };
  if (sorted(out.outputs) != sorted(impl.output_names)) {
    fields.fail(where + ".outputs", "is not the package's outputs [" + joined(impl.output_names) + "]; an older " +
                                        "hstu-export wrote it (it returned the new K/V): re-export with --kv-cache");
  }
  return out;
}

// kv_cache of kind "derived" (hstu_export/kv_derived_export.py): the delta and counts programs, their inputs
// (each a dense input of the package or one the cache makes), and the pages' layout.
detail::DerivedKVSection read_derived_kv_section(const Fields& fields, const Value& manifest, const Value& kv,
                                                 const std::map<std::string, fs::path>& listed,
                                                 const Package::Impl& impl) {
  detail::DerivedKVSection out;
  const std::string where = "kv_cache";
  if (kv.find("counts_program") == nullptr && kv.find("counts") != nullptr) {
    fields.fail(where + ".counts", "is a torch.export counts program of an older hstu-export; re-export the model with --kv-cache");
  }
  auto listed_file = [&](const std::string& key, std::string* file) {
    *file = fields.string(kv, key, where);
    if (!listed.count(*file)) fields.fail(where + "." + key, "names a file that files does not list");
    return listed.at(*file);
  };
  out.program = listed_file("program", &out.program_file);
  out.counts = listed_file("counts_program", &out.counts_file);
  out.inputs = fields.strings(fields.member(kv, "inputs", where), where + ".inputs");
  out.counts_inputs = fields.strings(fields.member(kv, "counts_inputs", where), where + ".counts_inputs");
  out.outputs = fields.strings(fields.member(kv, "outputs", where), where + ".outputs");
  auto positive = [&](const Value& object, const std::string& key, const std::string& at) {
    return positive_field(fields, object, key, at);
  };
  out.page_size = page_size_field(fields, kv, where);
  const Value& layout = fields.member(kv, "layout", where);
  const std::string at = where + ".layout";
  out.max_seq_len = positive(layout, "max_seq_len", at);
  out.num_layers = positive(layout, "num_layers", at);
  out.num_heads = positive(layout, "num_heads", at);
  out.attention_dim = positive(layout, "attention_dim", at);
  out.linear_dim = positive(layout, "linear_dim", at);
  out.row_width = positive(layout, "row_width", at);
  if (const Value* reads = kv.find("device_reads"); reads != nullptr && !reads->is_null()) {
    out.device_reads = fields.integer(*reads, where + ".device_reads");
    if (out.device_reads < 0) fields.fail(where + ".device_reads", "is negative");
  }
  std::string row_dtype = fields.string(layout, "row_dtype", at);
  auto row_type = scalar_type(row_dtype);
  if (!row_type || !at::isFloatingType(*row_type)) fields.fail(at + ".row_dtype", "is " + in_quotes(row_dtype) + ", not a floating dtype");
  out.row_dtype = *row_type;
  std::string dtype = fields.string(manifest, "dtype", "");
  auto type = scalar_type(dtype);
  if (!type || !at::isFloatingType(*type)) fields.fail("dtype", "is " + in_quotes(dtype) + ", not a floating dtype");
  out.dtype = *type;

  const auto& dense = impl.artifacts.at("dense").inputs;
  auto is_dense = [&](const std::string& name) {
    return std::any_of(dense.begin(), dense.end(), [&](const TensorSpec& s) { return s.name == name; });
  };
  const std::set<std::string> made = {"kv_cached", "kv_k_pages", "kv_v_pages", "kv_x_pages", "kv_page_table"};
  // kv_new_rows: the rows past each cached prefix, given by the runtime (an older export's program counts them
  // itself); kv_target_rows: the targets' among them (a program whose last layer runs on the targets alone).
  // An input of the sparse artifact that names its feature: fed from the request (the ids a frontier row is
  // compared as).
  auto request_feature = [&](const std::string& name) -> std::string {
    auto sparse = impl.artifacts.find("sparse");
    if (sparse == impl.artifacts.end()) return "";
    for (const auto& spec : sparse->second.inputs) {
      if (spec.name == name) return spec.feature;
    }
    return "";
  };
  if (const Value* inside = kv.find("sparse_inside"); inside != nullptr && !inside->is_null()) {
    const std::string at_inside = where + ".sparse_inside";
    const Value& tables = fields.member(fields.of_type(*inside, Value::Type::Object, at_inside), "tables", at_inside);
    if (tables.type != Value::Type::Object) fields.fail(at_inside + ".tables", "is not an object");
    auto sparse = impl.artifacts.find("sparse");
    for (const auto& [name, table] : tables.object) {
      if (table.type != Value::Type::String) fields.fail(at_inside + ".tables." + name, "is not a table name");
      const bool held = sparse != impl.artifacts.end() &&
                        std::any_of(sparse->second.constants.begin(), sparse->second.constants.end(),
                                    [&](const detail::TableSpec& spec) { return spec.name == table.string; });
      if (!held) fields.fail(at_inside + ".tables." + name, "names " + in_quotes(table.string) + ", which the sparse half's tables do not hold");
      if (std::find(out.inputs.begin(), out.inputs.end(), name) == out.inputs.end()) {
        fields.fail(at_inside + ".tables", "names " + in_quotes(name) + ", which kv_cache.inputs does not take");
      }
      out.table_inputs[name] = table.string;
    }
    out.sparse_inside = true;
  }
  for (const auto& name : out.inputs) {
    if (out.sparse_inside) {
      auto spec = std::find_if(dense.begin(), dense.end(), [&](const TensorSpec& s) { return s.name == name; });
      if (spec != dense.end() && spec->feature.empty()) {
        fields.fail(where + ".inputs", "takes " + in_quotes(name) + ", an output of the sparse half, which the program "
                    "holds (kv_cache.sparse_inside)");
      }
    }
    if (out.table_inputs.count(name)) continue;
    if (is_dense(name) || made.count(name) || name == "kv_new_rows" || name == "kv_target_rows") continue;
    std::string feature = request_feature(name);
    if (feature.empty()) {
      fields.fail(where + ".inputs", "takes " + in_quotes(name) + ", which is neither a dense input, a cache input nor a "
                  "sparse input fed from the request");
    }
    out.request_inputs[name] = feature;
  }
  for (const auto& name : made) {
    if (std::find(out.inputs.begin(), out.inputs.end(), name) == out.inputs.end()) {
      fields.fail(where + ".inputs", "lacks " + in_quotes(name) + "; another hstu-export wrote it: re-export with --kv-cache");
    }
  }
  for (const auto& name : out.counts_inputs) {
    if (!is_dense(name)) fields.fail(where + ".counts_inputs", "takes " + in_quotes(name) + ", which is not a dense input");
  }
  if (const Value* sums = kv.find("counts_on_host"); sums != nullptr && !sums->is_null()) {
    auto sum = [&](const std::string& part) {
      const std::string at_part = where + ".counts_on_host." + part;
      const Value& entry = fields.member(*sums, part, where + ".counts_on_host");
      detail::DerivedKVSection::HostSum out_sum;
      out_sum.constant = fields.integer(fields.member(entry, "constant", at_part), at_part + ".constant");
      const Value& terms = fields.member(entry, "terms", at_part);
      if (terms.type != Value::Type::Object) fields.fail(at_part + ".terms", "is not an object");
      for (const auto& [name, k] : terms.object) {
        auto spec = std::find_if(dense.begin(), dense.end(), [&](const TensorSpec& s) { return s.name == name; });
        if (std::find(out.counts_inputs.begin(), out.counts_inputs.end(), name) == out.counts_inputs.end() ||
            spec == dense.end() || spec->feature.empty()) {
          fields.fail(at_part + ".terms", "names " + in_quotes(name) + ", which is not a counts input fed from the request");
        }
        out_sum.terms.emplace_back(spec->feature, fields.integer(k, at_part + ".terms." + name));
      }
      return out_sum;
    };
    out.host_counts = std::make_pair(sum("seq_lengths"), sum("num_targets"));
    if (out.host_counts->first.terms.empty()) fields.fail(where + ".counts_on_host.seq_lengths.terms", "is empty");
  }
  std::vector<std::string> answers(out.outputs);
  if (answers.empty() || answers.back() != "kv_stale") fields.fail(where + ".outputs", "does not end with kv_stale");
  answers.pop_back();
  std::vector<std::string> names(impl.output_names);
  std::sort(answers.begin(), answers.end());
  std::sort(names.begin(), names.end());
  if (answers != names) fields.fail(where + ".outputs", "is not the package's outputs [" + joined(impl.output_names) + "] and kv_stale");
  if (const Value* padding = kv.find("padding"); padding != nullptr && !padding->is_null()) {
    // Which input each output's rows follow: a request feature, a cache input, or "" (serving/kv_padding.py).
    const std::string at_rows = where + ".padding.rows_of";
    const std::string what = "is not an object naming, for each output, the request feature or cache input whose "
                             "rows it follows (or \"\")";
    const Value* rows = fields.of_type(*padding, Value::Type::Object, where + ".padding").find("rows_of");
    if (rows == nullptr || rows->type != Value::Type::Object) fields.fail(at_rows, what);
    std::set<std::string> known = {"", "kv_cached", "kv_page_table", "kv_target_rows"};
    for (const auto& f : impl.features) known.insert(f.name);
    detail::PaddingSpec spec;
    for (const auto& [output, follows] : rows->object) {
      if (follows.type != Value::Type::String || !known.count(follows.string)) fields.fail(at_rows, what);
      spec.rows_of[output] = follows.string;
    }
    if (std::set<std::string>(out.outputs.begin(), out.outputs.end()) != [&] {
          std::set<std::string> keys;
          for (const auto& [output, follows] : spec.rows_of) keys.insert(output);
          return keys;
        }()) {
      fields.fail(at_rows, what);
    }
    if (const Value* targets = kv.find("target_inputs"); targets != nullptr && targets->type == Value::Type::Array) {
      for (const auto& name : targets->array) {
        if (name.type != Value::Type::String) fields.fail(where + ".target_inputs", "is not a list of input names");
        auto spec_of = std::find_if(dense.begin(), dense.end(), [&](const TensorSpec& s) { return s.name == name.string; });
        if (spec_of != dense.end() && !spec_of->feature.empty()) spec.target_features.insert(spec_of->feature);
      }
    }
    out.padding = std::move(spec);
  }
  return out;
}

// artifacts.<role>.constants: a listed safetensors file that is no artifact, and its tables, each named once with
// its dtype and static shape.
void read_constants_entry(const Fields& fields, const Value& entry, const std::string& where,
                          const std::map<std::string, fs::path>& listed, const Value& backend_files, Artifact& artifact) {
  const std::string file = fields.string(entry, "file", where);
  if (!listed.count(file)) fields.fail(where + ".file", "names " + in_quotes(file) + ", which the manifest's files do not list");
  for (const auto& [role, other] : backend_files.object) {
    if (other.type == Value::Type::String && other.string == file) fields.fail(where + ".file", "is also backend.files." + role);
  }
  if (fields.string(entry, "format", where) != "safetensors") fields.fail(where + ".format", "is not \"safetensors\"");
  const auto& tensors = fields.of_type(fields.member(entry, "tensors", where), Value::Type::Array, where + ".tensors");
  std::set<std::string> seen;
  for (size_t i = 0; i < tensors.array.size(); ++i) {
    const std::string at = where + ".tensors[" + std::to_string(i) + "]";
    detail::TableSpec spec{fields.string(tensors.array[i], "name", at), fields.string(tensors.array[i], "dtype", at), {}};
    if (!detail::is_table_dtype(spec.dtype)) fields.fail(at + ".dtype", "is " + in_quotes(spec.dtype) + ", not a table dtype");
    const auto& shape = fields.of_type(fields.member(tensors.array[i], "shape", at), Value::Type::Array, at + ".shape");
    for (const auto& dim : shape.array) {
      int64_t size = fields.integer(dim, at + ".shape");
      if (size < 0) fields.fail(at + ".shape", "has a negative size");
      spec.shape.push_back(size);
    }
    if (!seen.insert(spec.name).second) fields.fail(at + ".name", "lists " + in_quotes(spec.name) + " twice");
    artifact.constants.push_back(std::move(spec));
  }
  artifact.constants_file = file;
}

}  // namespace

Package::Package(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Package::~Package() = default;

const std::string& Package::path() const { return impl_->root; }
const std::string& Package::backend() const { return impl_->backend; }
const std::string& Package::sparse_model() const { return impl_->sparse_model; }
c10::Device Package::device() const { return impl_->device; }
int64_t Package::max_batch_size() const { return impl_->max_batch_size; }
const std::vector<Feature>& Package::features() const { return impl_->features; }
const std::vector<std::string>& Package::output_names() const { return impl_->output_names; }

namespace detail {

std::optional<int64_t> published_version(const std::string& path) {
  const fs::path root(path);
  std::error_code ec;
  if (fs::exists(root / kManifest, ec) || !fs::is_symlink(root / "current", ec)) return std::nullopt;
  const std::string target = fs::read_symlink(root / "current", ec).string();
  const bool number = !ec && !target.empty() && target.size() < 18 && target[0] != '0' &&
                      std::all_of(target.begin(), target.end(), [](unsigned char c) { return std::isdigit(c); });
  if (!number || fs::is_symlink(root / target, ec) || !fs::is_directory(root / target, ec)) {
    throw PackageError(path + "/current points at '" + target + "', not at a published version; point it again "
                       "with `hstu-export publish --to " + path + " --switch N`");
  }
  return std::stoll(target);
}

}  // namespace detail

namespace {

// A directory hstu-export publish writes: the path of its current version. Any other path as it is.
std::string published_current(const std::string& path) {
  std::optional<int64_t> version = detail::published_version(path);
  return version ? (fs::path(path) / std::to_string(*version)).string() : path;
}

// The compiled sparse half's model to run after run() has checked a request against the manifest's ranges
// (`features`, `max_batch_size`): the prechecked model `sparse_program` (backend.meta.sparse_program) names when
// every range its check was replaced for holds the manifest's; nullopt otherwise (the checked model then refuses
// what a manifest wider than its programs lets past). As runtimes/aoti.py prechecked_applies decides.
std::optional<std::string> prechecked_model(const Value* sparse_program, const std::vector<Feature>& features,
                                            int64_t max_batch_size) {
  const Value* prechecked = sparse_program != nullptr ? sparse_program->find("prechecked") : nullptr;
  const Value* model = prechecked != nullptr ? prechecked->find("model") : nullptr;
  const Value* ranges = prechecked != nullptr ? prechecked->find("ranges") : nullptr;
  if (model == nullptr || model->type != Value::Type::String || ranges == nullptr || ranges->type != Value::Type::Object) {
    return std::nullopt;
  }
  for (const auto& [name, bounds] : ranges->object) {
    auto feature = std::find_if(features.begin(), features.end(), [&](const Feature& f) { return f.name == name; });
    if (feature == features.end() || bounds.type != Value::Type::Array || bounds.array.size() != 3) return std::nullopt;
    for (const auto& bound : bounds.array) {
      if (!bound.is_null() && !bound.integer) return std::nullopt;
    }
    const auto& low = bounds.array[0].integer;
    const auto& high = bounds.array[1].integer;
    const auto& rows = bounds.array[2].integer;
    if ((low && (!feature->min_value || *feature->min_value < static_cast<double>(*low))) ||
        (high && (!feature->max_value || *feature->max_value > static_cast<double>(*high))) ||
        (rows && max_batch_size > *rows)) {
      return std::nullopt;
    }
  }
  return model->string;
}

}  // namespace

std::shared_ptr<const Package> Package::open(const std::string& given, const Options& options) {
  const std::string path = published_current(given);
  auto impl = std::make_unique<Impl>();
  impl->root = path;
  impl->concurrency = std::max<size_t>(options.concurrency, 1);
  const fs::path root(path);
  std::error_code ec;
  if (!fs::is_directory(root, ec)) throw PackageError(path + " is not a package directory (no such directory)");

  // The manifest's own checksum first: nothing of it is trusted before.
  std::string manifest_bytes = read_small_file(root / kManifest, kMaxManifestBytes, path);
  std::string sum_line = read_small_file(root / kManifestSha256, 4096, path);
  std::string expected = sum_line.substr(0, sum_line.find_first_of(" \t\n"));
  if (expected.size() != 64 || sum_line.find(kManifest) == std::string::npos) {
    throw PackageError(path + ": " + kManifestSha256 + " is not a sha256sum line for " + kManifest + "; re-export it");
  }
  if (sha256_hex(manifest_bytes) != expected) {
    throw PackageError(path + ": " + kManifest + " does not match " + kManifestSha256 +
                       " (edited or damaged after export); re-export it or restore the original");
  }
  Value manifest;
  try {
    manifest = json::parse(manifest_bytes);
  } catch (const json::ParseError& exc) {
    throw PackageError(path + ": " + kManifest + " is not valid JSON (" + exc.what() + ")");
  }
  Fields fields(path);
  if (manifest.type != Value::Type::Object || manifest.find("format") == nullptr ||
      !manifest.find("format")->string.starts_with(kFormat)) {
    throw PackageError(path + " is not an hstu-export package (its manifest has no format '" + kFormat + "')");
  }
  if (fields.string(manifest, "format", "") != kFormat) {
    throw PackageError(path + ": unknown package format " + in_quotes(manifest.find("format")->string));
  }
  int64_t version = fields.integer(fields.member(manifest, "format_version", ""), "format_version");
  if (version < kOldestReadableFormat || version > kPackageFormatVersion) {
    throw PackageError(path + " is package format " + std::to_string(version) + "; this runtime reads formats " +
                       std::to_string(kOldestReadableFormat) + " to " + std::to_string(kPackageFormatVersion) +
                       ": re-export the model with a matching hstu-export");
  }
  if (fields.string(manifest, "op_namespace", "") != "hstu_export") {
    throw PackageError(path + ": op namespace " + in_quotes(fields.string(manifest, "op_namespace", "")) +
                       " is not hstu_export; re-export it");
  }

  // Every file the manifest lists: inside the package, and unchanged.
  const auto& files = fields.of_type(fields.member(manifest, "files", ""), Value::Type::Object, "files");
  std::map<std::string, fs::path> listed;
  for (const auto& [relative, digest] : files.object) {
    const std::string& hex = fields.of_type(digest, Value::Type::String, "files." + relative).string;
    fs::path file = inside(root, relative, "file");
    listed[relative] = file;
    if (options.verify_checksums) {
      std::string actual;
      try {
        actual = sha256_file_hex(file.string());
      } catch (const std::exception& exc) {
        throw PackageError(path + ": " + exc.what());
      }
      if (actual != hex) {
        throw PackageError(path + ": " + relative + " does not match its checksum in the manifest (changed or " +
                           "damaged after export); re-export the package");
      }
    }
  }

  // The torch the artifacts were compiled with.
  std::string built = fields.string(fields.member(manifest, "versions", ""), "torch", "versions");
  std::string here = std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR);
  auto parts = split(built.substr(0, built.find('+')), '.');
  if (parts.size() < 2 || parts[0] + "." + parts[1] != here) {
    throw PackageError(path + " was built with torch " + built.substr(0, 40) + " but this runtime uses libtorch " +
                       here + "; compiled artifacts only load with the same torch major.minor: re-export it with " +
                       "torch " + here + " or build the runtime against torch " + built.substr(0, 40));
  }
  std::string device_type = fields.string(fields.member(manifest, "device", ""), "type", "device");
  if (device_type == "cuda") {
    if (!torch::cuda::is_available()) {
      throw PackageError(path + " is a CUDA package but this process has no usable CUDA device (or a CPU libtorch)");
    }
    const int64_t devices = static_cast<int64_t>(torch::cuda::device_count());
    if (options.device_index < 0 || options.device_index >= devices) {
      throw Error("CUDA device " + std::to_string(options.device_index) + " asked for, but this process sees " +
                  std::to_string(devices) + " (cuda:0 to cuda:" + std::to_string(devices - 1) + ")");
    }
    impl->device = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(options.device_index));
  } else if (device_type != "cpu") {
    fields.fail("device.type", "is " + in_quotes(device_type) + ", expected cpu or cuda");
  }

  // The request schema and ranges.
  const auto& schema = fields.member(manifest, "input_schema", "");
  const auto& feature_list =
      fields.of_type(fields.member(schema, "features", "input_schema"), Value::Type::Array, "input_schema.features");
  std::set<std::string> feature_names;
  for (size_t i = 0; i < feature_list.array.size(); ++i) {
    const Value& item = feature_list.array[i];
    std::string where = "input_schema.features[" + std::to_string(i) + "]";
    Feature f;
    f.name = fields.string(item, "name", where);
    f.dtype = fields.string(item, "dtype", where);
    if (!scalar_type(f.dtype)) fields.fail(where + ".dtype", "is " + in_quotes(f.dtype) + ", not a dtype a request may have");
    f.kind = fields.string(item, "kind", where);
    if (f.kind != "lengths" && f.kind != "jagged" && f.kind != "per_user") {
      fields.fail(where + ".kind", "is " + in_quotes(f.kind) + ", expected lengths, jagged or per_user");
    }
    f.jagged_by = fields.optional_string(item, "jagged_by", where);
    f.same_as = fields.optional_string(item, "same_as", where);
    f.min_value = fields.optional_number(item, "min_value", where);
    f.max_value = fields.optional_number(item, "max_value", where);
    if (const Value* trailing = item.find("trailing")) {
      const auto& sizes = fields.of_type(*trailing, Value::Type::Array, where + ".trailing").array;
      for (size_t k = 0; k < sizes.size(); ++k) {
        int64_t size = fields.integer(sizes[k], where + ".trailing[" + std::to_string(k) + "]");
        if (size < 0) fields.fail(where + ".trailing", "has a negative size");
        f.trailing.push_back(size);
      }
    }
    if (!feature_names.insert(f.name).second) fields.fail(where + ".name", "repeats " + in_quotes(f.name));
    impl->features.push_back(std::move(f));
  }
  for (const auto& f : impl->features) {
    const std::string& by = f.kind == "jagged" ? f.jagged_by : f.same_as;
    if (by.empty() && f.kind != "jagged") continue;
    auto target = std::find_if(impl->features.begin(), impl->features.end(), [&](const Feature& g) { return g.name == by; });
    if (target == impl->features.end() || target->kind != "lengths") {
      fields.fail("input_schema", "feature " + in_quotes(f.name) + " refers to " + in_quotes(by) + ", which is no lengths feature");
    }
  }
  impl->max_batch_size = fields.integer(fields.member(fields.member(manifest, "ranges", ""), "max_batch_size", "ranges"),
                                        "ranges.max_batch_size");
  if (impl->max_batch_size < 1) fields.fail("ranges.max_batch_size", "is below 1");
  impl->output_names = fields.strings(fields.member(manifest, "output_names", ""), "output_names");
  if (impl->output_names.empty()) fields.fail("output_names", "is empty");

  // The artifacts: file, format, positional inputs (fed from which feature) and outputs.
  const auto& backend = fields.member(manifest, "backend", "");
  impl->backend = fields.string(backend, "name", "backend");
  const auto& backend_files = fields.of_type(fields.member(backend, "files", "backend"), Value::Type::Object, "backend.files");
  const auto& artifacts = fields.member(manifest, "artifacts", "");
  for (const auto& [role, file_value] : backend_files.object) {
    std::string where = "artifacts." + role;
    const std::string& file = fields.of_type(file_value, Value::Type::String, "backend.files." + role).string;
    const Value& entry = fields.member(artifacts, role, "artifacts");
    Artifact artifact;
    artifact.file = fields.string(entry, "file", where);
    if (artifact.file != file) fields.fail(where + ".file", "is not backend.files." + role);
    if (!listed.count(file)) fields.fail("files", "does not list the artifact " + in_quotes(file));
    artifact.format = fields.string(entry, "format", where);
    const auto& inputs = fields.of_type(fields.member(entry, "inputs", where), Value::Type::Array, where + ".inputs");
    for (size_t i = 0; i < inputs.array.size(); ++i) {
      std::string at = where + ".inputs[" + std::to_string(i) + "]";
      TensorSpec spec{fields.string(inputs.array[i], "name", at), fields.optional_string(inputs.array[i], "feature", at)};
      if (!spec.feature.empty() && !feature_names.count(spec.feature)) {
        fields.fail(at + ".feature", "names " + in_quotes(spec.feature) + ", which is not in input_schema");
      }
      if (!spec.feature.empty()) {
        // Requests are checked against the schema's dtype: it must be the one the artifact takes.
        const std::string takes = fields.string(inputs.array[i], "dtype", at);
        auto f = std::find_if(impl->features.begin(), impl->features.end(),
                              [&](const Feature& g) { return g.name == spec.feature; });
        if (f != impl->features.end() && f->dtype != takes) {
          fields.fail("input_schema.features." + spec.feature + ".dtype",
                      "is " + in_quotes(f->dtype) + " but " + at + " takes " + in_quotes(takes));
        }
      }
      artifact.inputs.push_back(std::move(spec));
    }
    const auto& outputs = fields.of_type(fields.member(entry, "outputs", where), Value::Type::Array, where + ".outputs");
    for (size_t i = 0; i < outputs.array.size(); ++i) {
      artifact.outputs.push_back(fields.string(outputs.array[i], "name", where + ".outputs[" + std::to_string(i) + "]"));
    }
    if (const Value* constants = entry.find("constants"); constants != nullptr) {
      read_constants_entry(fields, *constants, where + ".constants", listed, backend_files, artifact);
    } else if (role == "sparse" && artifact.format == "aoti" && version >= 5) {
      fields.fail(where + ".constants", "is missing (a compiled sparse program of this format holds no tables: they "
                  "are stored beside it)");
    }
    impl->artifacts[role] = std::move(artifact);
  }
  auto expect_roles = [&](std::set<std::string> roles, const std::string& formats) {
    std::set<std::string> have;
    for (const auto& [role, artifact] : impl->artifacts) have.insert(role);
    if (have != roles) fields.fail("backend.files", "does not hold the " + joined(roles) + " artifact(s) of " + impl->backend);
    for (const auto& [role, artifact] : impl->artifacts) {
      if (formats.find(role + "=" + artifact.format + ";") == std::string::npos) {
        fields.fail("artifacts." + role + ".format", "is " + in_quotes(artifact.format) + ", unexpected for " + impl->backend);
      }
    }
  };
  if (impl->backend == "torchscript") {
    expect_roles({"model"}, "model=torchscript;");
    for (const auto& spec : impl->artifacts["model"].inputs) {
      if (spec.feature.empty()) fields.fail("artifacts.model.inputs", "has an input not fed from the request");
    }
    if (impl->artifacts["model"].outputs != impl->output_names) fields.fail("artifacts.model.outputs", "differs from output_names");
  } else if (impl->backend == "aoti") {
    expect_roles({"sparse", "dense"}, "sparse=torchscript;sparse=aoti;dense=aoti;");
    const auto& sparse_outputs = impl->artifacts["sparse"].outputs;
    for (const auto& spec : impl->artifacts["sparse"].inputs) {
      if (spec.feature.empty()) fields.fail("artifacts.sparse.inputs", "has an input not fed from the request");
    }
    for (const auto& spec : impl->artifacts["dense"].inputs) {
      if (spec.feature.empty() &&
          std::find(sparse_outputs.begin(), sparse_outputs.end(), spec.name) == sparse_outputs.end()) {
        fields.fail("artifacts.dense.inputs", "takes " + in_quotes(spec.name) + ", neither a feature nor a sparse output");
      }
    }
    if (impl->artifacts["dense"].outputs != impl->output_names) fields.fail("artifacts.dense.outputs", "differs from output_names");
  } else {
    throw PackageError(path + " is a " + impl->backend + " package; the C++ runtime serves aoti and torchscript " +
                       "packages (export with --backend aoti or --backend torchscript)");
  }

  if (const Value* kv = manifest.find("kv_cache"); kv != nullptr && !kv->is_null()) {
    const Value* kind = kv->find("kind");
    if (impl->backend != "aoti") {
      impl->kv_problem = path + " has a KV-cache section but is a " + impl->backend + " package; re-export it with --backend aoti";
    } else if (kind != nullptr && !kind->is_null()) {
      // A delta program derived from a user's graph (hstu_export/kv_derive.py).
      try {
        std::string name = fields.string(*kv, "kind", "kv_cache");
        if (name != "derived") fields.fail("kv_cache.kind", "is " + in_quotes(name) + "; this runtime knows \"derived\"");
        impl->derived_kv = read_derived_kv_section(fields, manifest, *kv, listed, *impl);
      } catch (const PackageError& exc) {
        impl->kv_problem = exc.what();
      }
    } else {
      try {
        impl->kv = read_kv_section(fields, manifest, *kv, listed, *impl);
      } catch (const PackageError& exc) {
        impl->kv_problem = exc.what();  // raised when a cache is asked for; plain serving still works
      }
    }
  }

  // Op libraries before the artifacts that call them.
  load_op_libraries(fields.strings(fields.member(manifest, "op_libraries", ""), "op_libraries"), options, path);

  auto load_script = [&](const std::string& role) {
    try {
      auto module = torch::jit::load(listed.at(impl->artifacts[role].file).string(), impl->device);
      module.eval();
      return module;
    } catch (const std::exception& exc) {
      throw PackageError(path + ": TorchScript could not load " + impl->artifacts[role].file + ": " + error_text(exc));
    }
  };
  if (!options.tables_device.empty()) {
    if (options.tables_device != "cpu" && options.tables_device != "cuda") {
      throw PackageError("tables device " + in_quotes(options.tables_device) + ": expected cpu or cuda");
    }
    if (impl->artifacts.count("sparse") == 0 || impl->artifacts["sparse"].constants_file.empty()) {
      throw PackageError(path + " keeps its tables inside its programs: only a package of format 5 whose sparse half "
                         "is compiled (aoti) stores them apart; serve it without a tables device");
    }
    if (options.tables_device == "cuda" && !impl->device.is_cuda()) {
      throw PackageError(path + " is a cpu package: its tables cannot live on cuda (tables device cpu, or none)");
    }
  }
  if (impl->backend == "torchscript") {
    impl->model = load_script("model");
  } else {
    auto load_program = [&](const std::string& role, const std::string& model = "model") {
      try {
        return std::make_unique<detail::AotiProgram>(listed.at(impl->artifacts[role].file).string(), impl->device,
                                                     impl->concurrency, model);
      } catch (const std::exception& exc) {
        throw PackageError(path + ": AOTInductor could not load " + impl->artifacts[role].file +
                           (model == "model" ? "" : " (its model " + in_quotes(model) + ")") + ": " + error_text(exc));
      }
    };
    const Value* meta = backend.find("meta");
    const Value* program = meta != nullptr ? meta->find("sparse_program") : nullptr;
    if (impl->artifacts["sparse"].format == "aoti") {
      impl->sparse_model = prechecked_model(program, impl->features, impl->max_batch_size).value_or("model");
      impl->sparse_program = load_program("sparse", impl->sparse_model);
      const Artifact& sparse = impl->artifacts["sparse"];
      if (!sparse.constants_file.empty()) {
        const std::string what = path + ": " + sparse.constants_file;
        const bool on_host = options.tables_device == "cpu" && impl->device.is_cuda();
        std::unordered_map<std::string, at::Tensor> tables;
        try {
          tables = detail::read_tables(listed.at(sparse.constants_file).string(), sparse.constants,
                                       on_host ? c10::Device(c10::kCPU) : impl->device, what);
          if (on_host) {
            // A pinned host copy, handed to the program as a CUDA tensor over that memory: with unified addressing a
            // pinned page has one address on the host and the device, and its kernels read it over the bus.
            // (AOTInductor takes a CUDA program's constants only as CUDA tensors.)
            const auto cuda = impl->device;
            for (auto& [name, table] : tables) {
              if (table.numel() == 0) {
                table = at::empty(table.sizes(), table.options().device(cuda));
                continue;
              }
              at::Tensor pinned = table.contiguous().pin_memory();
              table = at::for_blob(pinned.data_ptr(), pinned.sizes())
                          .options(pinned.options().device(cuda))
                          .target_device(cuda)
                          .deleter([pinned](void*) {})
                          .make_tensor();
            }
          }
        } catch (const c10::OutOfMemoryError&) {
          throw PackageError(what + ": its tables do not fit in this process's " + (on_host ? "pinned host" : "GPU") +
                             " memory" + (on_host ? "" : "; serve them from host memory (--tables-device cpu)"));
        }
        try {
          impl->sparse_program->use_constants(std::move(tables), what);
        } catch (const PackageError&) {
          throw;
        } catch (const std::exception& exc) {
          throw PackageError(what + ": AOTInductor could not take its tables: " + error_text(exc));
        }
      }
      // Only to word a refusal: a map that does not read well names no feature, and serving is unchanged.
      const Value* checks = program != nullptr ? program->find("range_checks") : nullptr;
      if (checks != nullptr && checks->type == Value::Type::Object) {
        for (const auto& [key, entry] : checks->object) {
          if (entry.type == Value::Type::Array && entry.array.size() == 2 &&
              entry.array[0].type == Value::Type::String && entry.array[1].type == Value::Type::String &&
              (entry.array[1].string == "low" || entry.array[1].string == "high" || entry.array[1].string == "rows")) {
            impl->sparse_checks[key] = {entry.array[0].string, entry.array[1].string};
          }
        }
      }
    } else {
      impl->sparse = load_script("sparse");
    }
    impl->dense = load_program("dense");
    if (const Value* reads = meta != nullptr ? meta->find("dense_device_reads") : nullptr;
        reads != nullptr && !reads->is_null()) {
      impl->dense_device_reads = fields.integer(*reads, "backend.meta.dense_device_reads");
      if (impl->dense_device_reads < 0) fields.fail("backend.meta.dense_device_reads", "is negative");
    }
  }
  Graphs graphs = detail::resolve_graphs(path, impl->device, options.graphs, impl->graphs_unsafe());
  if (graphs != Graphs::kOff) {
    const Impl* self = impl.get();  // owned by the Package, which owns the graphs
    detail::RunProgram run = [self](const detail::ProgramInputs& inputs) {
      Tensors request(inputs.begin(), inputs.end());
      return self->dense->run(self->dense_inputs(request, self->sparse_outputs(request)));
    };
    impl->graphs = std::make_unique<detail::ShapeGraphs>(
        std::move(run), std::set<std::string>{}, /*capture=*/graphs == Graphs::kOn, /*max_graphs=*/16,
        options.graph_copy_limit > 0 ? options.graph_copy_limit : detail::kRequestCopyBytes, /*evict=*/false);
  }
  return std::shared_ptr<const Package>(new Package(std::move(impl)));
}

std::string Package::Impl::graphs_unsafe() const {
  const std::string why = root + " cannot be replayed from CUDA graphs: ";
  const std::string fix = "; serve it without graphs";
  if (backend != "aoti") return why + "it is a " + backend + " package (graphs replay AOTInductor programs)" + fix;
  if (!sparse_program) return why + "its sparse half is TorchScript, which reads sizes from the device" + fix;
  if (sparse_model == "model") {
    return why + "its compiled sparse half checks the request's ranges on the device (no prechecked model applies: "
                 "export with --prechecked-sparse on)" + fix;
  }
  if (dense_device_reads != 0) {
    return why + "its dense program reads " +
           (dense_device_reads < 0 ? std::string("an unrecorded number of") : std::to_string(dense_device_reads)) +
           " value(s) back from the device (backend.meta.dense_device_reads)" + fix;
  }
  return "";
}

bool Package::graphed() const { return impl_->graphs != nullptr; }

GraphCounts Package::graph_counts() const { return impl_->graphs ? impl_->graphs->counts() : GraphCounts{}; }

namespace {

// The smallest and largest value of a non-empty tensor, in one pass: a request's ids are read once, not once for
// the least and again for the greatest (32 users of 4096 history tokens: 131k ids a feature). Integers on the host
// are scanned on the calling thread: ATen's reduction fans out to torch's intra-op threads, which at 32 users took
// three times as long on average as one thread, with a long tail (docs/PERF_INVESTIGATIONS.md, "host round trips").
struct Extremes {
  c10::Scalar low, high;

  bool below(double bound) const { return low.to<double>() < bound; }
  bool above(double bound) const { return high.to<double>() > bound; }
  static std::string text(const c10::Scalar& v) {
    return v.isIntegral(/*includeBool=*/true) ? std::to_string(v.to<int64_t>()) : c10::str(v.to<double>());
  }
};

template <typename T>
Extremes scanned(const at::Tensor& t) {
  const T* p = t.const_data_ptr<T>();
  T low = p[0], high = p[0];
  for (int64_t i = 1, n = t.numel(); i < n; ++i) {
    low = std::min(low, p[i]);
    high = std::max(high, p[i]);
  }
  return {c10::Scalar(static_cast<int64_t>(low)), c10::Scalar(static_cast<int64_t>(high))};
}

Extremes extremes(const at::Tensor& t) {
  if (t.is_cpu() && t.is_contiguous()) {
    switch (t.scalar_type()) {
      case at::kLong: return scanned<int64_t>(t);
      case at::kInt: return scanned<int32_t>(t);
      case at::kShort: return scanned<int16_t>(t);
      case at::kChar: return scanned<int8_t>(t);
      case at::kByte: return scanned<uint8_t>(t);
      case at::kBool: return scanned<bool>(t);
      default: break;  // floating point: NaN is handled as ATen handles it
    }
  }
  if (t.scalar_type() == at::kBool) return {t.min().item(), t.max().item()};  // aminmax takes numbers
  auto [low, high] = at::aminmax(t);
  return {low.item(), high.item()};
}

}  // namespace

int64_t Package::validate(const Tensors& request) const {
  const auto& features = impl_->features;
  std::vector<std::string> missing, unknown, expected;
  for (const auto& f : features) {
    expected.push_back(f.name);
    if (!request.count(f.name)) missing.push_back(f.name);
  }
  for (const auto& [name, tensor] : request) {
    if (std::find(expected.begin(), expected.end(), name) == expected.end()) unknown.push_back(name);
  }
  std::sort(unknown.begin(), unknown.end());
  if (!missing.empty()) throw RequestError("request is missing feature(s) [" + joined(missing) + "]; the package expects [" + joined(expected) + "]");
  if (!unknown.empty()) throw RequestError("request has unknown feature(s) [" + joined(unknown) + "]; the package expects [" + joined(expected) + "]");
  std::optional<int64_t> batch_size;
  for (const auto& f : features) {
    const at::Tensor& t = request.at(f.name);
    const std::string name = in_quotes(f.name);
    if (!t.defined()) throw RequestError("feature " + name + " is an undefined tensor");
    if (t.is_meta()) throw RequestError("feature " + name + " is a meta tensor (it has a shape but no data); pass real values");
    if (t.is_nested()) throw RequestError("feature " + name + " is a nested tensor; pass a dense tensor (jagged values flat, with their lengths feature)");
    if (t.layout() != c10::kStrided) throw RequestError("feature " + name + " is not a dense tensor; pass a dense (strided) tensor");
    if (t.is_quantized()) throw RequestError("feature " + name + " is a quantized tensor; pass it with its plain dtype");
    if (t.scalar_type() != *scalar_type(f.dtype)) {
      throw RequestError("feature " + name + " has dtype " + dtype_name(t.scalar_type()) + ", expected " + f.dtype);
    }
    bool shape_ok = t.dim() == static_cast<int64_t>(1 + f.trailing.size());
    for (size_t k = 0; shape_ok && k < f.trailing.size(); ++k) shape_ok = t.size(static_cast<int64_t>(k + 1)) == f.trailing[k];
    if (!shape_ok) {
      std::string want = "[n";
      for (auto size : f.trailing) want += ", " + std::to_string(size);
      throw RequestError("feature " + name + " must have shape " + want + "], got " + c10::str(t.sizes()));
    }
    if (f.kind == "lengths" || f.kind == "per_user") {
      if (!batch_size) {
        batch_size = t.size(0);
      } else if (t.size(0) != *batch_size) {
        throw RequestError("feature " + name + " has " + std::to_string(t.size(0)) + " entries but the batch has " +
                           std::to_string(*batch_size) + " users");
      }
    }
    if (t.numel() > 0 && (f.min_value || f.max_value)) {
      const Extremes found = extremes(t);
      if (f.min_value && found.below(*f.min_value)) {
        throw RequestError("feature " + name + " has value " + Extremes::text(found.low) + " below the minimum " +
                           c10::str(*f.min_value));
      }
      if (f.max_value && found.above(*f.max_value)) {
        throw RequestError("feature " + name + " has " + (f.kind == "lengths" ? "length " : "value ") +
                           Extremes::text(found.high) + " beyond the exported maximum " +
                           c10::str(static_cast<int64_t>(*f.max_value)));
      }
    }
  }
  if (!batch_size || *batch_size < 1) throw RequestError("request has no users (batch size 0)");
  if (*batch_size > impl_->max_batch_size) {
    throw RequestError("batch size " + std::to_string(*batch_size) + " is beyond the exported maximum " +
                       std::to_string(impl_->max_batch_size));
  }
  for (const auto& f : features) {
    if (f.kind == "lengths" && !f.same_as.empty() && !request.at(f.name).equal(request.at(f.same_as))) {
      throw RequestError("feature " + in_quotes(f.name) + " must equal " + in_quotes(f.same_as) + " (the model reads them as one length)");
    }
    if (f.kind == "jagged") {
      int64_t total = request.at(f.jagged_by).sum().item<int64_t>();
      if (request.at(f.name).size(0) != total) {
        throw RequestError("feature " + in_quotes(f.name) + " has " + std::to_string(request.at(f.name).size(0)) +
                           " values but " + in_quotes(f.jagged_by) + " sums to " + std::to_string(total));
      }
    }
  }
  return *batch_size;
}

// Row-major strides exactly (is_contiguous() ignores the strides of size-1 dims; compiled code may not).
bool plain_strides(const at::Tensor& t) {
  int64_t step = 1;
  for (int64_t d = t.dim() - 1; d >= 0; --d) {
    if (t.stride(d) != step) return false;
    step *= std::max<int64_t>(t.size(d), 1);
  }
  return true;
}

namespace detail {

at::Tensor plain_tensor(const at::Tensor& value) {
  at::Tensor t = value.detach().resolve_conj().resolve_neg();
  return plain_strides(t) ? t : t.clone(at::MemoryFormat::Contiguous);
}

void to_device(std::vector<at::Tensor>& tensors, c10::Device device) {
  constexpr int64_t kAlign = 256;  // what the CUDA allocator gives: compiled kernels may assume aligned inputs
  // Larger tensors go on their own: their copies cost bandwidth, not a wait each, and packing them would add a
  // copy on the host (at 32 users of 4096 history tokens, the request reached the device 0.2 ms later; 0.07 ms
  // later with that copy shared by the intra-op threads: docs/PERF_INVESTIGATIONS.md, "Known not to work").
  constexpr int64_t kPackedAtMost = 256 * 1024;
  auto padded = [&](const at::Tensor& t) { return (static_cast<int64_t>(t.nbytes()) + kAlign - 1) / kAlign * kAlign; };
  std::vector<size_t> packed;
  int64_t total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    at::Tensor& t = tensors[i];
    if (t.device() == device) continue;
    if (device.is_cuda() && t.device().is_cpu() && static_cast<int64_t>(t.nbytes()) <= kPackedAtMost) {
      packed.push_back(i);
      total += padded(t);
    } else {
      t = t.to(device, /*non_blocking=*/device.is_cuda());
    }
  }
  if (packed.size() == 1) tensors[packed[0]] = tensors[packed[0]].to(device, /*non_blocking=*/true);
  if (packed.size() < 2) return;
  // Staged in pinned memory: the copy is asynchronous, and the staging block is not reused before it is done.
  at::Tensor staging = at::empty({total}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::vector<int64_t> offsets;
  int64_t offset = 0;
  for (size_t i : packed) {
    at::Tensor t = tensors[i].contiguous();
    if (t.nbytes() > 0) std::memcpy(staging.data_ptr<uint8_t>() + offset, t.const_data_ptr(), t.nbytes());
    offsets.push_back(offset);
    offset += padded(t);
  }
  at::Tensor buffer = at::empty({total}, at::TensorOptions().dtype(at::kByte).device(device));
  buffer.copy_(staging, /*non_blocking=*/true);
  for (size_t k = 0; k < packed.size(); ++k) {
    at::Tensor& t = tensors[packed[k]];
    t = buffer.narrow(0, offsets[k], static_cast<int64_t>(t.nbytes())).view(t.scalar_type()).view(t.sizes());
  }
}

}  // namespace detail

// The request as compiled code may read it: row-major, no autograd history, on the package's device.
Tensors Package::Impl::plain(const Tensors& request, std::vector<at::Tensor>* also) const {
  std::vector<at::Tensor> tensors;
  for (const auto& f : features) tensors.push_back(detail::plain_tensor(request.at(f.name)));
  if (also != nullptr) tensors.insert(tensors.end(), also->begin(), also->end());
  detail::to_device(tensors, device);
  Tensors out;
  for (size_t i = 0; i < features.size(); ++i) out.emplace(features[i].name, std::move(tensors[i]));
  if (also != nullptr) std::move(tensors.begin() + static_cast<std::ptrdiff_t>(features.size()), tensors.end(), also->begin());
  return out;
}

namespace {

// What the artifacts' range checks raise in TorchScript after "AssertionError: <feature>" (check_ranges in
// hstu_export/capture/graph_functions.py), and which limit each one means.
enum class Bound { kRows, kLow, kHigh };
constexpr std::pair<const char*, Bound> kRangeChecks[] = {
    {" has more rows than the package was exported for", Bound::kRows},
    {" has a value below the exported range", Bound::kLow},
    {" has a value beyond the exported range", Bound::kHigh},
};

// kRangeChecks' words for a bound as the manifest's range_checks name it ("rows", "low", "high").
const char* range_check_words(const std::string& bound) {
  Bound wanted = bound == "rows" ? Bound::kRows : bound == "low" ? Bound::kLow : Bound::kHigh;
  for (const auto& [words, which] : kRangeChecks) {
    if (which == wanted) return words;
  }
  return "";
}

}  // namespace

std::optional<std::string> Package::Impl::named_check(const std::exception& exc) const {
  std::string text = exc.what();
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&exc)) text = c10_error->what_without_backtrace();
  static const std::regex compiled(R"(Expected (u\d+) )");
  std::smatch found;
  if (!std::regex_search(text, found, compiled)) return std::nullopt;
  auto check = sparse_checks.find(found[1].str());
  if (check == sparse_checks.end()) return std::nullopt;
  return "AssertionError: " + check->second.first + range_check_words(check->second.second) + "\n" + text;
}

NamedTensors Package::Impl::sparse_outputs(const Tensors& request) const {
  const Artifact& artifact = artifacts.at("sparse");
  if (sparse_program) {  // positional, in the manifest's order; returns its outputs in the manifest's order
    std::vector<at::Tensor> inputs;
    inputs.reserve(artifact.inputs.size());
    for (const auto& spec : artifact.inputs) inputs.push_back(request.at(spec.feature));
    std::vector<at::Tensor> outputs;
    try {
      outputs = sparse_program->run(inputs);
    } catch (const std::exception& exc) {
      if (auto named = named_check(exc)) throw std::runtime_error(*named);
      throw;
    }
    if (outputs.size() != artifact.outputs.size()) {
      throw Error(artifact.file + " returned " + std::to_string(outputs.size()) + " outputs, the manifest names " +
                  std::to_string(artifact.outputs.size()));
    }
    NamedTensors out;
    for (size_t i = 0; i < outputs.size(); ++i) out.emplace_back(artifact.outputs[i], std::move(outputs[i]));
    return out;
  }
  torch::jit::Kwargs kwargs;
  for (const auto& spec : artifact.inputs) kwargs.emplace(spec.name, request.at(spec.feature));
  return named_outputs(sparse.forward({}, kwargs), artifact.outputs, artifact.file);
}

std::vector<at::Tensor> Package::Impl::dense_inputs(const Tensors& request, const NamedTensors& boundary) const {
  std::vector<at::Tensor> inputs;
  inputs.reserve(artifacts.at("dense").inputs.size());
  for (const auto& spec : artifacts.at("dense").inputs) {
    if (!spec.feature.empty()) {
      inputs.push_back(request.at(spec.feature));
      continue;
    }
    auto it = std::find_if(boundary.begin(), boundary.end(), [&](const auto& item) { return item.first == spec.name; });
    if (it == boundary.end()) throw Error(artifacts.at("sparse").file + " gave no " + spec.name);
    // The sparse half may return views (a KeyedTensor's per-key slices); AOTInductor reads contiguous memory.
    inputs.push_back(it->second.contiguous());
  }
  return inputs;
}

namespace detail {

PhaseClock::PhaseClock(PhaseTimes* times, c10::Device device) : times_(times), device_(device) {
  if (times_ == nullptr) return;
  if (device_.is_cuda()) torch::cuda::synchronize(device_.index());
  mark_ = std::chrono::steady_clock::now();
}

void PhaseClock::split(double PhaseTimes::*field) {
  if (times_ == nullptr) return;
  times_->*field += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - mark_).count();
}

void PhaseClock::begin_part() {
  if (times_ == nullptr) return;
  if (device_.is_cuda()) torch::cuda::synchronize(device_.index());
  part_ = std::chrono::steady_clock::now();
}

void PhaseClock::end_part(double PhaseTimes::*field) {
  if (times_ == nullptr) return;
  if (device_.is_cuda()) torch::cuda::synchronize(device_.index());
  times_->*field += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - part_).count();
}

void PhaseClock::lap(double PhaseTimes::*field) {
  if (times_ == nullptr) return;
  if (device_.is_cuda()) torch::cuda::synchronize(device_.index());
  auto now = std::chrono::steady_clock::now();
  times_->*field += std::chrono::duration<double, std::milli>(now - mark_).count();
  mark_ = now;
}

}  // namespace detail

NamedTensors Package::Impl::run(const Tensors& request, detail::PhaseClock& clock) const {
  if (backend == "torchscript") {
    const Artifact& artifact = artifacts.at("model");
    torch::jit::Kwargs kwargs;
    for (const auto& spec : artifact.inputs) kwargs.emplace(spec.name, request.at(spec.feature));
    clock.lap(&PhaseTimes::before_dense_ms);
    NamedTensors out = named_outputs(model.forward({}, kwargs), output_names, artifact.file);
    clock.split(&PhaseTimes::dense_launch_ms);
    clock.lap(&PhaseTimes::dense_ms);  // one TorchScript module: the whole model counts as the dense half
    return out;
  }
  const Artifact& dense_artifact = artifacts.at("dense");
  std::vector<at::Tensor> outputs;
  if (graphs) {  // the whole request from its graph: the sparse half runs inside the dense half's
    clock.sparse_in_dense(true);
    clock.lap(&PhaseTimes::before_dense_ms);
    outputs = (*graphs)(detail::ProgramInputs(request.begin(), request.end()));
  } else {
    clock.begin_part();
    NamedTensors boundary = sparse_outputs(request);
    clock.end_part(&PhaseTimes::sparse_ms);
    std::vector<at::Tensor> inputs = dense_inputs(request, boundary);
    clock.lap(&PhaseTimes::before_dense_ms);
    outputs = dense->run(inputs);
  }
  clock.split(&PhaseTimes::dense_launch_ms);
  clock.lap(&PhaseTimes::dense_ms);
  if (outputs.size() != output_names.size()) {
    throw Error(dense_artifact.file + " returned " + std::to_string(outputs.size()) + " outputs, the manifest names " +
                std::to_string(output_names.size()));
  }
  NamedTensors out;
  for (size_t i = 0; i < outputs.size(); ++i) out.emplace_back(output_names[i], std::move(outputs[i]));
  return out;
}

namespace {

// The list a TorchScript value holds when it is constant (a list constant, or a list built of constants).
std::optional<std::vector<c10::IValue>> constant_list(torch::jit::Value* value) {
  if (auto constant = torch::jit::toIValue(value)) {
    if (!constant->isList()) return std::nullopt;
    return constant->toListRef().vec();
  }
  if (value->node()->kind() != c10::prim::ListConstruct) return std::nullopt;
  std::vector<c10::IValue> out;
  for (torch::jit::Value* item : value->node()->inputs()) {
    auto constant = torch::jit::toIValue(item);
    if (!constant) return std::nullopt;
    out.push_back(*constant);
  }
  return out;
}

struct CheckedRange {
  int64_t low, high, rows;
};

// The limits a TorchScript artifact holds `feature` to: the constant arguments of its check_ranges call
// (check_ranges(values, lows, highs, rows, names)), in any method of the module or its submodules.
std::optional<CheckedRange> checked_range(const torch::jit::Module& module, const std::string& feature) {
  std::function<std::optional<CheckedRange>(torch::jit::Block*)> search = [&](torch::jit::Block* block) {
    for (torch::jit::Node* node : block->nodes()) {
      for (torch::jit::Block* inner : node->blocks()) {
        if (auto found = search(inner)) return found;
      }
      if (node->kind() != c10::prim::CallFunction || node->inputs().size() != 6) continue;
      auto function = node->input(0)->type()->cast<c10::FunctionType>();
      if (!function || function->function()->name() != "check_ranges") continue;
      auto lows = constant_list(node->input(2)), highs = constant_list(node->input(3));
      auto rows = constant_list(node->input(4)), names = constant_list(node->input(5));
      if (!lows || !highs || !rows || !names) continue;
      for (size_t i = 0; i < names->size() && i < lows->size() && i < highs->size() && i < rows->size(); ++i) {
        const c10::IValue &name = (*names)[i], &low = (*lows)[i], &high = (*highs)[i], &most = (*rows)[i];
        if (name.isString() && name.toStringRef() == feature && low.isInt() && high.isInt() && most.isInt()) {
          return std::optional<CheckedRange>(CheckedRange{low.toInt(), high.toInt(), most.toInt()});
        }
      }
    }
    return std::optional<CheckedRange>();
  };
  static std::mutex reading;  // a refusal's path only; Module's API is not const
  std::lock_guard<std::mutex> lock(reading);
  try {
    for (const auto& child : module.modules()) {
      for (const auto& method : child.get_methods()) {
        if (auto found = search(method.graph()->block())) return found;
      }
    }
  } catch (const std::exception&) {
  }
  return std::nullopt;
}

// The limit a compiled check's error states ("Expected u5 <= 999 but received 1000"), as the range of the bound
// it checks.
std::optional<CheckedRange> compiled_limit(const std::string& text, Bound bound) {
  static const std::regex at_most(R"(Expected u\d+ <= (-?\d+) )"), at_least(R"(Expected u\d+ >= (-?\d+) )");
  std::smatch found;
  if (!std::regex_search(text, found, bound == Bound::kLow ? at_least : at_most)) return std::nullopt;
  try {
    int64_t limit = std::stoll(found[1].str());
    return CheckedRange{limit, limit, limit};
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

}  // namespace

// "B=1 (min), uih_lengths=1..1 (min)": the request's number of users and each lengths feature's shortest and
// longest user, with the manifest's bounds they reach (a compiled guard names only its symbols).
std::string Package::Impl::at_limits(const Tensors& request) const {
  std::string out;
  std::optional<int64_t> users;
  for (const auto& f : features) {
    if (f.kind == "lengths" && request.count(f.name)) {
      users = request.at(f.name).size(0);
      break;
    }
  }
  if (users) {
    out = "B=" + std::to_string(*users) + (*users == max_batch_size ? " (max)" : *users == 1 ? " (min)" : "");
  }
  for (const auto& f : features) {
    if (f.kind != "lengths" || !f.same_as.empty() || !request.count(f.name) || request.at(f.name).numel() == 0) continue;
    const at::Tensor values = request.at(f.name).to(at::kCPU);
    int64_t low = values.min().item<int64_t>(), high = values.max().item<int64_t>();
    std::string marks;
    if (f.min_value && low == static_cast<int64_t>(*f.min_value)) marks = "min";
    if (f.max_value && high == static_cast<int64_t>(*f.max_value)) marks += std::string(marks.empty() ? "" : ", ") + "max";
    out += (out.empty() ? "" : ", ") + f.name + "=" + std::to_string(low) + ".." + std::to_string(high) +
           (marks.empty() ? "" : " (" + marks + ")");
  }
  return out;
}

std::optional<RequestError> Package::Impl::range_refusal(const std::exception& exc, const Tensors& request) const {
  std::string text = exc.what();
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&exc)) text = c10_error->what_without_backtrace();
  const std::string marker = "AssertionError: ";
  size_t at = text.rfind(marker);
  std::string raised = at == std::string::npos ? "" : text.substr(at + marker.size());
  raised = raised.substr(0, raised.find('\n'));
  raised.erase(raised.find_last_not_of(" \t\r") + 1);
  for (const auto& [check, bound] : kRangeChecks) {
    if (!raised.ends_with(check)) continue;
    std::string name = raised.substr(0, raised.size() - std::string(check).size());
    auto f = std::find_if(features.begin(), features.end(), [&](const Feature& g) { return g.name == name; });
    if (f == features.end() || !request.count(name)) return std::nullopt;
    const at::Tensor& t = request.at(name);
    const std::string quoted = in_quotes(name);
    bool torchscript = backend == "torchscript";
    const std::string& file = artifacts.at(torchscript ? "model" : "sparse").file;
    std::optional<CheckedRange> range =
        torchscript || !sparse_program ? checked_range(torchscript ? model : sparse, name) : compiled_limit(text, bound);
    bool integral = !at::isFloatingType(t.scalar_type());
    auto value_text = [&](const at::Tensor& v) {
      return integral ? std::to_string(v.item<int64_t>()) : c10::str(v.item<double>());
    };
    std::string what, manifest;
    if (bound == Bound::kRows) {
      what = "feature " + quoted + " has " + std::to_string(t.size(0)) + " entries, beyond the exported maximum of " +
             (range ? std::to_string(range->rows) + " users" : "users " + file + " was exported for");
      manifest = "the manifest allows " + std::to_string(max_batch_size);
    } else if (bound == Bound::kLow) {
      what = "feature " + quoted + " has value " + (t.numel() ? value_text(t.min()) : "?") +
             (range ? " below the minimum " + std::to_string(range->low) : " below the range " + file + " was exported for");
      manifest = f->min_value ? "the manifest's minimum is " + c10::str(*f->min_value) : "the manifest states no minimum";
    } else {
      what = "feature " + quoted + " has " + (f->kind == "lengths" ? "length " : "value ") +
             (t.numel() ? value_text(t.max()) : "?") +
             (range ? " beyond the exported maximum " + std::to_string(range->high)
                    : " beyond the range " + file + " was exported for");
      manifest = f->max_value ? "the manifest's maximum is " + std::to_string(static_cast<int64_t>(*f->max_value))
                              : "the manifest states no maximum";
    }
    return RequestError(what + " (refused by " + file + " itself; " + manifest +
                        ", so the manifest does not match the package's programs: re-export the package)");
  }
  // A guard AOTInductor compiled into a program ("Expected u14 >= 2 but received 1"): the request is inside the
  // manifest's ranges (validate() ran), so the program is narrower than its manifest.
  if (size_t guard = text.find("Expected "); guard != std::string::npos && text.find(" but received", guard) != std::string::npos) {
    std::string raised = text.substr(guard);
    raised = raised.substr(0, raised.find('\n'));
    raised.erase(raised.find_last_not_of(" \t\r") + 1);
    return RequestError("the package's programs refuse this request although its manifest accepts it (" + raised.substr(0, 300) +
                        "); at their limits: " + at_limits(request) +
                        ". Re-export the package (export verifies every corner of the ranges and narrows what its "
                        "programs do not take)");
  }
  return std::nullopt;
}

NamedTensors Package::run(const Tensors& request, PhaseTimes* times) const {
  c10::OptionalDeviceGuard device_guard(impl_->device.is_cuda() ? std::optional(impl_->device) : std::nullopt);
  detail::PhaseClock clock(times, impl_->device);
  validate(request);
  c10::InferenceMode guard;
  try {
    clock.begin_part();
    Tensors on_device = impl_->plain(request);
    clock.end_part(&PhaseTimes::to_device_ms);
    NamedTensors out = impl_->run(on_device, clock);
    clock.lap(&PhaseTimes::after_dense_ms);
    return out;
  } catch (const Error&) {
    throw;
  } catch (const std::exception& exc) {
    if (auto refused = impl_->range_refusal(exc, request)) throw *refused;
    throw Error(impl_->root + ": running the package failed: " + error_text(exc));
  }
}

}  // namespace hstu_export
