// DeltaGraphs: shape buckets and a CUDA graph per bucket for the delta program (kv_graphs.h).
#include "kv_graphs.h"

#include <ATen/ATen.h>
#include <torch/cuda.h>

#include <algorithm>
#include <list>
#include <mutex>
#include <optional>

#ifdef HSTU_EXPORT_CUDA_GRAPHS
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#endif

#include "hstu_export/runtime.h"

namespace hstu_export::detail {

namespace {

// The inputs with a row per token (or per user with nothing cached), and those with an entry per user.
constexpr const char* kRowInputs[] = {"uih_item_emb", "uih_action_emb", "uih_timestamps", "candidate_item_emb",
                                      "contextual_emb"};
constexpr const char* kUserInputs[] = {"uih_lengths", "candidate_lengths", "query_time", "kv_cached"};
// The pages are the cache itself: the same tensors on every call, never copied.
constexpr const char* kStaticInputs[] = {"kv_k_pages", "kv_v_pages"};
constexpr size_t kMaxSeen = 4096;

bool is_static(const std::string& name) {
  return std::any_of(std::begin(kStaticInputs), std::end(kStaticInputs), [&](const char* s) { return name == s; });
}

int64_t rounded(int64_t n, int64_t step) { return n ? (n + step - 1) / step * step : step; }

struct Padding {
  int64_t history;     // the padding user's history tokens
  int64_t candidates;  // and candidates
  int64_t width;       // the bucket's page-table width
};

// The page table's width in a bucket: rounded up to a power of two, within the buckets' widest (a wider
// table keeps its width).
int64_t bucket_width(int64_t width, const Buckets& buckets) {
  int64_t power = 1;
  while (power < width) power <<= 1;
  return std::min(std::max(power, width), std::max(buckets.max_width, width));
}

Padding padding_of(const ProgramInputs& inputs, const Buckets& buckets) {
  int64_t hist = inputs.at("uih_item_emb").size(0);
  int64_t cand = inputs.at("candidate_item_emb").size(0);
  // A request without history tokens still gets a block of them: the program's history input is never empty.
  return {rounded(hist, buckets.history) - hist, rounded(cand, buckets.candidates) - cand,
          bucket_width(inputs.at("kv_page_table").size(1), buckets)};
}

int64_t scratch_page(const ProgramInputs& inputs) { return inputs.at("kv_k_pages").size(1) - 1; }

// `inputs` with the padding user appended.
ProgramInputs pad_to_bucket(const ProgramInputs& inputs, const Buckets& buckets, int64_t contextual) {
  Padding pad = padding_of(inputs, buckets);
  auto rows = [](const at::Tensor& t, int64_t n) {
    std::vector<int64_t> shape = t.sizes().vec();
    shape[0] = n;
    return at::cat({t, at::zeros(shape, t.options())});
  };
  ProgramInputs out = inputs;
  for (const char* name : {"uih_item_emb", "uih_action_emb", "uih_timestamps"}) out[name] = rows(inputs.at(name), pad.history);
  out["candidate_item_emb"] = rows(inputs.at("candidate_item_emb"), pad.candidates);
  if (contextual > 0) out["contextual_emb"] = rows(inputs.at("contextual_emb"), 1);
  // The padding user's counts: what the real users leave, or the bucket's rows where the program cuts them
  // to that itself (the same on every call of the bucket: nothing to compute at a replay).
  int64_t history = buckets.fitted_counts ? out.at("uih_item_emb").size(0) : pad.history;
  int64_t candidates = buckets.fitted_counts ? out.at("candidate_item_emb").size(0) : pad.candidates;
  const at::Tensor& lengths = inputs.at("uih_lengths");
  out["uih_lengths"] = at::cat({lengths, at::full({1}, history, lengths.options())});
  const at::Tensor& counts = inputs.at("candidate_lengths");
  out["candidate_lengths"] = at::cat({counts, at::full({1}, candidates, counts.options())});
  out["query_time"] = rows(inputs.at("query_time"), 1);
  out["kv_cached"] = rows(inputs.at("kv_cached"), 1);  // nothing cached: it reads no page
  const at::Tensor& table = inputs.at("kv_page_table");
  int64_t scratch = scratch_page(inputs);
  at::Tensor taller = at::cat({table, at::full({1, table.size(1)}, scratch, table.options())});
  out["kv_page_table"] = at::constant_pad_nd(taller, {0, pad.width - table.size(1)}, scratch);
  return out;
}

// What identifies a request's bucket: the shapes pad_to_bucket gives it, and the pages' addresses; none
// when those shapes are beyond the program's bounds (the request has no bucket).
std::optional<std::vector<int64_t>> bucket_key(const ProgramInputs& inputs, const Buckets& buckets, int64_t contextual) {
  Padding pad = padding_of(inputs, buckets);
  int64_t users = inputs.at("kv_cached").size(0) + 1;
  int64_t history = inputs.at("uih_item_emb").size(0) + pad.history;
  int64_t candidates = inputs.at("candidate_item_emb").size(0) + pad.candidates;
  int64_t fresh = inputs.at("contextual_emb").size(0) + (contextual > 0 ? 1 : 0);
  auto within = [](int64_t n, int64_t bound) { return bound == 0 || n <= bound; };
  if (!within(users, buckets.max_batch) || !within(fresh, buckets.max_batch) ||
      !within(history, buckets.max_history) || !within(candidates, buckets.max_candidates)) {
    return std::nullopt;
  }
  std::vector<int64_t> key = {users - 1, history, candidates, fresh, pad.width};
  for (const char* name : kStaticInputs) key.push_back(reinterpret_cast<int64_t>(inputs.at(name).data_ptr()));
  return key;
}

// What the copies into a bucket's buffers depend on: each row input's rows and the page table's sizes.
std::vector<int64_t> request_sizes(const ProgramInputs& inputs) {
  std::vector<int64_t> sizes;
  for (const char* name : kRowInputs) sizes.push_back(inputs.at(name).size(0));
  for (int64_t size : inputs.at("kv_page_table").sizes()) sizes.push_back(size);
  return sizes;
}

// Where a request's tensors go in its bucket's buffers: each embedding's target, with its name (copied on its
// own: kv_graphs.py's copied_alone says why); the other inputs' targets grouped by dtype, with their names;
// the page table's real columns, and its later ones (a narrower table) when there are any.
struct Copies {
  std::vector<int64_t> sizes;
  std::vector<std::pair<at::Tensor, std::string>> singles;
  std::vector<std::pair<std::vector<at::Tensor>, std::vector<std::string>>> groups;
  at::Tensor table;
  std::optional<at::Tensor> rest;
};

Copies copies_into(const ProgramInputs& buffers, const ProgramInputs& inputs) {
  Copies out;
  out.sizes = request_sizes(inputs);
  std::map<at::ScalarType, size_t> group_of;
  auto add = [&](const char* name, bool row_input) {
    const at::Tensor& value = inputs.at(name);
    int64_t rows = value.size(0);
    if (rows == 0) return;
    if (row_input && value.is_floating_point()) {
      out.singles.emplace_back(buffers.at(name).narrow(0, 0, rows), name);
      return;
    }
    auto [it, fresh] = group_of.emplace(value.scalar_type(), out.groups.size());
    if (fresh) out.groups.emplace_back();
    out.groups[it->second].first.push_back(buffers.at(name).narrow(0, 0, rows));
    out.groups[it->second].second.emplace_back(name);
  };
  for (const char* name : kRowInputs) add(name, true);
  for (const char* name : kUserInputs) add(name, false);
  const at::Tensor& table = buffers.at("kv_page_table");
  int64_t batch = inputs.at("kv_page_table").size(0), width = inputs.at("kv_page_table").size(1);
  out.table = table.narrow(0, 0, batch).narrow(1, 0, width);
  if (width < table.size(1)) out.rest = table.narrow(0, 0, batch).narrow(1, width, table.size(1) - width);
  return out;
}

// The padding user's two counts (after the `batch` real users') so that the counts add up to the
// bucket's rows: device work only, run at the start of every replay (so captured with the program), for a
// program that does not fit the counts itself (Buckets::fitted_counts).
void padding_counts(ProgramInputs& buffers, int64_t batch) {
  for (auto [name, rows] : {std::pair<const char*, const char*>{"uih_lengths", "uih_item_emb"},
                            {"candidate_lengths", "candidate_item_emb"}}) {
    at::Tensor& counts = buffers.at(name);
    // The bucket's rows as a host scalar: a graph keeps it as a kernel argument.
    at::Tensor total = at::scalar_tensor(buffers.at(rows).size(0), counts.options().device(at::kCPU));
    at::Tensor padding = counts.narrow(0, batch, 1);
    at::sub_out(padding, total, counts.narrow(0, 0, batch).sum(0, /*keepdim=*/true));
  }
}

// The outputs' first `rows` rows in new tensors (the buffers are the next replay's).
std::vector<at::Tensor> first_rows(const std::vector<at::Tensor>& outputs, int64_t rows) {
  std::vector<at::Tensor> parts;
  for (const auto& value : outputs) parts.push_back(value.narrow(0, 0, rows));
  return copied(parts);
}

#ifdef HSTU_EXPORT_CUDA_GRAPHS
// Writes input `name` of a request into its bucket's buffers (a kernel or memcpy launched on the stream): the
// page table's real columns, and its later columns (a narrower table) set to the scratch page, so that no
// write lands in an earlier request's pages.
void copy_alone(ProgramInputs& buffers, const ProgramInputs& inputs, const std::string& name) {
  const at::Tensor& value = inputs.at(name);
  at::Tensor& buffer = buffers.at(name);
  if (name != "kv_page_table") {
    buffer.narrow(0, 0, value.size(0)).copy_(value);
    return;
  }
  int64_t batch = value.size(0), width = value.size(1);
  at::Tensor rows = buffer.narrow(0, 0, batch);
  rows.narrow(1, 0, width).copy_(value);
  if (width < buffer.size(1)) rows.narrow(1, width, buffer.size(1) - width).fill_(scratch_page(inputs));
}

// The CUDA runtime's graph functions that repoint a graph's copies, found in the process (libtorch_cuda has
// loaded the CUDA runtime), so that the runtime needs no link to it and builds with the compiler alone. Where
// one is missing, requests are copied before the replay instead.
struct GraphApi {
  decltype(&cudaGraphGetNodes) get_nodes = nullptr;
  decltype(&cudaGraphNodeGetType) node_type = nullptr;
  decltype(&cudaGraphMemcpyNodeGetParams) memcpy_params = nullptr;
  decltype(&cudaGraphExecMemcpyNodeSetParams1D) set_memcpy = nullptr;

