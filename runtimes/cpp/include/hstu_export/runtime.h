// hstu-export C++ runtime: open an hstu-export package (docs/PACKAGE.md), check it, and serve requests
// from C++ with no Python in the process.
//
//   auto package = hstu_export::Package::open("model.aoti");
//   hstu_export::Tensors request = ...;               // feature name -> tensor, as the manifest's input_schema
//   for (auto& [name, tensor] : package->run(request)) ...   // outputs in the manifest's output_names order
//
// Package::open checks, in order: manifest.sha256 against manifest.json, the package format and its
// format_version, every path (inside the package, no links), every file's sha256, the torch major.minor
// the package was built with, the device; then loads the op libraries the package needs (from a fixed
// list, never a path the manifest names) and the artifacts. A Package is immutable once open, and run()
// may be called from many threads at once.
#pragma once

#include <ATen/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace hstu_export {

// Every error the runtime raises on purpose: one line that says what is wrong and what to do.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};
// The package cannot be opened (missing, tampered with, another format, another torch, a missing library).
class PackageError : public Error {
 public:
  using Error::Error;
};
// A request does not fit the package's input schema or exported ranges; the package stays usable.
class RequestError : public Error {
 public:
  using Error::Error;
};

// Whether calls run from CUDA graphs: kOn, kOff, kAuto (on where it is safe: a CUDA package, a runtime built with
// CUDA headers, nothing that reads the device before the outputs), or kBuckets: the graphs' bookkeeping (keys,
// buffers, copies) without capturing, on any device, which is what CPU tests check.
enum class Graphs { kAuto, kOn, kOff, kBuckets };

// How calls ran through CUDA graphs (Package::graph_counts, CachedRanker::graph_counts).
struct GraphCounts {
  int64_t replays = 0;   // calls run in a graph (or, kBuckets, on its buffers)
  int64_t captures = 0;  // graphs captured
  int64_t eager = 0;     // calls of a shape seen once (or past the copy limit), run as they are
  int64_t copying = 0;   // graphs captured with the request's copies inside them (of `captures`)
  int64_t copies = 0;    // copies of a request's tensors those graphs made: one per input and replay
  int64_t repointed = 0;  // of `copies`: those whose node was pointed anew (the tensor was not where the last was)
  int64_t refused = 0;    // captures that failed (exact-shape graphs): that shape runs as it is
};

struct Options {
  // Directories searched for op libraries (fbgemm_gpu_py.so, ...) before $HSTU_EXPORT_OP_LIBRARY_PATH
  // (':'-separated) and the directories found when the runtime was built.
  std::vector<std::string> op_library_dirs;
  // Check every file's sha256 against the manifest (manifest.sha256 is always checked).
  bool verify_checksums = true;
  // AOTInductor model instances that may run at once on CPU; calls beyond wait for a free one. On CUDA
  // calls launch their kernels one at a time and never wait on the host for an earlier call's GPU work.
  size_t concurrency = 1;
  // Where the tables stored beside a compiled sparse program live (artifacts.sparse.constants): "" on the package's
  // device; "cpu" for a CUDA package: in pinned host memory, read by the program over the bus (unified addressing),
  // so tables larger than the GPU's memory serve. A package that keeps its tables inside its programs refuses it.
  std::string tables_device;
  // The CUDA device a CUDA package runs on (its programs, tables and KV cache); a CPU package ignores it.
  int device_index = 0;
  // Whole requests replayed from CUDA graphs, one per exact request shapes seen twice (the compiled sparse half's
  // lookups, then the dense half), for the first 16 shapes captured (docs/SERVING.md, "Whole-request CUDA graphs"). kAuto: on for a CUDA package
  // whose programs read nothing back from the device (a compiled sparse half running its prechecked model, and
  // backend.meta.dense_device_reads 0); kOn refuses any other package in one line.
  Graphs graphs = Graphs::kAuto;
  // A call whose request tensors exceed this many bytes runs as it is: a larger request keeps the GPU busy longer than
  // the host takes to launch it, and a graph saves nothing. 0: 512 KiB (5 users of 4096 history tokens and 256 candidates).
  int64_t graph_copy_limit = 0;
};

// One request feature, as the manifest's input_schema describes it.
struct Feature {
  std::string name;
  std::string dtype;  // int64, int32, float32, bfloat16, float16, float64, bool
  std::string kind;   // lengths, jagged, per_user
  std::string jagged_by;
  std::string same_as;
  std::optional<double> min_value;
  std::optional<double> max_value;
  std::vector<int64_t> trailing;  // sizes after the first dim
};

