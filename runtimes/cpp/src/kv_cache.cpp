// CachedRanker: the paged KV cache of hstu_export/serving/kv_cache.py, in C++, over a package's delta
// program (docs/KV_CACHE.md). The bookkeeping follows the Python one step for step (reuse checks, page
// reservation, eviction order, counters), so the two serve the same requests with the same programs'
// inputs; tests/test_cpp_kv_cache.py compares them.
#include "hstu_export/kv_cache.h"

#include <ATen/Parallel.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <atomic>
#include <array>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <list>
#include <mutex>
#include <optional>
#include <sstream>
#include <unordered_map>

#include "kv_graphs.h"
#include "kv_padding.h"
#include "shape_graphs.h"
#include "package_impl.h"

namespace hstu_export {

namespace {

using detail::kHistoryLengths;
using detail::kQueryTime;
using detail::kTokenRows;
constexpr size_t kTimestampRow = 2;  // kTokenRows[2]
// The sparse half's outputs per history token.
constexpr std::array<const char*, 2> kHistoryEmbeddings = {"uih_item_emb", "uih_action_emb"};
// Beyond any time difference a request holds: the outer bounds of the first and last time buckets.
constexpr int64_t kUnbounded = int64_t{1} << 62;
constexpr size_t kStripes = 64;  // per-user request locks: a fixed set, the user's hash picks one

// `1536` -> `1.5 KiB`, as hstu_export/settings.py's format_bytes writes sizes in messages.
std::string format_bytes(double n) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  char text[32];
  for (const char* unit : kUnits) {
    if (n < 1024) {
      std::snprintf(text, sizeof text, std::strcmp(unit, "B") == 0 ? "%.0f %s" : "%.1f %s", n, unit);
      return text;
    }
    n /= 1024;
  }
  std::snprintf(text, sizeof text, "%.1f PiB", n);
  return text;
}

std::optional<int64_t> file_integer(const char* path) {
  std::ifstream in(path);
  long long value = 0;
  if (in >> value) return value;
  return std::nullopt;  // absent, unreadable, or "max"
}

// (available, total) bytes of host memory this process may take: /proc/meminfo's MemAvailable, within a
// cgroup's limit (v2 or v1), as hstu_export/settings.py's machine_memory reads them; nullopt when unknown.
std::optional<std::pair<int64_t, int64_t>> host_memory() {
  std::ifstream meminfo("/proc/meminfo");
  std::string line;
  int64_t total = -1, available = -1;
  while (std::getline(meminfo, line)) {
    std::istringstream fields(line);
    std::string key;
    long long kib = 0;
    if (!(fields >> key >> kib)) continue;
    if (key == "MemTotal:") total = kib * 1024;
    if (key == "MemAvailable:") available = kib * 1024;
  }
  if (total < 0 || available < 0) return std::nullopt;
  const std::pair<const char*, const char*> kCgroups[] = {
      {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"},
      {"/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"}};
  for (const auto& [limit_file, usage_file] : kCgroups) {
    std::optional<int64_t> limit = file_integer(limit_file);
    if (limit && *limit < total) {
      total = *limit;
      available = std::min(available, std::max<int64_t>(*limit - file_integer(usage_file).value_or(0), 0));
      break;
    }
  }
  return std::pair<int64_t, int64_t>(available, total);
}

// log(query_time - t) / base, in [0, num_buckets): hstu_export/models/transducer.py's time_buckets, with
// the same ATen ops (so the same float32 rounding).
at::Tensor time_buckets(const at::Tensor& query_time, const at::Tensor& timestamps, double base, int64_t num_buckets) {
  at::Tensor delta = (query_time - timestamps).clamp_min(1).to(at::kFloat);
  return (at::log(delta) / base).to(at::kLong).clamp(0, num_buckets - 1);
}

// edges[k] <= d < edges[k + 1] exactly for the time differences d of bucket k: the binary search of
// transducer.py's bucket_edges, over the bucket function itself.
std::vector<int64_t> bucket_edges(double base, int64_t num_buckets) {
  at::Tensor wanted = at::arange(1, num_buckets, at::kLong);
  at::Tensor lo = at::ones_like(wanted);
  at::Tensor hi = at::full_like(wanted, kUnbounded);
  at::Tensor zero = at::zeros_like(wanted);
  for (int step = 0; step < 63; ++step) {  // the bit length of kUnbounded
    at::Tensor mid = at::div(lo + hi, 2, "floor");
    at::Tensor reached = time_buckets(mid, zero, base, num_buckets) >= wanted;
    hi = at::where(reached, mid, hi);
    lo = at::where(reached, lo, mid + 1);
  }
  at::Tensor found = at::where(time_buckets(lo, zero, base, num_buckets) >= wanted, lo, kUnbounded).contiguous();
  std::vector<int64_t> edges = {-kUnbounded};
  edges.insert(edges.end(), found.data_ptr<int64_t>(), found.data_ptr<int64_t>() + found.numel());
  edges.push_back(kUnbounded);
  return edges;
}

// time_buckets of each token i (its user owner[i]'s query time against stamps[i]) read from `edges`, with
// integer comparisons only: the bucket is the number of inner edges at or below the difference, which is what
// time_buckets gives, its edges being where it steps up. nullopt when a difference is beyond the edges' search
// range (kUnbounded), where that does not hold.
std::optional<std::vector<int64_t>> buckets_from_edges(const int64_t* query_time, const std::vector<int64_t>& owner,
                                        const int64_t* stamps, const std::vector<int64_t>& edges) {
  std::vector<int64_t> out(owner.size());
  for (size_t i = 0; i < owner.size(); ++i) {
    // As the tensors subtract: wrapping, then at least 1.
    int64_t d = static_cast<int64_t>(static_cast<uint64_t>(query_time[owner[i]]) - static_cast<uint64_t>(stamps[i]));
    d = std::max<int64_t>(d, 1);
    if (d >= kUnbounded) return std::nullopt;
    out[i] = std::upper_bound(edges.begin() + 1, edges.end() - 1, d) - (edges.begin() + 1);
  }
  return out;
}

// Consecutive history tokens of a user (kTokenRows side by side), never changed once made: the records of
// a user's successive requests share their earlier runs, so that a request that adds tokens copies only
// those (the whole history, copied at each request, was most of a served call's host time at many users).
struct TokenRun {
  std::array<std::vector<int64_t>, 3> rows;
};

// Runs a record keeps before they are merged into one (from the request, which holds the whole history):
// a merge copies the history once every this many requests.
constexpr size_t kMaxRuns = 16;

// What a user's pages hold, left by the request that wrote them.
struct Record {
  std::vector<int64_t> context;                       // contextual ids
  std::vector<std::shared_ptr<const TokenRun>> runs;  // the cached history, in order
  int64_t query_time = 0;                             // the earliest query time whose buckets the entry holds
  int64_t valid_lo = 0;  // query times [lo, hi) at which every cached token keeps its bucket
  int64_t valid_hi = 0;

  // The cached history's tokens.
  int64_t history() const {
    int64_t n = 0;
    for (const auto& run : runs) n += static_cast<int64_t>(run->rows[0].size());
    return n;
  }

  // Whether the cached history is the first `history()` tokens of `rows` (kTokenRows).
  bool prefix_of(const std::array<const int64_t*, 3>& rows) const {
    int64_t at = 0;
    for (const auto& run : runs) {
      size_t n = run->rows[0].size();
      for (size_t row = 0; row < rows.size(); ++row) {
        if (n > 0 && std::memcmp(run->rows[row].data(), rows[row] + at, n * sizeof(int64_t)) != 0) return false;
      }
      at += static_cast<int64_t>(n);
    }
    return true;
  }
};

// `before`'s history (none without one) followed by `rows`' tokens [from, to), as a new record's runs.
std::vector<std::shared_ptr<const TokenRun>> extended(const Record* before, const std::array<const int64_t*, 3>& rows,
                                                     int64_t from, int64_t to) {
  std::vector<std::shared_ptr<const TokenRun>> runs;
  if (before && before->runs.size() + 1 < kMaxRuns) {
    runs = before->runs;
  } else {
    from = 0;  // merged: the request holds the whole history
  }
  auto run = std::make_shared<TokenRun>();
  for (size_t row = 0; row < rows.size(); ++row) run->rows[row].assign(rows[row] + from, rows[row] + to);
  runs.push_back(std::move(run));
  return runs;
}

// A derived program's jagged request feature: one user's rows of it as its last served request had them, their
// bytes on the host (what the next request's are compared with) and the rows on the device (what that request
// then need not send again: CachedRanker::Impl::upload_held).
struct UserRows {
  std::vector<uint8_t> host;
  int64_t rows = 0;
  at::Tensor device;  // [capacity, trailing...], of which the first `rows` are held: room to grow in place
  at::Tensor held() const { return device.narrow(0, 0, rows); }
};

struct Entry {
  std::vector<int64_t> pages;
  int64_t length = 0;  // tokens cached (contextual + history)
  std::shared_ptr<const Record> record;
  std::map<std::string, std::shared_ptr<UserRows>> held;  // by feature (a derived program's, with held rows on)
  int pins = 0;
  std::list<int64_t>::iterator order;  // its place in the recency list
};

class CacheFull : public std::exception {};

// A host int64 copy of a request tensor, and its values.
struct HostInts {
  at::Tensor tensor;
  const int64_t* data = nullptr;
  explicit HostInts(const at::Tensor& value) : tensor(value.to(at::kCPU).to(at::kLong).contiguous()) {
    data = tensor.data_ptr<int64_t>();
  }
};

}  // namespace

struct CachedRanker::Impl {
  std::shared_ptr<const Package> package;
  const Package::Impl* pkg = nullptr;
  detail::KVSection kv;
  std::unique_ptr<detail::AotiProgram> program;
  std::unique_ptr<detail::DeltaGraphs> graphs;  // shape buckets (CUDA graphs), or null: the program as it is
  int64_t max_time_drift = 0;
  std::vector<int64_t> edges;
  std::map<std::string, std::string> feature_of;  // delta program input -> the request feature it is fed from
  at::Tensor k, v;                                // [layers, pages + 1, page, H, D]; the last page is the scratch page
  int64_t num_pages = 0;
  int64_t scratch = 0;