  bool found() const { return get_nodes && node_type && memcpy_params && set_memcpy; }
};

const GraphApi& graph_api() {
  static const GraphApi api = [] {
    GraphApi found;
    auto lookup = [](auto& fn, const char* name) {
      fn = reinterpret_cast<std::decay_t<decltype(fn)>>(dlsym(RTLD_DEFAULT, name));
    };
    lookup(found.get_nodes, "cudaGraphGetNodes");
    lookup(found.node_type, "cudaGraphNodeGetType");
    lookup(found.memcpy_params, "cudaGraphMemcpyNodeGetParams");
    lookup(found.set_memcpy, "cudaGraphExecMemcpyNodeSetParams1D");
    return found;
  }();
  return api;
}

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw Error(std::string("CUDA graph: ") + what + " failed (CUDA error " + std::to_string(status) + ")");
  }
}
#endif

}  // namespace

std::vector<at::Tensor> copied(const std::vector<at::Tensor>& values) {
  std::vector<at::Tensor> out;
  for (const auto& value : values) out.push_back(at::empty(value.sizes(), value.options()));
  at::_foreach_copy_(out, values);
  return out;
}

bool cuda_graphs_built() {
#ifdef HSTU_EXPORT_CUDA_GRAPHS
  return true;
#else
  return false;
#endif
}

