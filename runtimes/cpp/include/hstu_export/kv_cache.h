// KV-cached serving from C++: a package exported with --kv-cache, served through a paged cache of each
// user's per-layer keys and values (docs/KV_CACHE.md). The same cache as Python's
// `predictor.kv_cache(...)` (hstu_export/serving/kv_cache.py), with the same answers and counters:
//
//   auto package = hstu_export::Package::open("model.aoti");
//   auto ranker = hstu_export::CachedRanker::open(package, {.budget_bytes = int64_t{8} << 30});
//   auto outputs = ranker->run(request, {1017, 2203});   // what package->run(request) returns
//   hstu_export::KVCacheStats stats = ranker->stats();
//
// Only each user's tokens past its cached prefix are computed. An entry is reused only when that is
// exact: the request's contextual ids and history start with the cached ones (with contextual features:
// the history is unchanged) and every cached token keeps its timestamp bucket at the request's query
// time; otherwise the user is recomputed (a prefill). The histories are compared while the device runs the
// request as if they matched; a user whose history differs is counted stale and the request runs again, that
// user from nothing, before run() returns. A package whose delta program was derived from the
// model's graph (kv_cache.kind "derived", any model but the zoo's) is served the same way, reuse decided by
// the program itself: it compares each user's cached rows and reports the stale users, which are run again
// from nothing. Pages are allocated once, on the package's device; whole users are evicted, least recently
// used first, never while a request uses them. run() may be called from many threads: requests for the same
// user are serialised, others run at once.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "hstu_export/runtime.h"

namespace hstu_export {

// How the delta program runs (docs/KV_CACHE.md): replayed from CUDA graphs, one per shape bucket
// (kOn; kAuto: on for a CUDA package when the runtime was built with CUDA headers), as it is (kOff), or in
// shape buckets without graphs (kBuckets: the buckets' bookkeeping on any device, what CPU tests check).
// A derived delta program has a graph per exact input shapes instead of buckets, and only when it reads
// nothing back from the device (kv_cache.device_reads 0; kAuto leaves the others without graphs).
using KVGraphs = Graphs;
using KVGraphCounts = GraphCounts;

struct KVCacheOptions {
  // Bytes of K/V pages, allocated at open. 0: room for max_batch_size users at the longest sequence.
  int64_t budget_bytes = 0;
  // Seconds a cached token may keep the timestamp bucket it was computed with (an approximation);
  // 0: exact, an entry whose buckets moved is recomputed.
  int64_t max_time_drift = 0;
  KVGraphs graphs = KVGraphs::kAuto;
  // A derived delta program's exact-shape graphs: a call whose inputs copied into its graph exceed this many
  // bytes runs as it is (the copies would cost more than the launches they save). 0: 160 MiB.
  int64_t graph_copy_limit = 0;
  // A derived delta program's jagged request features (a user's history rows) kept on the device for each cached
  // user: a request whose rows of a feature begin with the ones its user sent last, byte for byte (compared on
  // the host), sends only the rows after them. Needs the counts added up on the host. Off by default: not yet
  // timed on a GPU (docs/KV_CACHE.md, "Held rows").
  bool held_rows = false;
  // A derived delta program's shape buckets (docs/KV_CACHE.md, "Shape buckets"): a padding user appended to each
  // request that has room for one, rounding its shapes to a bucket's, where the export verified one
  // (kv_cache.padding). kAuto: with the program's graphs (kv_graphs on or buckets); kOn without a verified padding
  // user is an error.
  enum class ShapeBuckets { kAuto, kOn, kOff };
  ShapeBuckets shape_buckets = ShapeBuckets::kAuto;
};

struct KVCacheStats {
  int64_t hits = 0;
  int64_t misses = 0;     // nothing cached for the user
  int64_t stale = 0;      // an entry that could not be reused exactly, recomputed
  int64_t evictions = 0;  // users evicted to make room
  int64_t bypassed = 0;   // users served without being stored (no room, or twice in one batch)
  int64_t users = 0;
  int64_t pages_used = 0;
  int64_t pages = 0;
};

// A derived delta program's jagged request rows with held rows on (KVCacheOptions::held_rows): those taken from
// the users' entries on the device, and those sent from the host.
struct HeldRowCounts {
  bool on = false;
  int64_t taken = 0;
  int64_t sent = 0;
};

class CachedRanker {
 public:
  // PackageError when the package has no usable delta program; Error when the budget holds no page, or (on
  // the host) is more than the memory available.
  static std::shared_ptr<CachedRanker> open(std::shared_ptr<const Package> package, const KVCacheOptions& options = {});
  ~CachedRanker();
  CachedRanker(const CachedRanker&) = delete;
  CachedRanker& operator=(const CachedRanker&) = delete;

  // Validates the request as Package::run does (and one user id per user: RequestError), serves it
  // through the cache, and returns the outputs in the package's output_names() order. Thread-safe.
  // `times`: see PhaseTimes.
  NamedTensors run(const Tensors& request, const std::vector<int64_t>& user_ids, PhaseTimes* times = nullptr);

  KVCacheStats stats() const;
  // Whether requests run in shape buckets (CUDA graphs or kBuckets), and how they ran; zeros without. A derived
  // delta program's graphs are keyed by exact shapes instead (derived()).
  bool bucketed() const;
  bool derived() const;
  KVGraphCounts graph_counts() const;
  HeldRowCounts held_rows() const;
  // Calls run with a padding user (a derived program's shape buckets); -1 where the ranker pads none.
  int64_t padded_calls() const;
  int64_t bytes() const;      // of the K/V pages
  int64_t page_size() const;  // tokens per page
  const Package& package() const;

  struct Impl;

 private:
  explicit CachedRanker(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace hstu_export