  mutable std::mutex mutex;  // entries, recency, free pages, counters
  std::unordered_map<int64_t, Entry> entries;
  std::list<int64_t> recency;  // least recently used first
  std::vector<int64_t> free_pages;
  KVCacheStats counts;
  std::array<std::mutex, kStripes> stripes;

  // A derived delta program (kv_cache.kind "derived"): set instead of the zoo program's fields above; kv holds
  // its page size and layout, and x each cached token's frontier row (hstu_export/serving/kv_derived.py).
  std::optional<detail::DerivedKVSection> derived;
  std::unique_ptr<detail::AotiProgram> counts_program;
  at::Tensor x;
  std::unique_ptr<detail::ShapeGraphs> shape_graphs;  // CUDA graphs by exact shapes, or null: the program as it is
  // Whether shape_graphs holds the whole request (the compiled sparse half, then the delta program) rather than
  // the delta program alone: see open_derived.
  bool whole_request = false;
  // A derived program holding the sparse half: the tables it takes, by input name (the sparse program's own).
  std::map<std::string, at::Tensor> derived_tables;
  // A derived program's shape buckets (KVCacheOptions::shape_buckets), or null: each request as it is.
  std::unique_ptr<detail::RequestPadding> padding;
  std::atomic<int64_t> padded_calls{0};
  // Whether each cached user's jagged request rows are kept on the device (KVCacheOptions::held_rows).
  bool hold_rows = false;
  HeldRowCounts held_counts;  // (the mutex held)
  // What upload_held read of a kept user's feature, and what its entry holds once the call succeeds (keep_held).
  struct HeldUpdate {
    int64_t user = 0;
    std::string feature;
    std::shared_ptr<UserRows> before;  // its rows as held, when the request's begin with them; else null
    at::Tensor host;                   // the request's rows of the user, on the host
    at::Tensor device;                 // the same on the device (a view of the request's feature)
  };
  Tensors upload_held(const Tensors& request, const std::vector<int64_t>& users, const std::vector<bool>& kept,
                      std::vector<HeldUpdate>& updates, std::vector<at::Tensor>* also);
  void keep_held(std::vector<HeldUpdate>& updates);

  NamedTensors run(const Tensors& request, const std::vector<int64_t>& users, int64_t batch, detail::PhaseClock& clock);
  NamedTensors run_derived(const Tensors& request, const std::vector<int64_t>& users, int64_t batch,
                           detail::PhaseClock& clock);
  std::vector<at::Tensor> run_program(const detail::ProgramInputs& inputs) const {
    std::vector<at::Tensor> ordered;
    for (const auto& name : kv.inputs) ordered.push_back(inputs.at(name));
    return program->run(ordered);
  }
  int64_t reusable(int64_t user, const int64_t* context, int64_t length, int64_t query_time,
                   std::shared_ptr<const Record>* reused);
  std::vector<int64_t> reserve(int64_t user, int64_t tokens, int64_t keep);
  void drop(int64_t user);
  // The entry gone, its pages free (the mutex held).
  void release(std::unordered_map<int64_t, Entry>::iterator it) {
    free_pages.insert(free_pages.end(), it->second.pages.begin(), it->second.pages.end());
    recency.erase(it->second.order);
    entries.erase(it);
  }
  void commit(int64_t user, int64_t length, std::shared_ptr<const Record> record);
  void count(int64_t KVCacheStats::*counter, int64_t by = 1) {
    std::lock_guard<std::mutex> lock(mutex);
    counts.*counter += by;
  }
};

namespace {

// Serialises requests per user (striped locks, taken in index order: no deadlock) and pins the users'
// entries against eviction while a request runs.
class UsingUsers {
 public:
  UsingUsers(CachedRanker::Impl& cache, const std::vector<int64_t>& users) : cache_(cache) {
    std::vector<size_t> stripes;
    for (int64_t user : users) {
      if (std::find(distinct_.begin(), distinct_.end(), user) == distinct_.end()) distinct_.push_back(user);
      stripes.push_back(std::hash<int64_t>{}(user) % kStripes);
    }
    std::sort(stripes.begin(), stripes.end());
    stripes.erase(std::unique(stripes.begin(), stripes.end()), stripes.end());
    for (size_t index : stripes) locks_.emplace_back(cache_.stripes[index]);
    std::lock_guard<std::mutex> lock(cache_.mutex);
    for (int64_t user : distinct_) {
      if (auto it = cache_.entries.find(user); it != cache_.entries.end()) it->second.pins += 1;
    }
  }
  ~UsingUsers() {
    std::lock_guard<std::mutex> lock(cache_.mutex);
    for (int64_t user : distinct_) {
      if (auto it = cache_.entries.find(user); it != cache_.entries.end()) it->second.pins = std::max(0, it->second.pins - 1);
    }
  }
  UsingUsers(const UsingUsers&) = delete;
  UsingUsers& operator=(const UsingUsers&) = delete;

