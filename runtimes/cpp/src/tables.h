// The tables a compiled sparse program is handed at load (tables.cpp). Internal: not installed.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <unordered_map>
#include <vector>

#include "hstu_export/runtime.h"

namespace hstu_export::detail {

std::string in_quotes(const std::string& text);

// A table as the manifest lists it (artifacts.sparse.constants.tensors).
struct TableSpec {
  std::string name;
  std::string dtype;  // float32, bfloat16, ...
  std::vector<int64_t> shape;
};

bool is_table_dtype(const std::string& name);

// The tables of the safetensors file `path` by name, after its header is checked against `specs`: views of one
// read-only mapping of the file (kept while any of them lives) on CPU, copies on a CUDA `device`. PackageError
// naming `what` (the file) on any mismatch.
std::unordered_map<std::string, at::Tensor> read_tables(const std::string& path, const std::vector<TableSpec>& specs,
                                                        c10::Device device, const std::string& what);

}  // namespace hstu_export::detail