struct DeltaGraphs::Impl {
  struct Graph {
#ifdef HSTU_EXPORT_CUDA_GRAPHS
    std::unique_ptr<at::cuda::CUDAGraph> graph;
#endif
    ProgramInputs buffers;
    std::vector<at::Tensor> outputs;
    std::optional<Copies> copies;  // the last request's, kept for the next one of the same sizes
    std::list<std::vector<int64_t>>::iterator order;
#ifdef HSTU_EXPORT_CUDA_GRAPHS
    // The graph's copies of a request into the buffers, by input (none: requests are copied before a replay).
    std::vector<std::pair<std::string, cudaGraphNode_t>> copy_nodes;
    // What each copy node copies now (source, bytes): a node already pointed at the request's tensor is left
    // as it is (repointing a node is a driver call of a few microseconds; requests of one shape often get
    // their tensors at the addresses the previous one had).
    std::vector<std::pair<const void*, size_t>> pointed;
    ProgramInputs sources;  // what the captured copies read: kept alive, though each replay repoints them
    at::Tensor dummy;       // two bytes: a copy node with nothing to copy copies one of them onto the other
#endif
  };

  RunProgram run;
  Buckets buckets;
  int64_t contextual = 0;
  bool capture = true;
  size_t max_graphs = 16;
  std::mutex mutex;
  std::map<std::vector<int64_t>, Graph> graphs;
  std::list<std::vector<int64_t>> recency;  // least recently used first
  std::map<std::vector<int64_t>, int> seen;
  Counts counts;
#ifdef HSTU_EXPORT_CUDA_GRAPHS
  std::optional<at::cuda::MempoolId_t> pool;
#endif

