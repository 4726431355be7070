// A derived delta program's padding user: kv_padding.h.
#include "kv_padding.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <utility>

namespace hstu_export::detail {
namespace {

// The steps of serving/kv_padding.py.
constexpr int64_t kHistoryStep = 64;
constexpr int64_t kTargetStep = 32;
constexpr int64_t kNewRowsStep = 64;

int64_t floor_mod(int64_t a, int64_t m) { return ((a % m) + m) % m; }

// (step, least length) of a lengths feature's padding (kv_padding.py's _steps).
std::pair<int64_t, int64_t> steps(const Feature& f, bool target) {
  int64_t step = target ? kTargetStep : kHistoryStep;
  if (f.max_value) {
    const auto top = static_cast<int64_t>(*f.max_value);
    step = std::max<int64_t>(1, std::min(step, target ? top : (top + 1) / 2));
  }
  const int64_t least = std::max<int64_t>(f.min_value ? static_cast<int64_t>(*f.min_value) : 0, target ? 1 : step);
  return {step, least};
}

}  // namespace

RequestPadding::RequestPadding(const std::vector<Feature>& features, PaddingSpec spec, int64_t max_batch,
                               int64_t max_width)
    : features_(features), spec_(std::move(spec)), max_batch_(max_batch), max_width_(max_width) {
  auto find = [&](const std::string& name) -> const Feature* {
    for (const auto& f : features_) {
      if (f.name == name) return &f;
    }
    return nullptr;
  };
  for (const auto& f : features_) {
    if (f.kind != "lengths") continue;
    std::set<std::string> seen;
    const Feature* at = &f;
    while (!at->same_as.empty() && !seen.count(at->name)) {
      const Feature* next = find(at->same_as);
      if (next == nullptr) break;
      seen.insert(at->name);
      at = next;
    }
    canonical_[f.name] = at->name;
  }
  int64_t least = 0;
  for (const auto& f : features_) {
    if (f.kind != "lengths" || canonical_.at(f.name) != f.name) continue;
    groups_.push_back(&f);
    if (!spec_.target_features.count(f.name)) least += steps(f, false).second;
  }
  new_rows_step_ = std::max<int64_t>(1, std::min(kNewRowsStep, least + 1));
}

std::optional<PaddedRequest> RequestPadding::pad(const Tensors& request, int64_t users) const {
  if (users + 1 > max_batch_) return std::nullopt;
  std::map<std::string, int64_t> lengths;
  for (const Feature* f : groups_) {
    const at::Tensor& value = request.at(f->name);
    if (!value.device().is_cpu() || value.dim() != 1 || value.size(0) != users) return std::nullopt;
    const int64_t total = value.to(at::kLong).sum().item<int64_t>();
    auto [step, least] = steps(*f, spec_.target_features.count(f->name) > 0);
    const int64_t n = least + floor_mod(-(total + least), step);
    if (f->max_value && n > static_cast<int64_t>(*f->max_value)) return std::nullopt;
    lengths[f->name] = n;
  }
  PaddedRequest out;
  for (const auto& f : features_) {
    const at::Tensor value = plain_tensor(request.at(f.name));
    if (!value.device().is_cpu() || value.dim() < 1) return std::nullopt;
    at::Tensor rows;
    int64_t n = 1;
    if (f.kind == "jagged") {
      n = lengths.at(canonical_.at(f.jagged_by));
      if (n > 0 && value.size(0) == 0) return std::nullopt;  // no rows to copy
      at::Tensor index = at::arange(n, at::kLong).remainder(std::max<int64_t>(value.size(0), 1));
      rows = value.index_select(0, index);
    } else if (f.kind == "lengths") {
      rows = at::full({1}, lengths.at(canonical_.at(f.name)), value.options());
    } else {
      if (value.size(0) == 0) return std::nullopt;
      rows = value.narrow(0, 0, 1);
    }
    out.request.emplace(f.name, at::cat({value, rows}, 0));
    out.pad_rows[f.name] = n;
  }
  return out;
}

int64_t RequestPadding::cached(const std::vector<int64_t>& seq_lengths, const std::vector<int64_t>& stored,
                               const std::vector<int64_t>& cached) const {
  const int64_t targets = seq_lengths.back() - stored.back();
  int64_t fresh = targets;
  for (size_t b = 0; b < cached.size(); ++b) fresh += seq_lengths[b] - cached[b];
  return std::max<int64_t>(0, stored.back() - floor_mod(-fresh, new_rows_step_));
}

int64_t RequestPadding::width(int64_t width) const {
  int64_t power = 1;
  while (power < width) power <<= 1;
  return std::min(std::max(power, width), std::max(max_width_, width));
}

std::vector<at::Tensor> RequestPadding::unpad(const std::vector<at::Tensor>& outputs,
                                              const std::vector<std::string>& names, const PaddedRequest& padded,
                                              int64_t targets) const {
  std::map<std::string, int64_t> pads = padded.pad_rows;
  pads["kv_cached"] = 1;
  pads["kv_page_table"] = 1;
  pads["kv_target_rows"] = targets;
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < outputs.size(); ++i) {
    auto follows = spec_.rows_of.find(names.at(i));
    if (follows == spec_.rows_of.end() || follows->second.empty()) {
      out.push_back(outputs[i]);
    } else {
      out.push_back(outputs[i].narrow(0, 0, outputs[i].size(0) - pads.at(follows->second)));
    }
  }
  return out;
}

}  // namespace hstu_export::detail