 private:
  CachedRanker::Impl& cache_;
  std::vector<int64_t> distinct_;
  std::vector<std::unique_lock<std::mutex>> locks_;
};

}  // namespace

CachedRanker::CachedRanker(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CachedRanker::~CachedRanker() = default;

namespace {

// On the host, checked before allocating: the allocator may grant more than there is (Linux overcommits
// memory), and the process is then killed while the pages are zeroed. On a GPU its allocator refuses.
void refuse_beyond_host_memory(int64_t budget, int64_t needed, const c10::Device& device) {
  if (auto memory = host_memory(); memory && !device.is_cuda() && needed > memory->first) {
    throw Error("KV cache budget of " + format_bytes(static_cast<double>(budget)) + " (" + std::to_string(budget) +
                " bytes) is more than the memory available on " + device.str() + ": " +
                format_bytes(static_cast<double>(memory->first)) + " free of " +
                format_bytes(static_cast<double>(memory->second)) + "; lower the budget");
  }
}

// The pages of `impl->kv`'s layout within `options.budget_bytes` (0: room for max_batch_size users at the
// longest sequence): K and V of page_size tokens in every layer, and with `row_width` each token's frontier
// row of `row_dtype` (a derived program's); one page of the budget is the scratch page, the rest are free.
void allocate_pages(CachedRanker::Impl& impl, const Package::Impl& pkg, const KVCacheOptions& options,
                    int64_t row_width = 0, at::ScalarType row_dtype = at::kFloat) {
  const detail::KVSection& kv = impl.kv;
  int64_t item = static_cast<int64_t>(c10::elementSize(kv.dtype));
  int64_t row_item = static_cast<int64_t>(c10::elementSize(row_dtype));
  int64_t page_bytes = kv.num_layers * kv.page_size * kv.num_heads * (kv.attention_dim + kv.linear_dim) * item +
                       kv.page_size * row_width * row_item;
  int64_t budget = options.budget_bytes;
  if (budget == 0) budget = (pkg.max_batch_size * ((kv.max_seq_len + kv.page_size - 1) / kv.page_size) + 1) * page_bytes;
  impl.num_pages = budget / page_bytes - 1;
  if (budget < 0 || impl.num_pages < 1) {
    throw Error("KV cache budget of " + std::to_string(budget) + " bytes holds no page for users (" +
                std::to_string(page_bytes) + " bytes each, and one more for the scratch page); raise the budget");
  }
  refuse_beyond_host_memory(budget, (impl.num_pages + 1) * page_bytes, pkg.device);
  auto pages = at::TensorOptions().dtype(kv.dtype).device(pkg.device);
  try {
    impl.k = at::zeros({kv.num_layers, impl.num_pages + 1, kv.page_size, kv.num_heads, kv.attention_dim}, pages);
    impl.v = at::zeros({kv.num_layers, impl.num_pages + 1, kv.page_size, kv.num_heads, kv.linear_dim}, pages);
    if (row_width > 0) impl.x = at::zeros({impl.num_pages + 1, kv.page_size, row_width}, pages.dtype(row_dtype));
  } catch (const std::exception& exc) {
    throw Error("cannot allocate a KV cache of " + std::to_string(budget) + " bytes on " + pkg.device.str() + ": " +
                detail::error_text(exc) + "; lower the budget");
  }
  impl.scratch = impl.num_pages;
  for (int64_t page = impl.num_pages - 1; page >= 0; --page) impl.free_pages.push_back(page);
  impl.counts.pages = impl.num_pages;
}

// The request's tensors among a whole-request graph's inputs are named thus (the rest are the kv_ inputs).
const std::string kRequestInput = "request:";

// The delta program's inputs of the dense half, by name: request features as they are, the sparse half's
// outputs made contiguous.
std::map<std::string, at::Tensor> dense_inputs_of(const Package::Impl& pkg, const Tensors& on_device,
                                                  const NamedTensors& boundary) {
  std::vector<at::Tensor> ordered = pkg.dense_inputs(on_device, boundary);
  const auto& specs = pkg.artifacts.at("dense").inputs;
  std::map<std::string, at::Tensor> dense;
  for (size_t i = 0; i < specs.size(); ++i) dense[specs[i].name] = ordered[i];
  return dense;
}

// A derived delta program's cache (hstu_export/serving/kv_derived.py's DerivedCachedRanker, the same pages
// and bookkeeping): K/V pages and each cached token's frontier row. A program that reads nothing back from
// the device replays calls of shapes seen before from CUDA graphs (shape_graphs.h); kBuckets keeps that
// bookkeeping without graphs. Where nothing before the delta program reads the device either (the counts
// added up on the host, the compiled sparse half's prechecked model), a graph holds the whole request: the
// sparse half's lookups and the delta program, keyed by the request's shapes. Its copies are then the
// request's ids and lengths, not the looked-up rows (16.5 MiB a user of the zoo's dlrmv3 shapes), and the
// sparse half's launches are replayed too.
std::unique_ptr<CachedRanker::Impl> open_derived(const Package::Impl& pkg, const KVCacheOptions& options) {
  const detail::DerivedKVSection& d = *pkg.derived_kv;
  if (options.max_time_drift != 0) {
    throw Error("max_time_drift applies to the zoo model's delta program; a derived one reuses a user's tokens only "
                "while the rows its layers start from are unchanged");
  }
  // The values such a program reads would be fixed at the capture's.
  std::string unsafe;
  if (d.device_reads != 0) {
    unsafe = pkg.root + ": its delta program reads " +
             (d.device_reads < 0 ? std::string("an unrecorded number of") : std::to_string(d.device_reads)) +
             " value(s) back from the device, so it cannot be replayed from a CUDA graph; serve it with graphs auto";
  }
  KVGraphs graphs = detail::resolve_graphs(pkg.root, pkg.device, options.graphs, unsafe);
  auto impl = std::make_unique<CachedRanker::Impl>();
  impl->derived = d;
  // Held rows need the counts before the request moves (which users are kept decides what is sent).
  if (options.held_rows && !d.host_counts) {
    throw Error("held rows need a derived program whose counts are added up on the host; " + pkg.root +
                "'s are computed by its counts program (serve without held rows)");
  }
  impl->hold_rows = options.held_rows;
  impl->held_counts.on = impl->hold_rows;
  detail::KVSection& kv = impl->kv;  // what the shared bookkeeping reads
  kv.program_file = d.program_file;
  kv.inputs = d.inputs;
  kv.outputs = d.outputs;
  kv.page_size = d.page_size;
  kv.max_seq_len = d.max_seq_len;
  kv.num_layers = d.num_layers;
  kv.num_heads = d.num_heads;
  kv.attention_dim = d.attention_dim;
  kv.linear_dim = d.linear_dim;
  kv.dtype = d.dtype;
  allocate_pages(*impl, pkg, options, d.row_width, d.row_dtype);
  auto load = [&](const std::filesystem::path& path, const std::string& file) {
    try {
      return std::make_unique<detail::AotiProgram>(path.string(), pkg.device, pkg.concurrency);
    } catch (const std::exception& exc) {
      throw PackageError(pkg.root + ": AOTInductor could not load " + file + ": " + detail::error_text(exc));
    }
  };
  impl->program = load(d.program, d.program_file);
  impl->counts_program = load(d.counts, d.counts_file);
  std::set<std::string> unchanging = {"kv_k_pages", "kv_v_pages", "kv_x_pages"};
  if (d.sparse_inside) {  // the very tables handed to the sparse program
    if (!pkg.sparse_program || pkg.sparse_model == "model") {
      throw PackageError(pkg.root + ": its KV-cache delta program holds the sparse half's prechecked model, which this "
                         "package's ranges do not let run; re-export with --kv-cache");
    }
    const auto& held = pkg.sparse_program->constants();
    for (const auto& [name, table] : d.table_inputs) {
      auto it = held.find(table);
      if (it == held.end()) {
        throw PackageError(pkg.root + ": its KV-cache delta program takes the table " + detail::in_quotes(table) +
                           ", which its sparse program was not handed; re-export with --kv-cache");
      }
      impl->derived_tables[name] = it->second;
      unchanging.insert(name);
    }
  }
  if (graphs != KVGraphs::kOff) {
    const detail::AotiProgram* program = impl->program.get();
    const std::vector<std::string>* names = &impl->derived->inputs;
    impl->whole_request = d.host_counts.has_value() && pkg.sparse_program && pkg.sparse_model != "model" &&
                          !d.sparse_inside;  // a program holding the sparse half is the whole request itself
    detail::RunProgram run = [program, names](const detail::ProgramInputs& inputs) {
      std::vector<at::Tensor> ordered;
      for (const auto& name : *names) ordered.push_back(inputs.at(name));
      return program->run(ordered);
    };
    if (impl->whole_request) {
      const Package::Impl* package = &pkg;  // kept open by the ranker's package
      run = [package, program, names](const detail::ProgramInputs& inputs) {
        Tensors request;
        for (const auto& [name, value] : inputs) {
          if (name.rfind(kRequestInput, 0) == 0) request.emplace(name.substr(kRequestInput.size()), value);
        }
        std::map<std::string, at::Tensor> dense = dense_inputs_of(*package, request, package->sparse_outputs(request));
        std::vector<at::Tensor> ordered;
        for (const auto& name : *names) {
          auto it = dense.find(name);
          ordered.push_back(it != dense.end() ? it->second : inputs.at(name));
        }
        return program->run(ordered);
      };
    }
    impl->shape_graphs = std::make_unique<detail::ShapeGraphs>(
        std::move(run), unchanging,
        /*capture=*/graphs == KVGraphs::kOn, /*max_graphs=*/16,
        options.graph_copy_limit > 0 ? options.graph_copy_limit : detail::kMaxCopyBytes);
  }
  using Buckets = KVCacheOptions::ShapeBuckets;
  if (options.shape_buckets == Buckets::kOn && !d.padding) {
    throw Error(pkg.root + ": its manifest records no padding user for the delta program's shape buckets "
                "(kv_cache.padding: the export found none whose answers match the model's, or it predates them); "
                "serve with shape buckets auto");
  }
  if (d.padding && (options.shape_buckets == Buckets::kOn ||
                    (options.shape_buckets == Buckets::kAuto && impl->shape_graphs != nullptr))) {
    impl->padding = std::make_unique<detail::RequestPadding>(pkg.features, *d.padding, pkg.max_batch_size,
                                                             (d.max_seq_len + d.page_size - 1) / d.page_size);
  }
  return impl;
}

}  // namespace

std::shared_ptr<CachedRanker> CachedRanker::open(std::shared_ptr<const Package> package, const KVCacheOptions& options) {
  if (!package) throw Error("CachedRanker::open needs an open package");
  const Package::Impl& pkg = *package->impl_;
  if (pkg.derived_kv) {
    auto impl = open_derived(pkg, options);
    impl->package = package;
    impl->pkg = &pkg;
    return std::shared_ptr<CachedRanker>(new CachedRanker(std::move(impl)));
  }
  if (!pkg.kv) {
    if (!pkg.kv_problem.empty()) throw PackageError(pkg.kv_problem);
    throw PackageError(pkg.root + " has no KV-cache delta program; export it with --kv-cache");
  }
  if (options.held_rows) {
    throw Error("held rows apply to a derived delta program; " + pkg.root + " has the zoo model's written one "
                "(export with --kv-program derived, or serve without held rows)");
  }
  if (options.shape_buckets == KVCacheOptions::ShapeBuckets::kOn) {
    throw Error("shape buckets on apply to a derived delta program; " + pkg.root + " has the zoo model's written "
                "one, which pads its requests into buckets with its CUDA graphs (--kv-graphs)");
  }
  auto impl = std::make_unique<Impl>();
  impl->package = package;
  impl->pkg = &pkg;
  impl->kv = *pkg.kv;
  const detail::KVSection& kv = impl->kv;
  if (options.max_time_drift < 0) throw Error("max_time_drift must be 0 or more seconds, got " + std::to_string(options.max_time_drift));
  impl->max_time_drift = options.max_time_drift;
  for (const auto& spec : pkg.artifacts.at("dense").inputs) {
    if (!spec.feature.empty()) impl->feature_of[spec.name] = spec.feature;
  }

  allocate_pages(*impl, pkg, options);
  impl->edges = bucket_edges(kv.time_bucket_base, kv.num_time_buckets);
  try {
    impl->program = std::make_unique<detail::AotiProgram>(kv.program.string(), pkg.device, pkg.concurrency);
  } catch (const std::exception& exc) {
    throw PackageError(pkg.root + ": AOTInductor could not load " + kv.program_file + ": " + detail::error_text(exc));
  }
  KVGraphs graphs = detail::resolve_graphs(pkg.root, pkg.device, options.graphs, "");
  if (graphs != KVGraphs::kOff) {
    // The bucket steps stay within the program's bounds (runtimes/kv_delta.py chooses the same).
    detail::Buckets buckets{std::min<int64_t>(64, kv.max_history), std::min<int64_t>(32, kv.max_candidates),
                            std::max<int64_t>((kv.max_seq_len + kv.page_size - 1) / kv.page_size, 64),
                            kv.bound_batch, kv.bound_history, kv.bound_candidates, kv.fits_counts};
    const Impl* self = impl.get();
    impl->graphs = std::make_unique<detail::DeltaGraphs>(
        [self](const detail::ProgramInputs& inputs) { return self->run_program(inputs); }, buckets,
        static_cast<int64_t>(kv.contextual_features.size()), /*capture=*/graphs == KVGraphs::kOn);
  }
  return std::shared_ptr<CachedRanker>(new CachedRanker(std::move(impl)));
}

bool CachedRanker::bucketed() const { return impl_->graphs != nullptr || impl_->shape_graphs != nullptr; }

bool CachedRanker::derived() const { return impl_->derived.has_value(); }

KVGraphCounts CachedRanker::graph_counts() const {
  if (impl_->shape_graphs) return impl_->shape_graphs->counts();
  return impl_->graphs ? impl_->graphs->counts() : KVGraphCounts{};
}

HeldRowCounts CachedRanker::held_rows() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->held_counts;
}

KVCacheStats CachedRanker::stats() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  KVCacheStats out = impl_->counts;
  out.users = static_cast<int64_t>(impl_->entries.size());
  out.pages_used = impl_->num_pages - static_cast<int64_t>(impl_->free_pages.size());
  return out;
}