using Tensors = std::unordered_map<std::string, at::Tensor>;
using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// Where one request's time went, when a run is asked for it (run(..., &times)): the device is synchronised
// when the run starts and after each phase, so each phase is timed from an idle device to its last kernel.
// The dense half is timed as it is served: for a KV-cached request, the delta program with its shape
// bucket's copies and its CUDA-graph replay. The synchronisations are not free: time whole requests
// without it.
struct PhaseTimes {
  double before_dense_ms = 0;  // validation, the sparse half, the dense half's inputs (and the cache's bookkeeping)
  double dense_ms = 0;
  double dense_launch_ms = 0;  // of dense_ms: until the call that launches the dense half returned (host work)
  double after_dense_ms = 0;  // the outputs (and recording what the cache's pages hold)
  // Parts of before_dense_ms (the device synchronised around each): the request's tensors moved to the device,
  // and the sparse half. The rest of it is the host's: validation, the cache's bookkeeping, the dense inputs.
  double to_device_ms = 0;
  double sparse_ms = 0;
  // A derived delta program's whole-request graph ran the sparse half inside the dense half (sparse_ms is 0).
  bool sparse_in_dense = false;
};

class Package {
 public:
  // ``path``: a package, or a directory hstu-export publish writes (its current version is opened).
  static std::shared_ptr<const Package> open(const std::string& path, const Options& options = {});
  ~Package();
  Package(const Package&) = delete;
  Package& operator=(const Package&) = delete;

  // Validates the request (RequestError naming the first problem), runs it, and returns the outputs in
  // output_names() order, on the package's device. A request the artifacts' own range checks refuse (a manifest
  // that allows more than they were exported for) is a RequestError naming the feature and their limit too.
  // Thread-safe. `times`: see PhaseTimes.
  NamedTensors run(const Tensors& request, PhaseTimes* times = nullptr) const;
  // The request's batch size, or RequestError: names, dtypes, shapes, value ranges, batch size, jagged totals.
  int64_t validate(const Tensors& request) const;

  const std::string& path() const;
  const std::string& backend() const;
  // Which model of a compiled sparse half runs: "model" (checks its ranges itself, reading them from the device) or
  // "prechecked" (ids clamped; the manifest's ranges, checked by run() on the host, lie within its own). Empty when
  // the sparse half is not compiled (TorchScript).
  const std::string& sparse_model() const;
  c10::Device device() const;
  int64_t max_batch_size() const;
  const std::vector<Feature>& features() const;
  const std::vector<std::string>& output_names() const;
  // Whether run() goes through exact-shape CUDA graphs (Options::graphs; kBuckets counts too), and how calls ran.
  bool graphed() const;
  GraphCounts graph_counts() const;

  struct Impl;

 private:
  friend class CachedRanker;  // KV-cached serving runs the package's sparse half and its delta program
  explicit Package(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// A directory hstu-export publish writes, served while it changes: every call runs wholly on one version, the one
// `current` named when it was last looked at (at most every `check_seconds`, by a call). A newly named version is
// opened on a thread of its own while calls go on with the version before; calls move to it once it is open,
// between requests, and a call still running on the old version finishes there. A version that cannot be opened,
// or whose features, maximum batch size, outputs or device differ from the served one's, is not served:
// last_error() says why, and it is tried again only once `current` names another version.
class PublishedPackage {
 public:
  // PackageError when `root` is not such a directory, or its current version does not open.
  static std::shared_ptr<PublishedPackage> open(const std::string& root, const Options& options = {},
                                                double check_seconds = 1.0);
  ~PublishedPackage();  // waits for a version being opened
  PublishedPackage(const PublishedPackage&) = delete;
  PublishedPackage& operator=(const PublishedPackage&) = delete;

  // Package::run on the version served now; `version`, if given, is set to the version that ran it. Thread-safe.
  NamedTensors run(const Tensors& request, PhaseTimes* times = nullptr, int64_t* version = nullptr);
  // Looks at `current` now and, if it names another version, opens it before returning; the version served.
  int64_t refresh();
  std::shared_ptr<const Package> package() const;  // the version served now
  int64_t version() const;
  int64_t switches() const;
  std::string last_error() const;  // why the version `current` names is not served; "" when it is
  const std::string& root() const;

  struct Impl;

 private:
  explicit PublishedPackage(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The package format_versions this runtime reads (4: a compiled sparse program holds its tables; 5: they are stored
// beside it).
constexpr int kPackageFormatVersion = 5;
constexpr int kOldestReadableFormat = 4;

// Directories of named tensors, one torch.save'd tensor per <name>.pt with the name percent-encoded
// (docs/PACKAGE.md, "Requests on disk"): what hstu-export request writes and hstu-export-run reads.
std::string tensor_file_name(const std::string& name);
Tensors load_tensor_dir(const std::string& directory);  // RequestError on anything but tensors
// Whole or not at all: on failure (a full disk) no file of it is left or replaced, nor a directory it created.
void save_tensor_dir(const NamedTensors& tensors, const std::string& directory);

}  // namespace hstu_export