  std::vector<at::Tensor> run_bucket(ProgramInputs& buffers) {
    if (!buckets.fitted_counts) padding_counts(buffers, buffers.at("kv_cached").size(0) - 1);
    return run(buffers);
  }

  Graph make(const ProgramInputs& padded) {
    Graph entry;
    for (const auto& [name, value] : padded) entry.buffers[name] = is_static(name) ? value : value.clone();
    if (!capture) return entry;
#ifdef HSTU_EXPORT_CUDA_GRAPHS
    c10::Device device = padded.at("kv_k_pages").device();
    if (!pool) pool = at::cuda::graph_pool_handle();
    torch::cuda::synchronize(device.index());
    {
      // Warm up outside the capture (allocations, lazy initialisation), then capture on a side stream.
      c10::cuda::CUDAStreamGuard side(c10::cuda::getStreamFromPool(false, device.index()));
      for (int i = 0; i < 2; ++i) run_bucket(entry.buffers);
      torch::cuda::synchronize(device.index());
      bool copies = graph_api().found();
      if (copies) {
        for (const auto& [name, value] : padded) {
          if (!is_static(name) && value.numel() > 0) entry.sources[name] = value;
        }
        entry.dummy = at::zeros({2}, padded.at("kv_page_table").options().dtype(at::kByte));
      }
      capture_into(entry, copies);
      if (copies && !find_copy_nodes(entry)) {  // a copy that did not become a memcpy node: without them
        entry.copy_nodes.clear();
        entry.sources.clear();
        capture_into(entry, false);
      }
    }
    torch::cuda::synchronize(device.index());
    counts.captures += 1;
    if (!entry.copy_nodes.empty()) counts.copying += 1;
#else
    throw Error("this C++ runtime was built without CUDA graph support (no CUDA headers at build time)");
#endif
    return entry;
  }

#ifdef HSTU_EXPORT_CUDA_GRAPHS
  // Captures the program on the buffers, after copies of `entry.sources` into them when `copies`.
  void capture_into(Graph& entry, bool copies) {
    entry.graph = std::make_unique<at::cuda::CUDAGraph>(/*keep_graph=*/copies);  // kept: its copy nodes
    // Only this thread is kept from calls that could break the capture: by default (global mode) every thread of
    // the process is, and another thread's synchronising copy fails, and the capture with it (kv_graphs.py).
    entry.graph->capture_begin(*pool, cudaStreamCaptureModeThreadLocal);
    try {
      // The copies form a chain on the capturing stream: as parallel branches (a stream and two events each)
      // they take no less GPU time and 15-37 us more host time to launch (docs/PERF_INVESTIGATIONS.md,
      // "Known not to work").
      if (copies) {
        for (const auto& [name, value] : entry.sources) entry.buffers.at(name).copy_(value);
      }
      entry.outputs = run_bucket(entry.buffers);
    } catch (...) {
      entry.graph->capture_end();
      throw;
    }
    entry.graph->capture_end();
  }