int64_t CachedRanker::padded_calls() const { return impl_->padding ? impl_->padded_calls.load() : -1; }

int64_t CachedRanker::bytes() const {
  return static_cast<int64_t>(impl_->k.nbytes() + impl_->v.nbytes() + (impl_->x.defined() ? impl_->x.nbytes() : 0));
}

int64_t CachedRanker::page_size() const { return impl_->kv.page_size; }

const Package& CachedRanker::package() const { return *impl_->package; }

NamedTensors CachedRanker::run(const Tensors& request, const std::vector<int64_t>& user_ids, PhaseTimes* times) {
  const c10::Device device = impl_->pkg->device;
  c10::OptionalDeviceGuard device_guard(device.is_cuda() ? std::optional(device) : std::nullopt);
  detail::PhaseClock clock(times, device);
  int64_t batch = impl_->package->validate(request);
  if (static_cast<int64_t>(user_ids.size()) != batch) {
    throw RequestError(std::to_string(user_ids.size()) + " user ids for a batch of " + std::to_string(batch) + " users");
  }
  c10::InferenceMode guard;
  try {
    NamedTensors out = impl_->derived ? impl_->run_derived(request, user_ids, batch, clock)
                                      : impl_->run(request, user_ids, batch, clock);
    clock.lap(&PhaseTimes::after_dense_ms);
    return out;
  } catch (const Error&) {
    throw;
  } catch (const std::exception& exc) {
    if (auto refused = impl_->pkg->range_refusal(exc, request)) throw *refused;
    throw Error(impl_->pkg->root + ": KV-cached serving failed: " + detail::error_text(exc));
  }
}

// Tokens of the user's entry that may be reused exactly (0: recompute, counted as a miss or stale) but for its
// history's tokens, which run() compares with the request's while the device computes: the hit or stale is
// counted then.
int64_t CachedRanker::Impl::reusable(int64_t user, const int64_t* context, int64_t length, int64_t query_time,
                                     std::shared_ptr<const Record>* reused) {
  const int64_t c = static_cast<int64_t>(kv.contextual_features.size());
  std::shared_ptr<const Record> record;
  int64_t cached = 0;
  {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = entries.find(user);
    if (it != entries.end()) {
      recency.splice(recency.end(), recency, it->second.order);  // most recently used
      record = it->second.record;
      cached = it->second.length;
    }
  }
  if (cached == 0 || !record) {
    count(&KVCacheStats::misses);
    return 0;
  }
  int64_t hist = cached - c;
  // Contextual tokens see the whole history: with them, only an unchanged history is reused.
  bool ok = hist <= length && !(c > 0 && hist != length);
  ok = ok && std::equal(record->context.begin(), record->context.end(), context);
  ok = ok && record->history() == hist;
  // In the same time buckets, or within the allowed drift (none by default: exact).
  bool in_buckets = record->valid_lo <= query_time && query_time < record->valid_hi;
  ok = ok && (in_buckets || (max_time_drift > 0 && query_time - record->query_time <= max_time_drift));
  if (!ok) {
    count(&KVCacheStats::stale);
    return 0;
  }
  *reused = record;
  return cached;
}

// Pages for `tokens` tokens of the user, the first `keep` already cached (0: start afresh, the old
// entry's pages are released). Evicts least recently used users not in use; CacheFull leaves a kept
// entry as it was.
std::vector<int64_t> CachedRanker::Impl::reserve(int64_t user, int64_t tokens, int64_t keep) {
  int64_t needed = (tokens + kv.page_size - 1) / kv.page_size;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = entries.find(user);
  if (it != entries.end() && keep == 0) {
    free_pages.insert(free_pages.end(), it->second.pages.begin(), it->second.pages.end());
    it->second.pages.clear();
    it->second.length = 0;
  }
  if (it == entries.end()) {
    it = entries.emplace(user, Entry{}).first;
    it->second.pins = 1;
    it->second.order = recency.insert(recency.end(), user);
  } else {
    recency.splice(recency.end(), recency, it->second.order);
  }
  Entry& entry = it->second;
  int64_t missing = needed - static_cast<int64_t>(entry.pages.size());
  while (missing > static_cast<int64_t>(free_pages.size())) {
    auto victim = std::find_if(recency.begin(), recency.end(), [&](int64_t other) {
      return other != user && entries.at(other).pins == 0;
    });
    if (victim == recency.end()) {
      if (entry.length == 0) release(it);
      throw CacheFull();
    }
    release(entries.find(*victim));
    counts.evictions += 1;
  }
  for (int64_t i = 0; i < missing; ++i) {
    entry.pages.push_back(free_pages.back());
    free_pages.pop_back();
  }
  return entry.pages;
}

