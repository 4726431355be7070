// CUDA graphs keyed by a call's exact input shapes: runtimes/shape_graphs.py, in C++. Internal.
//
// For a program that reads no value back from the device (a derived delta program whose kv_cache.device_reads is
// 0; a whole request whose sparse half runs its prechecked model and whose dense program reads nothing,
// Package::run): such a program launches the same kernels with the same grids for every call of the same input
// shapes, so a call can be captured once and replayed. The key is every input's name, shape and dtype, and the
// addresses of the inputs that are the same tensors on every call (the cache's pages). A key is captured the
// second time it is seen, into one memory pool, at most `max_graphs` are kept (least recently used out; with
// evict=false, the first ones, and later shapes run as they are).
// Before a replay the call's tensors are copied into the graph's buffers (the floating ones each on its own,
// the others one _foreach_copy_ per dtype); after it the outputs are copied out. A capture that fails leaves
// its key to run as it is from then on (counted as refused). A call whose copied inputs exceed `max_bytes`
// runs as it is: the copies would cost more than the launches a graph saves (runtimes/shape_graphs.py has the
// figures). Captures and replays are serialised; a call run as it is runs outside the lock. `run` may be the
// whole request (kv_cache.cpp's open_derived: the compiled sparse half, then the program; runtime.cpp's
// Package::open: the sparse half, then the dense half), whose inputs are then the request's tensors.
#pragma once

#include <ATen/Tensor.h>
#include <c10/core/Device.h>

#include <cstddef>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "hstu_export/kv_cache.h"
#include "kv_graphs.h"

namespace hstu_export::detail {

// Calls whose copied inputs exceed this run as they are (runtimes/shape_graphs.py's MAX_COPY_BYTES).
constexpr int64_t kMaxCopyBytes = int64_t{160} << 20;
// Whole requests without the cache (Package::run) whose tensors exceed this run as they are: past a few users of
// long histories the GPU's work, not the host's launches, bounds a request, and a replay saved nothing
// (runtimes/shape_graphs.py's REQUEST_COPY_BYTES has the figures).
constexpr int64_t kRequestCopyBytes = int64_t{512} << 10;

// Options::graphs / KVCacheOptions::graphs made definite for the package at `root` on `device`: kAuto is kOn where
// graphs can run (a CUDA device, a runtime built with CUDA headers) and `unsafe` is empty, else kOff; kOn where
// they cannot is an Error (`unsafe`, when not empty: the one line saying why this package cannot be replayed).
Graphs resolve_graphs(const std::string& root, c10::Device device, Graphs graphs, const std::string& unsafe);

class ShapeGraphs {
 public:
  // `run`: the program on inputs by name (outputs in its order). capture=false keeps the keys and buffers
  // but runs the program on the buffers instead of replaying a graph: the same bookkeeping on any device.
  // evict=false: once `max_graphs` are kept, a new shape runs as it is instead of displacing one (whole requests:
  // traffic whose shapes keep changing costs at most `max_graphs` captures).
  ShapeGraphs(RunProgram run, std::set<std::string> statics, bool capture, size_t max_graphs = 16,
              int64_t max_bytes = kMaxCopyBytes, bool evict = true);
  ~ShapeGraphs();
  ShapeGraphs(const ShapeGraphs&) = delete;
  ShapeGraphs& operator=(const ShapeGraphs&) = delete;

  // The program's outputs for the call, in tensors that outlive it.
  std::vector<at::Tensor> operator()(const ProgramInputs& inputs);

  KVGraphCounts counts() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace hstu_export::detail