  // The captured copies' memcpy nodes (from each source into its buffer), and the graph instantiated: false
  // when a copy is not among them.
  bool find_copy_nodes(Graph& entry) {
    const GraphApi& api = graph_api();
    cudaGraph_t graph = entry.graph->raw_cuda_graph();
    size_t count = 0;
    check(api.get_nodes(graph, nullptr, &count), "listing the nodes");
    std::vector<cudaGraphNode_t> nodes(count);
    check(api.get_nodes(graph, nodes.data(), &count), "listing the nodes");
    for (cudaGraphNode_t node : nodes) {
      cudaGraphNodeType type;
      check(api.node_type(node, &type), "reading a node's type");
      if (type != cudaGraphNodeTypeMemcpy) continue;
      cudaMemcpy3DParms params{};
      check(api.memcpy_params(node, &params), "reading a copy's parameters");
      for (const auto& [name, source] : entry.sources) {
        if (params.dstPtr.ptr == entry.buffers.at(name).data_ptr() && params.srcPtr.ptr == source.data_ptr()) {
          entry.copy_nodes.emplace_back(name, node);
        }
      }
    }
    if (entry.copy_nodes.size() != entry.sources.size()) return false;
    entry.graph->instantiate();
    return true;
  }

  // Points each copy node at the request's tensor; an input it cannot take as it is (not contiguous, another
  // shape per row: a narrower page table) is copied before the replay, its node then copying nothing of use.
  void point_copies(Graph& entry, const ProgramInputs& inputs) {
    const GraphApi& api = graph_api();
    cudaGraphExec_t exec = entry.graph->raw_cuda_graph_exec();
    auto* dummy = static_cast<uint8_t*>(entry.dummy.data_ptr());
    entry.pointed.resize(entry.copy_nodes.size(), {nullptr, 0});
    for (size_t i = 0; i < entry.copy_nodes.size(); ++i) {
      const auto& [name, node] = entry.copy_nodes[i];
      const at::Tensor& value = inputs.at(name);
      const at::Tensor& buffer = entry.buffers.at(name);
      size_t bytes = value.numel() * value.element_size();
      bool direct = bytes > 0 && value.is_contiguous() && value.scalar_type() == buffer.scalar_type() &&
                    value.device() == buffer.device() && value.dim() == buffer.dim() &&
                    value.sizes().slice(1) == buffer.sizes().slice(1) && value.size(0) <= buffer.size(0);
      std::pair<const void*, size_t> wanted(direct ? value.data_ptr() : static_cast<void*>(dummy), direct ? bytes : 1);
      counts.copies += 1;
      if (wanted != entry.pointed[i]) {
        counts.repointed += 1;
        if (direct) {
          check(api.set_memcpy(exec, node, buffer.data_ptr(), value.data_ptr(), bytes, cudaMemcpyDeviceToDevice),
                "pointing a copy at a request");
        } else {
          check(api.set_memcpy(exec, node, dummy + 1, dummy, 1, cudaMemcpyDeviceToDevice),
                "pointing a copy at nothing");
        }
        entry.pointed[i] = wanted;
      }
      if (!direct && bytes > 0) copy_alone(entry.buffers, inputs, name);
    }
    // An input the capture had no rows of (so no copy node) is copied before the replay.
    for (const auto& [name, value] : inputs) {
      if (!is_static(name) && value.numel() > 0 && !entry.sources.count(name)) copy_alone(entry.buffers, inputs, name);
    }
  }
#endif

