// Shape buckets for a derived delta program: a padding user appended to the request. hstu_export/serving/
// kv_padding.py in C++, with the same lengths, rows and counts, so that both runtimes answer bit for bit. Internal.
//
// A derived program's CUDA graphs are keyed by exact input shapes; the padding user rounds each lengths feature's
// total, the new rows and the page table's width to steps, so that requests of nearby sizes share a shape. Its rows
// are copies of the request's first rows, its per-user features the first user's; it is given as cached all of its
// stored rows but those that put the new rows on a step, on the scratch page; its rows of the outputs (the last
// ones) are dropped, as the manifest's kv_cache.padding.rows_of says which input each output's rows follow.
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "hstu_export/runtime.h"
#include "package_impl.h"

namespace hstu_export::detail {

struct PaddedRequest {
  Tensors request;                          // with the padding user last, on the host
  std::map<std::string, int64_t> pad_rows;  // each feature's rows of the padding user, by name
};

class RequestPadding {
 public:
  RequestPadding(const std::vector<Feature>& features, PaddingSpec spec, int64_t max_batch, int64_t max_width);
  RequestPadding(const RequestPadding&) = delete;  // groups_ points into features_
  RequestPadding& operator=(const RequestPadding&) = delete;

  // `request` (checked, `users` users) with a padding user; none where it has no room for one, a tensor is not on
  // the host, or no lengths in the features' ranges put the totals on steps.
  std::optional<PaddedRequest> pad(const Tensors& request, int64_t users) const;
  // The padding user's cached count (it is the last of `seq_lengths` and `stored`; `cached`: the real users').
  int64_t cached(const std::vector<int64_t>& seq_lengths, const std::vector<int64_t>& stored,
                 const std::vector<int64_t>& cached) const;
  // The page table's width in a bucket: a power of two, within the widest (a wider table keeps its own).
  int64_t width(int64_t width) const;
  // The real users' rows of `outputs` (named `names`); `targets`: the padding user's target count.
  std::vector<at::Tensor> unpad(const std::vector<at::Tensor>& outputs, const std::vector<std::string>& names,
                                const PaddedRequest& padded, int64_t targets) const;

 private:
  std::vector<Feature> features_;
  PaddingSpec spec_;
  int64_t max_batch_;
  int64_t max_width_;
  std::map<std::string, std::string> canonical_;  // lengths feature -> the one it equals (same_as), or itself
  std::vector<const Feature*> groups_;            // the lengths features no other equals
  int64_t new_rows_step_ = 1;
};

}  // namespace hstu_export::detail
