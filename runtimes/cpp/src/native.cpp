// libhstu_export_native: the C++ runtime for Python, as torch custom classes (torch.classes.hstu_export_native):
// Package (Package::open and run), Published (PublishedPackage: a publish root followed) and CachedRanker
// (CachedRanker::open and run). Python's wrapper is runtimes/native.py; a request crosses as a dict of
// tensors, without copies.
//
// An error of the runtime reaches Python as a RuntimeError whose text starts with its class ("RequestError: ",
// "PackageError: ", "Error: "), which the wrapper raises as hstu-export's own exception.
#include <torch/custom_class.h>
#include <torch/script.h>

#include <string>
#include <vector>

#include "hstu_export/kv_cache.h"
#include "hstu_export/runtime.h"

namespace {

// Runs `body`, its runtime errors rethrown with their class in front of their text.
template <typename Body>
auto named_errors(Body body) -> decltype(body()) {
  try {
    return body();
  } catch (const hstu_export::RequestError& exc) {
    throw std::runtime_error(std::string("RequestError: ") + exc.what());
  } catch (const hstu_export::PackageError& exc) {
    throw std::runtime_error(std::string("PackageError: ") + exc.what());
  } catch (const hstu_export::Error& exc) {
    throw std::runtime_error(std::string("Error: ") + exc.what());
  }
}

hstu_export::Tensors tensors_of(const c10::Dict<std::string, at::Tensor>& request) {
  hstu_export::Tensors out;
  for (const auto& item : request) out.emplace(item.key(), item.value());
  return out;
}

c10::Dict<std::string, at::Tensor> dict_of(const hstu_export::NamedTensors& outputs) {
  c10::Dict<std::string, at::Tensor> out;  // keeps the outputs' order
  for (const auto& [name, value] : outputs) out.insert(name, value);
  return out;
}

// "on", "off", anything else auto (the Python side passes only these three).
hstu_export::Graphs graphs_of(const std::string& graphs) {
  return graphs == "on" ? hstu_export::Graphs::kOn : graphs == "off" ? hstu_export::Graphs::kOff : hstu_export::Graphs::kAuto;
}

struct NativePackage : torch::CustomClassHolder {
  std::shared_ptr<const hstu_export::Package> package;

  NativePackage(const std::string& path, const std::string& tables_device, bool verify_checksums,
                int64_t device_index, const std::string& graphs, int64_t graph_copy_limit) {
    hstu_export::Options options;
    options.graphs = graphs_of(graphs);
    options.graph_copy_limit = graph_copy_limit;
    options.tables_device = tables_device;
    options.device_index = static_cast<int>(device_index);
    options.verify_checksums = verify_checksums;
    options.concurrency = 4;  // CPU model instances: Python threads may call at once
    package = named_errors([&] { return hstu_export::Package::open(path, options); });
  }

  c10::Dict<std::string, at::Tensor> run(const c10::Dict<std::string, at::Tensor>& request) const {
    return named_errors([&] { return dict_of(package->run(tensors_of(request))); });
  }

  std::vector<std::string> output_names() const { return package->output_names(); }
  int64_t max_batch_size() const { return package->max_batch_size(); }
  std::string device() const { return package->device().str(); }
  std::string path() const { return package->path(); }
};

// A directory hstu-export publish writes, followed between calls (PublishedPackage).
struct NativePublished : torch::CustomClassHolder {
  std::shared_ptr<hstu_export::PublishedPackage> published;

  NativePublished(const std::string& root, const std::string& tables_device, bool verify_checksums,
                  int64_t device_index, double check_seconds, const std::string& graphs,
                  int64_t graph_copy_limit) {
    hstu_export::Options options;
    options.graphs = graphs_of(graphs);
    options.graph_copy_limit = graph_copy_limit;
    options.tables_device = tables_device;
    options.verify_checksums = verify_checksums;
    options.device_index = static_cast<int>(device_index);
    options.concurrency = 4;
    published = named_errors([&] { return hstu_export::PublishedPackage::open(root, options, check_seconds); });
  }

  c10::Dict<std::string, at::Tensor> run(const c10::Dict<std::string, at::Tensor>& request) {
    return named_errors([&] { return dict_of(published->run(tensors_of(request))); });
  }

  int64_t refresh() { return named_errors([&] { return published->refresh(); }); }
  int64_t version() const { return published->version(); }
  int64_t switches() const { return published->switches(); }
  std::string last_error() const { return published->last_error(); }
  std::vector<std::string> output_names() const { return published->package()->output_names(); }
  int64_t max_batch_size() const { return published->package()->max_batch_size(); }
  std::string device() const { return published->package()->device().str(); }
  std::string path() const { return published->package()->path(); }
};

struct NativeRanker : torch::CustomClassHolder {
  std::shared_ptr<hstu_export::CachedRanker> ranker;

  NativeRanker(const c10::intrusive_ptr<NativePackage>& package, int64_t budget_bytes, int64_t max_time_drift,
               const std::string& graphs, int64_t graph_copy_limit, bool held_rows, const std::string& shape_buckets) {
    using Buckets = hstu_export::KVCacheOptions::ShapeBuckets;
    hstu_export::KVCacheOptions options;
    options.held_rows = held_rows;
    options.shape_buckets = shape_buckets == "on" ? Buckets::kOn : shape_buckets == "off" ? Buckets::kOff : Buckets::kAuto;
    options.budget_bytes = budget_bytes;
    options.max_time_drift = max_time_drift;
    options.graph_copy_limit = graph_copy_limit;
    options.graphs = graphs_of(graphs);
    ranker = named_errors([&] { return hstu_export::CachedRanker::open(package->package, options); });
  }

  c10::Dict<std::string, at::Tensor> run(const c10::Dict<std::string, at::Tensor>& request,
                                         const std::vector<int64_t>& user_ids) {
    return named_errors([&] { return dict_of(ranker->run(tensors_of(request), user_ids)); });
  }

  // hits, misses, stale, evictions, bypassed, users, pages_used, pages (KVCacheStats' order)
  std::vector<int64_t> stats() const {
    hstu_export::KVCacheStats s = ranker->stats();
    return {s.hits, s.misses, s.stale, s.evictions, s.bypassed, s.users, s.pages_used, s.pages};
  }
};

TORCH_LIBRARY(hstu_export_native, m) {
  m.class_<NativePackage>("Package")
      .def(torch::init<std::string, std::string, bool, int64_t, std::string, int64_t>())
      .def("run", &NativePackage::run)
      .def("output_names", &NativePackage::output_names)
      .def("max_batch_size", &NativePackage::max_batch_size)
      .def("device", &NativePackage::device)
      .def("path", &NativePackage::path);
  m.class_<NativePublished>("Published")
      .def(torch::init<std::string, std::string, bool, int64_t, double, std::string, int64_t>())
      .def("run", &NativePublished::run)
      .def("refresh", &NativePublished::refresh)
      .def("version", &NativePublished::version)
      .def("switches", &NativePublished::switches)
      .def("last_error", &NativePublished::last_error)
      .def("output_names", &NativePublished::output_names)
      .def("max_batch_size", &NativePublished::max_batch_size)
      .def("device", &NativePublished::device)
      .def("path", &NativePublished::path);
  m.class_<NativeRanker>("CachedRanker")
      .def(torch::init<c10::intrusive_ptr<NativePackage>, int64_t, int64_t, std::string, int64_t, bool, std::string>())
      .def("run", &NativeRanker::run)
      .def("stats", &NativeRanker::stats);
}

}  // namespace
