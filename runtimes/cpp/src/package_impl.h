// Package::Impl and what runtime.cpp (Package) and kv_cache.cpp (CachedRanker) share. Internal: not installed.
#pragma once

#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/script.h>

#include <array>
#include <chrono>
#include <filesystem>
#include <map>
#include <set>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "hstu_export/runtime.h"
#include "shape_graphs.h"
#include "tables.h"

namespace hstu_export {
namespace detail {

// The first non-blank line of an exception's message (c10 errors without their backtrace), at most 400 chars.
std::string error_text(const std::exception& exc);
std::string in_quotes(const std::string& text);
std::optional<at::ScalarType> scalar_type(const std::string& name);  // manifest dtype names
// The version `current` names in a directory hstu-export publish writes (ROOT/1, ROOT/2, ..., ROOT/current -> N,
// no manifest of its own); nullopt for any other path. PackageError when `current` names no published version.
std::optional<int64_t> published_version(const std::string& path);
// Outputs of a TorchScript call (a dict by name, or a tuple/list/tensor in the declared order).
NamedTensors named_outputs(const c10::IValue& value, const std::vector<std::string>& names, const std::string& what);

// An AOTInductor program (.pt2). On CUDA it is called through AOTInductor's single-threaded runner: the
// default runner makes each call wait on the host until the previous call has finished on the GPU (an
// event sync, which also cannot be captured into a CUDA graph); calls are serialised by a lock held while
// the kernels are launched. On CPU, up to `concurrency` model instances run at once.
class AotiProgram {
 public:
  // `model`: which of the package's compiled models (one package may hold several; a stock loader takes "model").
  AotiProgram(const std::string& path, c10::Device device, size_t concurrency, const std::string& model = "model");
  std::vector<at::Tensor> run(const std::vector<at::Tensor>& inputs) const;
  // The program reads `tables` in place from now on (AOTInductor's user-managed constants; kept alive here).
  // PackageError naming `what` when the program takes a constant `tables` lacks, or of another dtype.
  void use_constants(std::unordered_map<std::string, at::Tensor> tables, const std::string& what);
  // The tables handed by use_constants, by name (empty before).
  const std::unordered_map<std::string, at::Tensor>& constants() const { return constants_; }