  int64_t fill(Graph& entry, const ProgramInputs& inputs) {
#ifdef HSTU_EXPORT_CUDA_GRAPHS
    if (!entry.copy_nodes.empty()) {
      point_copies(entry, inputs);
      return inputs.at("candidate_item_emb").size(0);
    }
#endif
    if (!entry.copies || entry.copies->sizes != request_sizes(inputs)) entry.copies = copies_into(entry.buffers, inputs);
    for (auto& [target, name] : entry.copies->singles) target.copy_(inputs.at(name));
    for (const auto& [targets, names] : entry.copies->groups) {
      std::vector<at::Tensor> sources;
      for (const auto& name : names) sources.push_back(inputs.at(name));
      at::_foreach_copy_(targets, sources);
    }
    entry.copies->table.copy_(inputs.at("kv_page_table"));
    // Later columns may hold an earlier request's pages: the scratch page, so that no write lands there.
    if (entry.copies->rest) entry.copies->rest->fill_(scratch_page(inputs));
    return inputs.at("candidate_item_emb").size(0);
  }
};

DeltaGraphs::DeltaGraphs(RunProgram run, Buckets buckets, int64_t contextual, bool capture, size_t max_graphs)
    : impl_(std::make_unique<Impl>()) {
  impl_->run = std::move(run);
  impl_->buckets = buckets;
  impl_->contextual = contextual;
  impl_->capture = capture;
  impl_->max_graphs = std::max<size_t>(max_graphs, 1);
}

DeltaGraphs::~DeltaGraphs() = default;

int64_t DeltaGraphs::table_width(int64_t width) const { return bucket_width(width, impl_->buckets); }

DeltaGraphs::Counts DeltaGraphs::counts() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->counts;
}

std::vector<at::Tensor> DeltaGraphs::operator()(const ProgramInputs& inputs) {
  Impl& s = *impl_;
  std::optional<std::vector<int64_t>> found = bucket_key(inputs, s.buckets, s.contextual);
  if (!found) {  // padded, it would be beyond the program's bounds
    {
      std::lock_guard<std::mutex> lock(s.mutex);
      s.counts.eager += 1;
    }
    return s.run(inputs);
  }
  const std::vector<int64_t>& key = *found;
  std::lock_guard<std::mutex> lock(s.mutex);
  auto it = s.graphs.find(key);
  int64_t candidates = inputs.at("candidate_item_emb").size(0);
  if (it == s.graphs.end()) {
    if (s.seen.size() > kMaxSeen) s.seen.clear();  // shapes seen once, long ago, are forgotten
    if (++s.seen[key] < 2) {
      s.counts.eager += 1;
      return s.run(inputs);
    }
    Impl::Graph entry = s.make(pad_to_bucket(inputs, s.buckets, s.contextual));
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
    entry.outputs = s.run_bucket(entry.buffers);
  }
#else
  entry.outputs = s.run_bucket(entry.buffers);
#endif
  s.counts.replays += 1;
  return first_rows(entry.outputs, candidates);
}

}  // namespace hstu_export::detail
