// Directories of named tensors (docs/PACKAGE.md, "Requests on disk"), the same format as
// hstu_export/package/tensor_dir.py: <percent-encoded name>.pt, each one torch.save'd tensor.
#include <torch/csrc/jit/serialization/pickle.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <vector>

#include "hstu_export/runtime.h"

namespace hstu_export {

namespace fs = std::filesystem;

namespace {

constexpr const char* kSuffix = ".pt";

bool safe_byte(unsigned char c, size_t position) {
  if (c == '.' && position == 0) return false;
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '.' ||
         c == '-';
}

int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// The name a file holds, or RequestError.
std::string tensor_name(const std::string& file) {
  std::string stem = file.substr(0, file.size() - std::string(kSuffix).size());
  std::string out;
  for (size_t i = 0; i < stem.size();) {
    unsigned char c = static_cast<unsigned char>(stem[i]);
    if (c == '%') {
      int high = i + 1 < stem.size() ? hex_value(stem[i + 1]) : -1;
      int low = i + 2 < stem.size() ? hex_value(stem[i + 2]) : -1;
      if (high < 0 || low < 0) throw RequestError("'" + file + "': '%' must be followed by two upper-case hex digits");
      out += static_cast<char>(high * 16 + low);
      i += 3;
    } else if (safe_byte(c, i)) {
      out += static_cast<char>(c);
      ++i;
    } else {
      throw RequestError("'" + file + "': byte '" + std::string(1, static_cast<char>(c)) + "' must be percent-encoded");
    }
  }
  return out;
}

}  // namespace

std::string tensor_file_name(const std::string& name) {
  static const char* digits = "0123456789ABCDEF";
  std::string out;
  for (size_t i = 0; i < name.size(); ++i) {
    auto c = static_cast<unsigned char>(name[i]);
    if (safe_byte(c, i)) {
      out += static_cast<char>(c);
    } else {
      out += '%';
      out += digits[c >> 4];
      out += digits[c & 0xF];
    }
  }
  return out + kSuffix;
}

Tensors load_tensor_dir(const std::string& directory) {
  std::error_code ec;
  if (!fs::is_directory(directory, ec)) throw RequestError(directory + ": no such directory of tensors");
  std::vector<fs::path> files;
  for (const auto& entry : fs::directory_iterator(directory, ec)) {
    std::string file = entry.path().filename().string();
    if (file.size() > 3 && file.ends_with(kSuffix)) files.push_back(entry.path());
  }
  if (ec) throw RequestError(directory + ": cannot list it (" + ec.message() + ")");
  std::sort(files.begin(), files.end());
  Tensors out;
  for (const auto& path : files) {
    std::string name = tensor_name(path.filename().string());
    if (!fs::is_regular_file(fs::symlink_status(path, ec))) throw RequestError(path.string() + ": not a regular file");
    std::ifstream in(path, std::ios::binary);
    std::vector<char> data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (in.bad()) throw RequestError(path.string() + ": cannot read it");
    c10::IValue value;
    try {
      value = torch::jit::pickle_load(data);
    } catch (const std::exception& exc) {
      std::string why = exc.what();
      throw RequestError(path.string() + " is not a torch.save'd tensor: " + why.substr(0, why.find('\n')));
    }
    if (!value.isTensor()) throw RequestError(path.string() + " holds a " + value.tagKind() + ", not a tensor");
    out.emplace(std::move(name), value.toTensor());
  }
  if (out.empty()) throw RequestError(directory + " holds no tensor files (<name>.pt)");
  return out;
}

void save_tensor_dir(const NamedTensors& tensors, const std::string& directory) {
  // All or nothing: each file is written beside its target (<file>.partial) and renamed once all are written.
  // On failure (a full disk) the partial files go, and so do the directories this call created.
  std::error_code ec;
  fs::path created;  // the outermost directory that did not exist
  for (fs::path p = fs::absolute(directory, ec); !ec && !p.empty() && !fs::exists(p, ec); p = p.parent_path()) {
    created = p;
    if (p == p.parent_path()) break;
  }
  fs::create_directories(directory, ec);
  if (ec) throw Error(directory + ": cannot create it (" + ec.message() + ")");
  std::vector<std::pair<fs::path, fs::path>> staged;  // (partial file, target)
  try {
    for (const auto& [name, tensor] : tensors) {
      std::vector<char> data = torch::jit::pickle_save(tensor.detach().cpu().contiguous());
      fs::path target = fs::path(directory) / tensor_file_name(name);
      fs::path partial = target;
      partial += ".partial";
      staged.emplace_back(partial, target);
      errno = 0;
      std::ofstream out(partial, std::ios::binary | std::ios::trunc);
      out.write(data.data(), static_cast<std::streamsize>(data.size()));
      out.close();  // the buffered bytes reach the disk here: a full disk shows at the close
      if (!out) {
        int error = errno;
        throw Error("cannot write the outputs to " + directory + ": " + partial.filename().string() + ": " +
                    (error ? std::strerror(error) : "write failed") + " (disk full or not writable?); nothing was written");
      }
    }
    for (const auto& [partial, target] : staged) {
      fs::rename(partial, target, ec);
      if (ec) throw Error(target.string() + ": cannot write it (" + ec.message() + ")");
    }
  } catch (...) {
    std::error_code ignored;
    for (const auto& [partial, target] : staged) fs::remove(partial, ignored);
    if (!created.empty()) fs::remove_all(created, ignored);
    throw;
  }
}

}  // namespace hstu_export
