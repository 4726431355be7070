// Shape buckets and CUDA graphs for the delta program: runtimes/kv_graphs.py, in C++. Internal.
//
// A graph replays fixed shapes, so a request runs in a bucket: a padding user is appended whose history
// and candidates round the token counts up to fixed steps (it may have none), and the page table's width
// is rounded up to a power of two. The padding user has nothing cached and attends only to itself, so
// the real users' answers are those of the unpadded request; its rows of the outputs come last and are
// dropped, its K/V go to the pool's scratch page. A bucket is captured the second time it is seen
// (one-off shapes run as they are, and so do requests whose bucket would be beyond the program's
// exported bounds), at most `max_graphs` are kept, least recently used out. The graph's first nodes copy
// the request into the bucket's buffers: before a replay, each copy node is pointed at the request's tensor
// (cudaGraphExecMemcpyNodeSetParams1D), so that a call launches once. An input that cannot be copied that
// way (not contiguous, or a page table narrower than the bucket's: see table_width) is copied before the
// replay instead, as every input is where the CUDA runtime's graph functions are not found. The graph
// computes the padding user's counts itself. Replays are serialised; the real output rows are copied out,
// by one _foreach_copy_.
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "hstu_export/kv_cache.h"

namespace hstu_export::detail {

// The delta program's inputs by name, and a call of the program on them (outputs in its order).
using ProgramInputs = std::map<std::string, at::Tensor>;
using RunProgram = std::function<std::vector<at::Tensor>(const ProgramInputs&)>;

struct Buckets {
  int64_t history = 64;     // new history tokens are rounded up to a multiple of this
  int64_t candidates = 32;  // candidates too
  int64_t max_width = 64;   // the page table's width, rounded up to a power of two, stays within this
  // The program's bounds: a request whose bucket would take more users, history tokens or candidates runs
  // as it is (beyond them the program's answers are not defined). 0: unbounded.
  int64_t max_batch = 0;
  int64_t max_history = 0;
  int64_t max_candidates = 0;
  // The program fits the counts to its tables (kv_cache.fits_counts): the padding user's counts are the
  // bucket's rows, the same on every call; else they are what the real users leave, computed at each replay.
  bool fitted_counts = false;
};

// `values` copied into new tensors by one _foreach_copy_ (one kernel on CUDA when they share a dtype, where a
// clone each is a copy each): a graph's outputs handed out, its buffers kept for the next replay.
std::vector<at::Tensor> copied(const std::vector<at::Tensor>& values);

// Whether this runtime was built with CUDA graph support (CUDA headers and libtorch_cuda at build time).
bool cuda_graphs_built();

class DeltaGraphs {
 public:
  // capture=false keeps the buckets and their buffers but runs the program on them instead of replaying a
  // graph: the same bookkeeping on any device (what CPU tests check).
  DeltaGraphs(RunProgram run, Buckets buckets, int64_t contextual, bool capture, size_t max_graphs = 16);
  ~DeltaGraphs();
  DeltaGraphs(const DeltaGraphs&) = delete;
  DeltaGraphs& operator=(const DeltaGraphs&) = delete;

  // The program's outputs for the request (its own rows, in tensors that outlive the call).
  std::vector<at::Tensor> operator()(const ProgramInputs& inputs);

  // The page table's width in the bucket of a request whose table is `width` wide: a table built this wide
  // (its later columns the scratch page) is copied into the bucket as it is, inside the graph.
  int64_t table_width(int64_t width) const;

  using Counts = KVGraphCounts;
  Counts counts() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace hstu_export::detail
