// ShapeGraphs: a CUDA graph per exact input shapes, for programs that read nothing back (shape_graphs.h).
#include "shape_graphs.h"

#include <ATen/ATen.h>
#include <torch/cuda.h>

#include <algorithm>
#include <list>
#include <map>
#include <mutex>
#include <optional>

#ifdef HSTU_EXPORT_CUDA_GRAPHS
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

#include "hstu_export/runtime.h"

namespace hstu_export::detail {

namespace {

constexpr size_t kMaxSeen = 4096;

// What identifies a call's graph: each input's name (the map's order), dtype and shape, and the addresses of
// the static inputs.
using Key = std::vector<int64_t>;

Key key_of(const ProgramInputs& inputs, const std::set<std::string>& statics) {
  Key key;
  for (const auto& [name, value] : inputs) {
    key.push_back(static_cast<int64_t>(std::hash<std::string>{}(name)));
    key.push_back(static_cast<int64_t>(value.scalar_type()));
    key.push_back(value.dim());
    for (int64_t size : value.sizes()) key.push_back(size);
    key.push_back(statics.count(name) ? reinterpret_cast<int64_t>(value.data_ptr()) : 0);
  }
  return key;
}

}  // namespace

Graphs resolve_graphs(const std::string& root, c10::Device device, Graphs graphs, const std::string& unsafe) {
  bool cuda = device.is_cuda();
  if (graphs == Graphs::kOn && !unsafe.empty()) throw Error(unsafe);
  if (graphs == Graphs::kOn && !cuda) {
    throw Error("CUDA graphs need a CUDA package; " + root + " is for " + device.str());
  }
  if (graphs == Graphs::kOn && !cuda_graphs_built()) {
    throw Error("this C++ runtime was built without CUDA graph support (no CUDA headers when it was built); "
                "rebuild it where the CUDA toolkit's headers are, or serve without graphs");
  }
  if (graphs != Graphs::kAuto) return graphs;
  return cuda && cuda_graphs_built() && unsafe.empty() ? Graphs::kOn : Graphs::kOff;
}

struct ShapeGraphs::Impl {
  struct Graph {
#ifdef HSTU_EXPORT_CUDA_GRAPHS
    std::unique_ptr<at::cuda::CUDAGraph> graph;
#endif
    ProgramInputs buffers;
    std::vector<at::Tensor> outputs;
    // The buffers copied into one by one (floating: a device memcpy each, at the memory's speed), and those of
    // each other dtype, copied together (one multi-tensor kernel for many small tensors).
    std::vector<std::string> singles;
    std::vector<std::vector<std::string>> groups;
    std::list<Key>::iterator order;
  };

  RunProgram run;
  std::set<std::string> statics;
  bool capture = true;
  size_t max_graphs = 16;
  bool evict = true;
  int64_t max_bytes = kMaxCopyBytes;
  mutable std::mutex mutex;
  std::map<Key, Graph> graphs;
  std::list<Key> recency;  // least recently used first
  std::map<Key, int> seen;
  std::set<Key> refused;
  KVGraphCounts counts;
#ifdef HSTU_EXPORT_CUDA_GRAPHS
  std::optional<at::cuda::MempoolId_t> pool;
#endif

  Graph make(const ProgramInputs& inputs) {
    Graph entry;
    std::map<at::ScalarType, size_t> group_of;
    for (const auto& [name, value] : inputs) {
      bool fixed = statics.count(name) > 0;
      entry.buffers[name] = fixed ? value : value.clone();
      if (fixed || value.numel() == 0) continue;
      if (value.is_floating_point()) {
        entry.singles.push_back(name);
        continue;
      }
      auto [it, fresh] = group_of.emplace(value.scalar_type(), entry.groups.size());
      if (fresh) entry.groups.emplace_back();
      entry.groups[it->second].push_back(name);
    }
    if (!capture) return entry;
#ifdef HSTU_EXPORT_CUDA_GRAPHS
    c10::Device device = inputs.begin()->second.device();
    for (const auto& [name, value] : inputs) {
      if (statics.count(name)) device = value.device();
    }
    if (!pool) pool = at::cuda::graph_pool_handle();
    torch::cuda::synchronize(device.index());
    {
      // Warm up outside the capture (allocations, lazy initialisation), then capture on a side stream; only
      // this thread is kept from calls that would break the capture (kv_graphs.cpp says why).
      c10::cuda::CUDAStreamGuard side(c10::cuda::getStreamFromPool(false, device.index()));
      for (int i = 0; i < 2; ++i) run(entry.buffers);
      torch::cuda::synchronize(device.index());
      entry.graph = std::make_unique<at::cuda::CUDAGraph>();
      entry.graph->capture_begin(*pool, cudaStreamCaptureModeThreadLocal);
      try {
        entry.outputs = run(entry.buffers);
      } catch (...) {
        try {
          entry.graph->capture_end();
        } catch (...) {  // the capture was already broken: the program's own error is the one to report
        }
        throw;
      }
      entry.graph->capture_end();
    }
    torch::cuda::synchronize(device.index());
    counts.captures += 1;
#else
    throw Error("this C++ runtime was built without CUDA graph support (no CUDA headers at build time)");
#endif
    return entry;
  }