 private:
  std::unique_ptr<torch::inductor::AOTIModelPackageLoader> loader_;
  std::unordered_map<std::string, at::Tensor> constants_;
  bool serialised_ = false;
  mutable std::mutex launch_;
};

struct TensorSpec {
  std::string name;
  std::string feature;  // the request feature it is fed from; "" for an output of the sparse artifact
};

struct Artifact {
  std::string file;
  std::string format;
  std::vector<TensorSpec> inputs;
  std::vector<std::string> outputs;
  // Tables stored outside the program (artifacts.<role>.constants): their file ("" for none) and tensors.
  std::string constants_file;
  std::vector<TableSpec> constants;
};

// The zoo ranking model's request features that the KV cache reads (hstu_export/models/ranking.py): a
// package's kv_cache section is usable only when its request has them.
inline constexpr const char* kHistoryLengths = "uih_lengths";
inline constexpr const char* kCandidateLengths = "candidate_lengths";
inline constexpr const char* kQueryTime = "query_time";
inline constexpr std::array<const char*, 3> kTokenRows = {"uih_item_ids", "uih_action_ids", "uih_timestamps"};

// The manifest's kv_cache section (docs/KV_CACHE.md): the delta program and what the cache's pages and
// its reuse checks need to know of the model.
struct KVSection {
  std::string program_file;
  std::filesystem::path program;  // inside the package, listed in files (so checksummed)
  std::vector<std::string> inputs;
  std::vector<std::string> outputs;
  int64_t page_size = 0;
  int64_t max_seq_len = 0;
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t attention_dim = 0;
  int64_t linear_dim = 0;
  std::vector<std::string> contextual_features;
  double time_bucket_base = 0;
  int64_t num_time_buckets = 0;
  at::ScalarType dtype = at::kFloat;  // the package's dtype: the pages'
  int64_t min_history = 0;            // the exported minimum history length (the sparse half's)
  int64_t max_history = 0;            // and the exported maxima of a user's history and candidates
  int64_t max_candidates = 0;
  // The most users, new history tokens and candidates one call of the delta program takes (its exported
  // dims): the section's bounds, or for older packages what hstu_export/kv_export.py's legacy_program_bounds
  // gives.
  int64_t bound_batch = 0;
  int64_t bound_history = 0;
  int64_t bound_candidates = 0;
  // The program cuts each user's token counts where its tables' rows run out (the section's fits_counts; false
  // for older packages): a shape bucket's padding user is then given the bucket's rows, once.
  bool fits_counts = false;
};

// kv_cache.padding: a derived program's shape buckets (kv_padding.h).
struct PaddingSpec {
  std::map<std::string, std::string> rows_of;  // output -> request feature or cache input whose rows it follows, or ""
  std::set<std::string> target_features;       // the lengths features the targets are counted from
};

// A delta program derived from the model's graph (kv_cache.kind "derived": hstu_export/kv_derive.py) and its
// counts program, both AOTInductor packages inside the package.
struct DerivedKVSection {
  std::string program_file;
  std::filesystem::path program;
  std::string counts_file;
  std::filesystem::path counts;
  std::vector<std::string> inputs;         // the dense half's inputs, request ids, then the cache's (kv_*)
  // Inputs fed from the request (the ids the frontier rows are compared as): input name -> feature name.
  std::map<std::string, std::string> request_inputs;
  // kv_cache.sparse_inside: the program holds the sparse half (its prechecked model) and takes the request and
  // the sparse half's tables (input name -> table name), not the sparse half's outputs.
  bool sparse_inside = false;
  std::map<std::string, std::string> table_inputs;
  std::vector<std::string> counts_inputs;  // dense inputs -> (sequence length, target count) per user
  std::vector<std::string> outputs;        // the package's outputs, then kv_stale
  int64_t page_size = 0;
  int64_t max_seq_len = 0;
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t attention_dim = 0;
  int64_t linear_dim = 0;
  int64_t row_width = 0;  // each cached token's frontier row
  at::ScalarType row_dtype = at::kFloat;
  at::ScalarType dtype = at::kFloat;  // the package's dtype: the K/V pages'
  int64_t device_reads = -1;  // values the program reads back from its device a call; -1: not recorded
  // kv_cache.counts_on_host: each user's sequence length and target count as a constant plus integer multiples
  // of request features (by feature name), added up on the host instead of running the counts program.
  struct HostSum {
    std::vector<std::pair<std::string, int64_t>> terms;
    int64_t constant = 0;
  };
  std::optional<std::pair<HostSum, HostSum>> host_counts;
  std::optional<PaddingSpec> padding;
};

// A request tensor as compiled code may read it: row-major strides exactly, no autograd history.
at::Tensor plain_tensor(const at::Tensor& value);

// Each tensor not on `device` replaced by its copy there, row-major. To a CUDA device, the small host tensors
// (up to 256 KiB each) go in one transfer: packed into one pinned buffer and copied with one asynchronous copy
// into one device buffer, of which they are views (a request's separate small copies each wait on the host).
void to_device(std::vector<at::Tensor>& tensors, c10::Device device);

// Times a run's phases into a PhaseTimes (nothing without one): synchronises the device on construction
// and at every lap, and adds the time since the last mark to a field.
class PhaseClock {
 public:
  PhaseClock(PhaseTimes* times, c10::Device device);
  void lap(double PhaseTimes::*field);
  // Adds the time since the last mark to `field` without waiting for the device (the mark stays).
  void split(double PhaseTimes::*field);
  // A part of the current phase: from begin_part() to end_part(field), the device synchronised at both ends,
  // added to `field` (the phase's own mark stays).
  void begin_part();
  void end_part(double PhaseTimes::*field);
  // Records that the sparse half runs inside the dense half's graph.
  void sparse_in_dense(bool inside) {
    if (times_ != nullptr) times_->sparse_in_dense = inside;
  }