// The user's entry gone, its pages free.
void CachedRanker::Impl::drop(int64_t user) {
  std::lock_guard<std::mutex> lock(mutex);
  if (auto it = entries.find(user); it != entries.end()) release(it);
}

void CachedRanker::Impl::commit(int64_t user, int64_t length, std::shared_ptr<const Record> record) {
  std::lock_guard<std::mutex> lock(mutex);
  Entry& entry = entries.at(user);
  entry.length = length;
  entry.record = std::move(record);
}

NamedTensors CachedRanker::Impl::run(const Tensors& request, const std::vector<int64_t>& users, int64_t batch,
                                     detail::PhaseClock& clock) {
  const int64_t c = static_cast<int64_t>(kv.contextual_features.size());
  // On the host: what the bookkeeping reads.
  HostInts hist_len(request.at(kHistoryLengths));
  HostInts query_time(request.at(kQueryTime));
  std::vector<HostInts> rows, context;
  for (const char* name : kTokenRows) rows.emplace_back(request.at(name));
  for (const auto& name : kv.contextual_features) context.emplace_back(request.at(name));
  std::vector<int64_t> hist_off(batch + 1, 0);
  for (int64_t b = 0; b < batch; ++b) hist_off[b + 1] = hist_off[b] + hist_len.data[b];
  std::unordered_map<int64_t, int> seen;
  for (int64_t user : users) seen[user] += 1;

  UsingUsers in_use(*this, users);
  std::vector<int64_t> cached(batch, 0);
  std::vector<std::vector<int64_t>> tables(batch);
  std::vector<bool> stored(batch, false);
  std::vector<std::shared_ptr<const Record>> reused(batch);
  // Whether user b's cached history is the start of the request's (the entry's other conditions checked apart).
  auto same_history = [&](int64_t b) {
    std::array<const int64_t*, 3> tokens;
    for (size_t row = 0; row < tokens.size(); ++row) tokens[row] = rows[row].data + hist_off[b];
    return reused[b]->prefix_of(tokens);
  };
  std::vector<std::vector<int64_t>> contexts(batch);
  int64_t bypassed = 0;
  for (int64_t b = 0; b < batch; ++b) {
    for (const auto& column : context) contexts[b].push_back(column.data[b]);
    if (seen[users[b]] > 1) {  // the same user twice in one batch: served, not stored
      bypassed += 1;
      continue;
    }
    int64_t reuse = reusable(users[b], contexts[b].data(), hist_len.data[b], query_time.data[b], &reused[b]);
    try {
      tables[b] = reserve(users[b], c + hist_len.data[b], reuse);
    } catch (const CacheFull&) {  // served, not stored; its entry counted as a hit or stale, a stale one dropped
      if (reused[b]) {
        bool same = same_history(b);
        count(same ? &KVCacheStats::hits : &KVCacheStats::stale);
        if (!same) drop(users[b]);
      }
      reused[b].reset();
      bypassed += 1;
      continue;
    }
    cached[b] = reuse;
    stored[b] = true;
  }
  if (bypassed > 0) count(&KVCacheStats::bypassed, bypassed);
  // The request as a delta request, to the device, and the delta program launched: its outputs. The run writes the
  // stored users' new K/V into their pages.
  std::vector<int64_t> new_len(batch);
  Tensors delta;
  auto launch = [&]() -> std::vector<at::Tensor> {
    int64_t width = 1;
    for (const auto& row : tables) width = std::max<int64_t>(width, static_cast<int64_t>(row.size()));
    // As wide as the request's shape bucket, if it gets one: then the graph copies the table in as it is.
    if (graphs) width = graphs->table_width(width);
    // The rest of a row, and the whole row of a user not stored, point at the scratch page.
    at::Tensor table = at::full({batch, width}, scratch, at::kInt);
    for (int64_t b = 0; b < batch; ++b) {
      auto* row = table.data_ptr<int32_t>() + b * width;
      for (size_t i = 0; i < tables[b].size(); ++i) row[i] = static_cast<int32_t>(tables[b][i]);
    }

    // The delta request: each user's history after its cached prefix.
    std::vector<int64_t> fresh;
    for (int64_t b = 0; b < batch; ++b) {
      new_len[b] = hist_len.data[b] - std::max<int64_t>(cached[b] - c, 0);
      for (int64_t i = hist_off[b + 1] - new_len[b]; i < hist_off[b + 1]; ++i) fresh.push_back(i);
    }
    at::Tensor fresh_rows = at::tensor(fresh, at::kLong);
    delta = request;
    for (size_t row = 0; row < kTokenRows.size(); ++row) {  // from the host copies, in the request's dtype
      const char* name = kTokenRows[row];
      delta[name] = rows[row].tensor.index_select(0, fresh_rows).to(request.at(name).scalar_type());
    }
    delta[kHistoryLengths] = at::tensor(new_len, at::kLong).to(request.at(kHistoryLengths).scalar_type());

    // What goes to the device besides the delta request, in the same transfer: the users' cached counts, the
    // page table, the users with nothing cached (with contextual features), and the padded history below.
    std::vector<at::Tensor> also = {at::tensor(cached, at::kLong), table};
    enum Also : size_t { kCached, kTable };
    std::optional<size_t> fresh_users_at, padded_at;
    if (c > 0) {  // [F, contextual features, D] for the F users with nothing cached, in batch order
      std::vector<int64_t> uncached;  // from the host's counts: nonzero() on the device would wait for it
      for (int64_t b = 0; b < batch; ++b) {
        if (cached[b] == 0) uncached.push_back(b);
      }
      fresh_users_at = also.size();
      also.push_back(at::tensor(uncached, at::kLong));
    }
    // The sparse half takes at least the exported minimum of history tokens per user: placeholder tokens
    // (id 0) fill a user's up, and their embeddings are dropped. Moved: the real rows to keep, the padded
    // token rows (kTokenRows' order) and lengths.
    bool padded = std::any_of(new_len.begin(), new_len.end(), [&](int64_t n) { return n < kv.min_history; });
    if (padded) {
      std::vector<int64_t> padded_len(batch), real;
      int64_t start = 0;
      for (int64_t b = 0; b < batch; ++b) {
        padded_len[b] = std::max(new_len[b], kv.min_history);
        for (int64_t i = 0; i < new_len[b]; ++i) real.push_back(start + i);
        start += padded_len[b];
      }
      at::Tensor real_rows = at::tensor(real, at::kLong);
      padded_at = also.size();
      also.push_back(real_rows);
      for (const char* name : kTokenRows) {
        const at::Tensor& value = delta.at(name);
        std::vector<int64_t> shape = value.sizes().vec();
        shape[0] = start;
        also.push_back(at::zeros(shape, value.options()).index_copy_(0, real_rows, value));
      }
      also.push_back(at::tensor(padded_len, at::kLong).to(request.at(kHistoryLengths).scalar_type()));
    }
    clock.begin_part();
    Tensors on_device = pkg->plain(delta, &also);
    Tensors sparse_in = on_device;
    if (padded_at) {
      for (size_t row = 0; row < kTokenRows.size(); ++row) sparse_in[kTokenRows[row]] = also[*padded_at + 1 + row];
      sparse_in[kHistoryLengths] = also[*padded_at + 1 + kTokenRows.size()];
    }
    clock.end_part(&PhaseTimes::to_device_ms);
    clock.begin_part();
    NamedTensors boundary = pkg->sparse_outputs(sparse_in);
    clock.end_part(&PhaseTimes::sparse_ms);
    std::map<std::string, at::Tensor> emb;
    for (auto& [name, value] : boundary) emb[name] = value;
    if (padded_at) {
      for (const char* name : kHistoryEmbeddings) emb[name] = emb.at(name).index_select(0, also[*padded_at]);
    }
    at::Tensor contextual;
    if (c == 0) {
      const at::Tensor& like = emb.at(kHistoryEmbeddings[0]);
      contextual = at::zeros({0, 0, like.size(-1)}, like.options());
    } else {
      std::vector<at::Tensor> columns;
      for (const auto& name : kv.contextual_features) {
        columns.push_back(emb.at(name + "_emb").index_select(0, also[*fresh_users_at]));
      }
      contextual = at::stack(columns, 1);
    }
    detail::ProgramInputs inputs;
    for (const auto& name : kv.inputs) {
      if (name == "kv_cached") {
        inputs[name] = also[kCached];
      } else if (name == "kv_k_pages") {
        inputs[name] = k;
      } else if (name == "kv_v_pages") {
        inputs[name] = v;
      } else if (name == "kv_page_table") {
        inputs[name] = also[kTable];
      } else if (name == "contextual_emb") {
        inputs[name] = contextual.contiguous();
      } else if (auto it = emb.find(name); it != emb.end()) {
        inputs[name] = it->second.contiguous();
      } else {
        inputs[name] = on_device.at(feature_of.at(name));
      }
    }
    clock.lap(&PhaseTimes::before_dense_ms);
    std::vector<at::Tensor> outputs = graphs ? (*graphs)(inputs) : run_program(inputs);
    clock.split(&PhaseTimes::dense_launch_ms);
    clock.lap(&PhaseTimes::dense_ms);
    if (outputs.size() != kv.outputs.size()) {
      throw Error(kv.program_file + " returned " + std::to_string(outputs.size()) + " outputs, the manifest names " +
                  std::to_string(kv.outputs.size()));
    }
    return outputs;
  };
  std::vector<at::Tensor> outputs = launch();
  // While the device computes: each cached history compared with the request's (the rest of the entry was checked
  // before the launch). A user whose history differs is stale: the request runs again, that user from nothing; its
  // pages stay its own, and the run before wrote only them and pages of users that are in this request.
  int64_t hits = 0, differing = 0;
  for (int64_t b = 0; b < batch; ++b) {
    if (cached[b] == 0) continue;
    if (same_history(b)) {
      hits += 1;
      continue;
    }
    differing += 1;
    cached[b] = 0;
    reused[b].reset();
  }
  count(&KVCacheStats::hits, hits);
  count(&KVCacheStats::stale, differing);
  if (differing > 0) outputs = launch();

  // Record what the stored users' pages hold now, with the query times at which their new tokens keep
  // their time buckets.
  if (bypassed < batch) {
    std::vector<int64_t> owner;
    for (int64_t b = 0; b < batch; ++b) owner.insert(owner.end(), new_len[b], b);
    HostInts stamps(delta.at(kTokenRows[kTimestampRow]));
    std::vector<int64_t> bucket;
    if (auto found = buckets_from_edges(query_time.data, owner, stamps.data, edges)) {
      bucket = std::move(*found);
    } else {  // a difference beyond the edges' range: the bucket function itself
      at::Tensor owner_rows = at::tensor(owner, at::kLong);
      at::Tensor buckets = time_buckets(query_time.tensor.index_select(0, owner_rows), stamps.tensor,
                                        kv.time_bucket_base, kv.num_time_buckets).contiguous();
      bucket.assign(buckets.data_ptr<int64_t>(), buckets.data_ptr<int64_t>() + buckets.numel());
    }
    std::vector<int64_t> lo(batch, -kUnbounded), hi(batch, kUnbounded);
    for (size_t i = 0; i < owner.size(); ++i) {
      lo[owner[i]] = std::max(lo[owner[i]], stamps.data[i] + edges[bucket[i]]);
      hi[owner[i]] = std::min(hi[owner[i]], stamps.data[i] + edges[bucket[i] + 1]);
    }
    for (int64_t b = 0; b < batch; ++b) {
      if (!stored[b]) continue;
      const std::shared_ptr<const Record>& before = reused[b];
      int64_t kept = before ? before->history() : 0;
      if (before && kept == hist_len.data[b]) {  // nothing new: the entry stays as it is
        commit(users[b], c + hist_len.data[b], before);
        continue;
      }
      auto record = std::make_shared<Record>();
      record->context = before ? before->context : contexts[b];
      std::array<const int64_t*, 3> values;
      for (size_t row = 0; row < values.size(); ++row) values[row] = rows[row].data + hist_off[b];
      record->runs = extended(before.get(), values, kept, hist_len.data[b]);
      // Cached tokens keep the buckets (and time) they were computed with.
      record->query_time = before ? before->query_time : query_time.data[b];
      record->valid_lo = before ? std::max(before->valid_lo, lo[b]) : lo[b];
      record->valid_hi = before ? std::min(before->valid_hi, hi[b]) : hi[b];
      commit(users[b], c + hist_len.data[b], std::move(record));
    }
  }
  NamedTensors out;
  for (const auto& name : pkg->output_names) {
    size_t index = std::find(kv.outputs.begin(), kv.outputs.end(), name) - kv.outputs.begin();
    out.emplace_back(name, outputs.at(index));
  }
  return out;
}