  void fill(Graph& entry, const ProgramInputs& inputs) {
    for (const auto& name : entry.singles) entry.buffers.at(name).copy_(inputs.at(name));
    for (const auto& names : entry.groups) {
      std::vector<at::Tensor> targets, sources;
      for (const auto& name : names) {
        targets.push_back(entry.buffers.at(name));
        sources.push_back(inputs.at(name));
      }
      at::_foreach_copy_(targets, sources);
    }
  }
};

ShapeGraphs::ShapeGraphs(RunProgram run, std::set<std::string> statics, bool capture, size_t max_graphs,
                         int64_t max_bytes, bool evict)
    : impl_(std::make_unique<Impl>()) {
  impl_->evict = evict;
  impl_->max_bytes = max_bytes;
  impl_->run = std::move(run);
  impl_->statics = std::move(statics);
  impl_->capture = capture;
  impl_->max_graphs = std::max<size_t>(max_graphs, 1);
}

ShapeGraphs::~ShapeGraphs() = default;

KVGraphCounts ShapeGraphs::counts() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->counts;
}

std::vector<at::Tensor> ShapeGraphs::operator()(const ProgramInputs& inputs) {
  Impl& s = *impl_;
  int64_t copied_bytes = 0;
  for (const auto& [name, value] : inputs) {
    if (!s.statics.count(name)) copied_bytes += value.numel() * static_cast<int64_t>(value.element_size());
  }
  if (copied_bytes > s.max_bytes) {
    {
      std::lock_guard<std::mutex> lock(s.mutex);
      s.counts.eager += 1;
    }
    return s.run(inputs);
  }
  Key key = key_of(inputs, s.statics);
  std::unique_lock<std::mutex> lock(s.mutex);
  auto it = s.graphs.find(key);
  if (it == s.graphs.end()) {
    if (s.seen.size() > kMaxSeen) {  // shapes seen once (or refused), long ago, are forgotten
      s.seen.clear();
      s.refused.clear();
    }
    if (++s.seen[key] < 2 || s.refused.count(key) || (!s.evict && s.graphs.size() >= s.max_graphs)) {
      s.counts.eager += 1;
      lock.unlock();  // calls of other shapes run meanwhile
      return s.run(inputs);
    }
    Impl::Graph entry;
    try {
      entry = s.make(inputs);
    } catch (const std::exception&) {  // any failure to capture: this shape runs as it is from now on
      s.refused.insert(key);
      s.counts.refused += 1;
#ifdef HSTU_EXPORT_CUDA_GRAPHS
      if (s.capture) torch::cuda::synchronize();  // the warm-up's work done before the call runs again
#endif
      return s.run(inputs);
    }
    it = s.graphs.emplace(key, std::move(entry)).first;
    it->second.order = s.recency.insert(s.recency.end(), key);
    if (s.graphs.size() > s.max_graphs) {
      s.graphs.erase(s.recency.front());
      s.recency.pop_front();
    }
  } else {
    s.fill(it->second, inputs);
    s.recency.splice(s.recency.end(), s.recency, it->second.order);
  }
  Impl::Graph& entry = it->second;
#ifdef HSTU_EXPORT_CUDA_GRAPHS
  if (entry.graph) {
    entry.graph->replay();
  } else {
    entry.outputs = s.run(entry.buffers);
  }
#else
  entry.outputs = s.run(entry.buffers);
#endif
  s.counts.replays += 1;
  return copied(entry.outputs);
}

}  // namespace hstu_export::detail