 private:
  PhaseTimes* times_;
  c10::Device device_;
  std::chrono::steady_clock::time_point mark_;
  std::chrono::steady_clock::time_point part_;
};

}  // namespace detail

struct Package::Impl {
  std::string root;
  std::string backend;
  c10::Device device = c10::Device(c10::kCPU);
  int64_t max_batch_size = 0;
  size_t concurrency = 1;
  std::vector<Feature> features;
  std::vector<std::string> output_names;
  std::map<std::string, detail::Artifact> artifacts;  // by role: model | sparse + dense
  // TorchScript modules: forward is safe to call from several threads; Module's API is not const.
  mutable torch::jit::Module model;
  mutable torch::jit::Module sparse;
  // The sparse half when AOTInductor compiled it (artifacts.sparse.format "aoti"; `sparse` is then unset).
  std::unique_ptr<detail::AotiProgram> sparse_program;
  // Which of its models runs: "model" (its ranges checked inside, reading the device), or the prechecked one (ids
  // clamped; backend.meta.sparse_program.prechecked) when the manifest's ranges, which run() checks on the host
  // first, lie within those it was compiled for. Empty without a compiled sparse half.
  std::string sparse_model;
  // What each of its compiled range checks refuses, by the symbol its error names ("Expected u5 <= 999 but
  // received 1000"): the feature and "low" | "high" | "rows" (backend.meta.sparse_program.range_checks; may be
  // empty).
  std::map<std::string, std::pair<std::string, std::string>> sparse_checks;
  std::unique_ptr<detail::AotiProgram> dense;
  // Values the dense program reads back from its device a call (backend.meta.dense_device_reads); -1: not recorded.
  int64_t dense_device_reads = -1;
  // Whole requests (the sparse half, then the dense half) from exact-shape CUDA graphs (Options::graphs), or null.
  std::unique_ptr<detail::ShapeGraphs> graphs;
  // The KV-cache section when the package has one and it reads well; else kv_problem says why not (a
  // package whose cache section this runtime cannot use still serves requests without a cache).
  std::optional<detail::KVSection> kv;
  std::optional<detail::DerivedKVSection> derived_kv;
  std::string kv_problem;

  // `also`: more tensors for the device, moved in the same transfer (replaced in place; must be row-major).
  Tensors plain(const Tensors& request, std::vector<at::Tensor>* also = nullptr) const;
  // The sparse artifact on a plain request: its outputs by name (aoti packages).
  NamedTensors sparse_outputs(const Tensors& request) const;
  // The dense program's inputs in its order: request features as they are, the sparse half's outputs (`boundary`)
  // made contiguous; an Error naming an output the sparse half did not give.
  std::vector<at::Tensor> dense_inputs(const Tensors& request, const NamedTensors& boundary) const;
  // Why run() cannot replay this package from CUDA graphs ("" when it can): something reads the device.
  std::string graphs_unsafe() const;
  // A compiled sparse program's refusal `exc` as check_ranges' TorchScript assert words it, when sparse_checks
  // names the check that raised it.
  std::optional<std::string> named_check(const std::exception& exc) const;
  NamedTensors run(const Tensors& inputs, detail::PhaseClock& clock) const;
  // When `exc`, raised while the artifacts ran `request`, is one of their own range checks (passes/guard_ranges.py;
  // the manifest let the request through), the RequestError naming the feature, its value and the limit the
  // artifact holds it to; when it is a guard compiled into a program, the RequestError naming the request's
  // features at their limits (docs/PACKAGE.md, "Every request inside the ranges"); nullopt for any other error.
  std::optional<RequestError> range_refusal(const std::exception& exc, const Tensors& request) const;
  std::string at_limits(const Tensors& request) const;
};

}  // namespace hstu_export