// The request on the device as Package::Impl::plain moves it, except for the jagged features' rows that a kept
// user (kept[b]) sent with its last request: where the request's rows of that user begin with those, byte for
// byte (compared here, on the host), they are taken from its entry on the device and only the rows after them
// are sent. The device then holds the request exactly as if it were sent whole, so the program's comparison of
// the cached rows still decides which users are stale. `updates`: per kept user and jagged feature, what its
// entry holds once the call succeeds (keep_held).
Tensors CachedRanker::Impl::upload_held(const Tensors& request, const std::vector<int64_t>& users,
                                        const std::vector<bool>& kept, std::vector<HeldUpdate>& updates,
                                        std::vector<at::Tensor>* also) {
  const int64_t batch = static_cast<int64_t>(users.size());
  const auto& features = pkg->features;
  std::vector<at::Tensor> plain;
  for (const auto& f : features) plain.push_back(detail::plain_tensor(request.at(f.name)));
  // The jagged features on the host: their users' first rows, and what each kept user's entry holds of them.
  struct Jagged {
    size_t feature;
    std::vector<int64_t> offsets;  // batch + 1
    int64_t row_bytes = 0;
    std::vector<std::shared_ptr<UserRows>> before;  // per user: held rows the request's begin with, else null
  };
  std::vector<Jagged> jagged;
  for (size_t i = 0; i < features.size(); ++i) {
    const at::Tensor& t = plain[i];
    if (features[i].kind != "jagged" || !t.device().is_cpu() || t.dim() < 1) continue;
    HostInts lengths(request.at(features[i].jagged_by));
    if (lengths.tensor.numel() != batch) continue;
    Jagged j{i, std::vector<int64_t>(batch + 1, 0), 0, std::vector<std::shared_ptr<UserRows>>(batch)};
    for (int64_t b = 0; b < batch; ++b) j.offsets[b + 1] = j.offsets[b] + lengths.data[b];
    if (j.offsets[batch] != t.size(0)) continue;  // the request's own check has said so already
    j.row_bytes = t.size(0) > 0 ? static_cast<int64_t>(t.nbytes()) / t.size(0) : 0;
    jagged.push_back(std::move(j));
  }
  {
    std::lock_guard<std::mutex> lock(mutex);
    for (int64_t b = 0; b < batch; ++b) {
      auto it = kept[b] ? entries.find(users[b]) : entries.end();
      if (it == entries.end()) continue;
      for (auto& j : jagged) {
        if (auto held = it->second.held.find(features[j.feature].name); held != it->second.held.end()) {
          j.before[b] = held->second;
        }
      }
    }
  }
  // Each held prefix compared with the request's rows, users and features side by side.
  std::vector<std::pair<size_t, int64_t>> compared;
  for (size_t k = 0; k < jagged.size(); ++k) {
    const Jagged& j = jagged[k];
    const at::Tensor& t = plain[j.feature];
    for (int64_t b = 0; b < batch; ++b) {
      const auto& held = j.before[b];
      bool fits = held && held->rows > 0 && held->rows <= j.offsets[b + 1] - j.offsets[b] &&
                  static_cast<int64_t>(held->host.size()) == held->rows * j.row_bytes &&
                  held->device.scalar_type() == t.scalar_type() && held->device.sizes().slice(1) == t.sizes().slice(1);
      if (fits) {
        compared.emplace_back(k, b);
      } else {
        jagged[k].before[b] = nullptr;
      }
    }
  }
  std::vector<char> same(compared.size(), 0);
  at::parallel_for(0, static_cast<int64_t>(compared.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const auto& [k, b] = compared[i];
      const Jagged& j = jagged[k];
      const auto* rows = static_cast<const uint8_t*>(plain[j.feature].const_data_ptr()) + j.offsets[b] * j.row_bytes;
      const auto& held = *j.before[b];
      same[i] = std::memcmp(rows, held.host.data(), held.host.size()) == 0;
    }
  });
  for (size_t i = 0; i < compared.size(); ++i) {
    if (!same[i]) jagged[compared[i].first].before[compared[i].second] = nullptr;
  }
  // What is sent: whole tensors, and of a feature with held rows the runs of rows between them.
  std::vector<at::Tensor> sent;
  std::vector<std::vector<std::pair<bool, size_t>>> pieces(features.size());  // (held, index) in row order
  std::vector<bool> whole(features.size(), true);
  for (auto& j : jagged) {
    bool any = std::any_of(j.before.begin(), j.before.end(), [](const auto& held) { return held != nullptr; });
    if (!any) continue;
    whole[j.feature] = false;
    const at::Tensor& t = plain[j.feature];
    int64_t from = 0;  // the first row not yet sent or taken
    auto send_to = [&](int64_t to) {
      if (to > from) {
        pieces[j.feature].emplace_back(false, sent.size());
        sent.push_back(t.narrow(0, from, to - from));
      }
      from = to;
    };
    for (int64_t b = 0; b < batch; ++b) {
      if (const auto& held = j.before[b]) {
        send_to(j.offsets[b]);
        pieces[j.feature].emplace_back(true, static_cast<size_t>(b));
        from = j.offsets[b] + held->rows;
      }
    }
    send_to(j.offsets[batch]);
  }
  std::vector<size_t> whole_at(features.size(), 0);
  for (size_t i = 0; i < features.size(); ++i) {
    if (whole[i]) {
      whole_at[i] = sent.size();
      sent.push_back(plain[i]);
    }
  }
  int64_t taken = 0, rows_sent = 0;
  for (const auto& j : jagged) {
    for (int64_t b = 0; b < batch; ++b) {
      int64_t held = j.before[b] ? j.before[b]->rows : 0;
      taken += held;
      rows_sent += j.offsets[b + 1] - j.offsets[b] - held;
    }
  }
  {
    std::lock_guard<std::mutex> lock(mutex);
    held_counts.taken += taken;
    held_counts.sent += rows_sent;
  }
  const size_t sent_count = sent.size();
  if (also != nullptr) sent.insert(sent.end(), also->begin(), also->end());  // in the same transfer
  detail::to_device(sent, pkg->device);
  if (also != nullptr) std::move(sent.begin() + static_cast<std::ptrdiff_t>(sent_count), sent.end(), also->begin());
  Tensors out;
  std::map<size_t, const Jagged*> jagged_of;
  for (const auto& j : jagged) jagged_of[j.feature] = &j;
  for (size_t i = 0; i < features.size(); ++i) {
    if (whole[i]) {
      out.emplace(features[i].name, sent[whole_at[i]]);
      continue;
    }
    std::vector<at::Tensor> parts;
    for (const auto& [held, index] : pieces[i]) parts.push_back(held ? jagged_of.at(i)->before[index]->held() : sent[index]);
    out.emplace(features[i].name, parts.size() == 1 ? parts[0] : at::cat(parts, 0));
  }
  for (const auto& j : jagged) {
    const std::string& name = features[j.feature].name;
    for (int64_t b = 0; b < batch; ++b) {
      if (!kept[b]) continue;
      int64_t rows = j.offsets[b + 1] - j.offsets[b];
      updates.push_back({users[b], name, j.before[b], plain[j.feature].narrow(0, j.offsets[b], rows),
                         out.at(name).narrow(0, j.offsets[b], rows)});
    }
  }
  return out;
}

// What upload_held read becomes each kept user's held rows: the rows after a held prefix appended to it, on the
// host and on the device, where its room allows in place (a quarter more than a new one's rows, doubled when
// outgrown), and a user's changed rows held anew; the device's copies of every user and feature made together.
void CachedRanker::Impl::keep_held(std::vector<HeldUpdate>& updates) {
  std::vector<at::Tensor> targets, sources;
  std::vector<std::shared_ptr<UserRows>> kept(updates.size());
  for (size_t i = 0; i < updates.size(); ++i) {
    HeldUpdate& u = updates[i];
    const int64_t rows = u.host.size(0);
    const auto* bytes = static_cast<const uint8_t*>(u.host.const_data_ptr());
    const int64_t row_bytes = rows > 0 ? static_cast<int64_t>(u.host.nbytes()) / rows : 0;
    if (u.before && u.before->rows == rows) {
      kept[i] = u.before;  // nothing new
      continue;
    }
    if (rows == 0) continue;
    auto held = u.before ? u.before : std::make_shared<UserRows>();
    const int64_t from = held->rows;  // rows already held, on both sides
    held->host.insert(held->host.end(), bytes + from * row_bytes, bytes + rows * row_bytes);
    if (!held->device.defined() || held->device.size(0) < rows) {
      int64_t room = held->device.defined() ? std::max(rows, 2 * held->device.size(0)) : rows + rows / 4;
      std::vector<int64_t> shape = u.device.sizes().vec();
      shape[0] = room;
      at::Tensor larger = at::empty(shape, u.device.options());
      if (from > 0) {
        targets.push_back(larger.narrow(0, 0, from));
        sources.push_back(held->held());
      }
      held->device = larger;
    }
    targets.push_back(held->device.narrow(0, from, rows - from));
    sources.push_back(u.device.narrow(0, from, rows - from));
    held->rows = rows;
    kept[i] = std::move(held);
  }
  if (!targets.empty()) at::_foreach_copy_(targets, sources);
  std::lock_guard<std::mutex> lock(mutex);
  for (size_t i = 0; i < updates.size(); ++i) {
    auto it = entries.find(updates[i].user);
    if (it == entries.end()) continue;
    if (kept[i]) {
      it->second.held[updates[i].feature] = kept[i];
    } else {
      it->second.held.erase(updates[i].feature);
    }
  }
}

// Python's DerivedCachedRanker step for step: each user's cached count (its entry's, when no longer than its
// non-target tokens now) and pages for all those tokens; the program stores the new K/V and frontier rows and
// says which users' cached prefix no longer matches; those are run again from nothing, in one more call.
NamedTensors CachedRanker::Impl::run_derived(const Tensors& request, const std::vector<int64_t>& users, int64_t batch,
                                             detail::PhaseClock& clock) {
  const detail::DerivedKVSection& d = *derived;
  // With shape buckets, a padding user last (kv_padding.h): `all` users, of whom the first `batch` are real.
  std::optional<detail::PaddedRequest> padded;
  if (padding) padded = padding->pad(request, batch);
  if (padded) padded_calls += 1;
  const Tensors& whole = padded ? padded->request : request;
  const int64_t all = batch + (padded ? 1 : 0);
  std::vector<int64_t> all_users(users);
  if (padded) all_users.push_back(-1);  // never looked up: the padding user is not kept
  Tensors on_device;
  std::map<std::string, at::Tensor> dense;  // the dense half's inputs by name (a whole-request graph: none)
  clock.sparse_in_dense(whole_request || d.sparse_inside);
  // The request on the device, with `also` in the same transfer, then the dense half's inputs; with held rows
  // (`updates`), only the rows the kept users' entries do not hold.
  auto move = [&](const std::vector<bool>& kept, std::vector<HeldUpdate>* updates, std::vector<at::Tensor>* also) {
    clock.begin_part();
    on_device = updates ? upload_held(whole, all_users, kept, *updates, also) : pkg->plain(whole, also);
    clock.end_part(&PhaseTimes::to_device_ms);
    if (d.sparse_inside) {  // the program looks the request up itself: the dense inputs it takes are request features
      for (const auto& spec : pkg->artifacts.at("dense").inputs) {
        if (!spec.feature.empty()) dense[spec.name] = on_device.at(spec.feature);
      }
    } else if (!whole_request) {
      clock.begin_part();
      NamedTensors boundary = pkg->sparse_outputs(on_device);
      clock.end_part(&PhaseTimes::sparse_ms);
      dense = dense_inputs_of(*pkg, on_device, boundary);
    }
  };
  // A counts program reads the request on the device; counts added up here let it wait for the page tables, and
  // go with them.
  const bool moved_first = !d.host_counts;
  if (moved_first) move({}, nullptr, nullptr);
  std::vector<at::Tensor> counted;
  if (d.host_counts) {  // sums of request features: added up here, with nothing read back from the device
    auto sum = [&](const detail::DerivedKVSection::HostSum& part) {
      at::Tensor total = at::full({all}, part.constant, at::kLong);
      for (const auto& [feature, k] : part.terms) {
        at::Tensor value = whole.at(feature).to(at::kCPU).to(at::kLong).reshape({-1});
        if (value.numel() != all) {
          throw Error(feature + " has " + std::to_string(value.numel()) + " values for a batch of " +
                      std::to_string(all) + " users");
        }
        total.add_(value, k);
      }
      return total;
    };
    counted = {sum(d.host_counts->first), sum(d.host_counts->second)};
  } else {
    std::vector<at::Tensor> count_inputs;
    for (const auto& name : d.counts_inputs) count_inputs.push_back(dense.at(name));
    counted = counts_program->run(count_inputs);
  }
  if (counted.size() != 2 || counted[0].numel() != all || counted[1].numel() != all) {
    throw Error(d.counts_file + " did not return a sequence length and a target count for each of the " +
                std::to_string(all) + " users");
  }
  HostInts lengths(counted[0]), targets(counted[1]);
  std::vector<int64_t> stored(all);
  for (int64_t b = 0; b < all; ++b) stored[b] = lengths.data[b] - targets.data[b];
  std::unordered_map<int64_t, int> seen;
  for (int64_t user : users) seen[user] += 1;

  UsingUsers in_use(*this, users);
  std::vector<int64_t> cached(batch, 0);
  std::vector<std::vector<int64_t>> tables(batch);
  std::vector<bool> kept(batch, false);
  int64_t bypassed = 0;
  for (int64_t b = 0; b < batch; ++b) {
    if (seen[users[b]] > 1) {  // the same user twice in one batch: served, not stored
      bypassed += 1;
      continue;
    }
    bool found = false;
    int64_t length = 0;
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (auto it = entries.find(users[b]); it != entries.end()) {
        recency.splice(recency.end(), recency, it->second.order);  // most recently used
        found = true;
        length = it->second.length;
      }
    }
    int64_t reuse = found && length > 0 && length <= stored[b] ? length : 0;
    count(!found || length == 0 ? &KVCacheStats::misses : reuse > 0 ? &KVCacheStats::hits : &KVCacheStats::stale);
    try {
      tables[b] = reserve(users[b], stored[b], reuse);
    } catch (const CacheFull&) {
      bypassed += 1;
      continue;
    }
    cached[b] = reuse;
    kept[b] = true;
  }
  if (bypassed > 0) count(&KVCacheStats::bypassed, bypassed);
  std::vector<HeldUpdate> held_updates;

  // What the program takes besides the request, from the host's counts, cached prefixes and page tables. The
  // padding user's cached count puts the new rows on a step; its pages are the scratch page, the table's width a
  // bucket's.
  std::vector<int64_t> lengths_all(lengths.data, lengths.data + all);
  auto row_inputs = [&]() {
    int64_t width = 1;
    for (const auto& row : tables) width = std::max<int64_t>(width, static_cast<int64_t>(row.size()));
    std::vector<int64_t> cached_all(cached);
    if (padded) {
      cached_all.push_back(padding->cached(lengths_all, stored, cached));
      width = padding->width(std::max(width, (stored.back() + kv.page_size - 1) / kv.page_size));
    }
    at::Tensor table = at::full({all, width}, scratch, at::kInt);  // the rest of a row: the scratch page
    for (int64_t b = 0; b < batch; ++b) {
      auto* row = table.data_ptr<int32_t>() + b * width;
      for (size_t i = 0; i < tables[b].size(); ++i) row[i] = static_cast<int32_t>(tables[b][i]);
    }
    // The rows past each user's cached prefix (kv_new_rows; kv_derive.new_rows_of): their count sizes the
    // program's layers, given here so that it reads nothing back from the device.
    // kv_target_rows (kv_derive.target_rows_of): each user's targets, its last rows, as indices into those.
    std::vector<int64_t> new_rows, target_rows;
    int64_t start = 0;
    for (int64_t b = 0; b < all; ++b) {
      int64_t prefix = cached_all[b] >= 0 && cached_all[b] <= stored[b] ? cached_all[b] : 0;
      for (int64_t i = start + prefix; i < start + lengths.data[b]; ++i) new_rows.push_back(i);
      const int64_t end = static_cast<int64_t>(new_rows.size());
      for (int64_t i = end - (lengths.data[b] - stored[b]); i < end; ++i) target_rows.push_back(i);
      start += lengths.data[b];
    }
    return std::vector<at::Tensor>{at::tensor(cached_all, at::kLong), table, at::tensor(new_rows, at::kLong),
                                   at::tensor(target_rows, at::kLong)};
  };
  std::vector<at::Tensor> rows = row_inputs();
  if (moved_first) {
    detail::to_device(rows, pkg->device);  // in one transfer
  } else {
    std::vector<bool> kept_all(kept);
    if (padded) kept_all.push_back(false);
    move(kept_all, hold_rows ? &held_updates : nullptr, &rows);
  }

  auto call = [&](const std::vector<at::Tensor>& moved) {
    const std::map<std::string, at::Tensor> made = {
        {"kv_cached", moved[0]},     {"kv_k_pages", k},           {"kv_v_pages", v},
        {"kv_x_pages", x},           {"kv_page_table", moved[1]}, {"kv_new_rows", moved[2]},
        {"kv_target_rows", moved[3]}};
    detail::ProgramInputs inputs;
    if (whole_request) {  // the request itself: the graph runs the sparse half too
      for (const auto& [name, value] : on_device) inputs[kRequestInput + name] = value;
    }
    for (const auto& name : d.inputs) {
      auto it = made.find(name);
      if (it != made.end()) {
        inputs[name] = it->second;
      } else if (auto table = derived_tables.find(name); table != derived_tables.end()) {
        inputs[name] = table->second;
      } else if (auto feature = d.request_inputs.find(name); feature != d.request_inputs.end()) {
        inputs[name] = on_device.at(feature->second);
      } else if (!whole_request) {
        inputs[name] = dense.at(name);
      }
    }
    std::vector<at::Tensor> outputs;
    if (shape_graphs) {
      outputs = (*shape_graphs)(inputs);
    } else {
      std::vector<at::Tensor> ordered;
      for (const auto& name : d.inputs) ordered.push_back(inputs.at(name));
      outputs = program->run(ordered);
    }
    if (outputs.size() != d.outputs.size()) {
      throw Error(d.program_file + " returned " + std::to_string(outputs.size()) + " outputs, the manifest names " +
                  std::to_string(d.outputs.size()));
    }
    if (padded) return padding->unpad(outputs, d.outputs, *padded, lengths_all.back() - stored.back());
    return outputs;
  };
  clock.lap(&PhaseTimes::before_dense_ms);
  std::vector<at::Tensor> outputs = call(rows);
  std::vector<int64_t> again;
  if (std::any_of(cached.begin(), cached.end(), [](int64_t n) { return n > 0; })) {  // else nothing can be stale
    HostInts stale(outputs.back());  // kv_stale, per user: read back, so waited for
    for (int64_t b = 0; b < batch; ++b) {
      if (stale.data[b] != 0 && cached[b] > 0) again.push_back(b);
    }
  }
  if (!again.empty()) {  // their frontier rows changed: recomputed from nothing
    count(&KVCacheStats::hits, -static_cast<int64_t>(again.size()));
    count(&KVCacheStats::stale, static_cast<int64_t>(again.size()));
    for (int64_t b : again) {
      cached[b] = 0;
      tables[b] = reserve(users[b], stored[b], 0);
    }
    rows = row_inputs();
    detail::to_device(rows, pkg->device);
    outputs = call(rows);
  }
  clock.split(&PhaseTimes::dense_launch_ms);
  clock.lap(&PhaseTimes::dense_ms);
  keep_held(held_updates);
  for (int64_t b = 0; b < batch; ++b) {
    if (kept[b]) commit(users[b], stored[b], nullptr);
  }
  NamedTensors out;
  for (const auto& name : pkg->output_names) {
    size_t index = std::find(d.outputs.begin(), d.outputs.end(), name) - d.outputs.begin();
    out.emplace_back(name, outputs.at(index));
  }
  return out;
}

}  // namespace hstu_export
