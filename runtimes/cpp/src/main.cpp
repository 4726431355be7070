// hstu-export-run: open a package with the C++ runtime, run one request directory, print (and write) the
// outputs. Also a smoke test for serving: --repeat times it, --threads runs it from several threads at
// once and checks every thread got the same outputs bit for bit. With --kv-cache it serves a sequence of
// request directories through the package's KV cache (CachedRanker), each with its users' ids. With --follow it
// serves a directory hstu-export publish writes while its current version moves (PublishedPackage).
#include <ATen/ATen.h>
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <cstdio>
#include <iostream>
#include <latch>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "hstu_export/kv_cache.h"
#include "hstu_export/runtime.h"

namespace {

constexpr const char* kUsage =
    "usage: hstu-export-run PACKAGE REQUEST_DIR [--out DIR] [--op-library-dir DIR]... [--no-verify-checksums]\n"
    "                       [--device cuda:N] [--tables-device cpu|cuda]\n"
    "                       [--repeat N] [--warmup N] [--threads N] [--phase-times] [--follow S] [--quiet]\n"
    "       hstu-export-run PACKAGE REQUEST_DIR... --kv-cache BUDGET --user-ids IDS... [--max-time-drift S] [...]\n"
    "\n"
    "Open an hstu-export package (aoti or torchscript) with the C++ runtime, validate the request in\n"
    "REQUEST_DIR (one <feature>.pt per feature: `hstu-export request PACKAGE --out DIR` writes one),\n"
    "run it and print the outputs.\n"
    "\n"
    "  --out DIR              write the outputs there, one <output>.pt each (torch.load reads them);\n"
    "                         with several REQUEST_DIRs, DIR/1, DIR/2, ... in their order\n"
    "  --op-library-dir DIR   where op libraries such as fbgemm_gpu_py.so are (repeatable; also\n"
    "                         $HSTU_EXPORT_OP_LIBRARY_PATH, ':'-separated, and the build's defaults)\n"
    "  --no-verify-checksums  skip the per-file sha256 check (manifest.sha256 is still checked)\n"
    "  --device cuda:N        the CUDA device a CUDA package runs on (default cuda:0)\n"
    "  --tables-device cpu|cuda\n"
    "                         where the tables stored beside a compiled sparse half live (default: the\n"
    "                         package's device); cpu: pinned host memory the GPU reads, for tables larger\n"
    "                         than the GPU's memory\n"
    "  --repeat N             run N more times and print the latency (median and p99, ms)\n"
    "  --warmup N             before those, N runs that are not timed, in each thread (TorchScript optimises\n"
    "                         its graph on the first runs, CUDA kernels load on first use)\n"
    "  --threads N            run from N threads at once (with --repeat: N each); outputs must all be equal\n"
    "  --latency-log FILE     with --repeat: write every timed run's latency there (thread, pass, request, ms)\n"
    "  --phase-times          with --repeat (one thread): also time each request's phases, the device\n"
    "                         synchronised between them: before the dense half (validation, sparse half,\n"
    "                         inputs, cache bookkeeping), the dense half as served (with --kv-cache: the\n"
    "                         delta program, its shape bucket's copies and graph replay), and after it;\n"
    "                         prints their medians per request, how soon the call that launches the\n"
    "                         dense half returned (the host's part of it), and of the time before it, the\n"
    "                         request's move to the device and the sparse half (which a derived program's\n"
    "                         whole-request graph runs inside the dense half)\n"
    "  --follow S             PACKAGE is a directory `hstu-export publish` writes: look at its current\n"
    "                         version at most every S seconds while serving, and move to a newly\n"
    "                         published one between requests once it is open (opened on another thread;\n"
    "                         a version that does not open, or takes other requests, is not served and\n"
    "                         the reason is printed). Each run must equal its version's first answer; the\n"
    "                         runs per version are printed, and --out DIR writes each version's first\n"
    "                         answer to DIR/<version>\n"
    "  --graphs MODE          whole requests from CUDA graphs, one per exact request shapes seen twice:\n"
    "                         auto (default: on for a CUDA package whose programs read nothing back from\n"
    "                         the device, when the runtime was built with CUDA headers), on, off, or\n"
    "                         buckets (the graphs' bookkeeping without graphs, any device). Without\n"
    "                         --kv-cache; the cache has --kv-graphs\n"
    "  --graph-copy-limit BYTES\n"
    "                         a request whose tensors exceed BYTES (KiB, MiB or GiB allowed; default\n"
    "                         512KiB, a few users of long histories) runs as it is, without its graph\n"
    "  --quiet                print nothing but errors\n"
    "\n"
    "KV-cached serving (a package exported with --kv-cache; docs/KV_CACHE.md):\n"
    "  --kv-cache BUDGET      serve the REQUEST_DIRs in order through one KV cache of BUDGET bytes (a number,\n"
    "                         with KiB, MiB or GiB; 'auto': room for max_batch_size users at the longest\n"
    "                         sequence), then print its counters. --repeat and --threads serve the whole\n"
    "                         sequence again and print how far the outputs are from the first pass's\n"
    "  --user-ids IDS         the users of one REQUEST_DIR, comma-separated integers in batch order; give\n"
    "                         it once per REQUEST_DIR, in the same order\n"
    "  --max-time-drift S     seconds a cached token keeps its timestamp bucket (default 0: exact)\n"
    "  --kv-graphs MODE       auto (default: CUDA graphs for a CUDA package, when the runtime was built\n"
    "                         with CUDA headers and, for a derived delta program, when it reads nothing\n"
    "                         back from the device), on, off, or buckets (the graphs' bookkeeping without\n"
    "                         graphs, any device: shape buckets, or exact shapes for a derived program)\n"
    "  --kv-graph-copy-limit BYTES\n"
    "                         a derived program's call whose inputs copied into its CUDA graph exceed\n"
    "                         BYTES (KiB, MiB or GiB allowed; default 160MiB) runs as it is\n"
    "  --kv-held-rows on|off  a derived delta program's cache keeps each user's jagged request rows on the\n"
    "                         device and sends only the rows after an unchanged prefix (default off: not yet\n"
    "                         timed on a GPU)\n"
    "  --kv-shape-buckets MODE\n"
    "                         a derived delta program's shape buckets (a padding user that rounds a\n"
    "                         request's shapes, where the export verified one): auto (default: with its\n"
    "                         graphs, --kv-graphs on or buckets), on, or off\n";

struct Args {
  std::string package, out, latency_log;
  std::vector<std::string> requests;
  hstu_export::Options options;
  int repeat = 0;
  int warmup = 0;
  int threads = 1;
  bool quiet = false;
  bool phase_times = false;
  bool kv = false;
  hstu_export::KVCacheOptions kv_options;
  std::vector<std::vector<int64_t>> user_ids;
  bool kv_graphs_given = false;
  bool graphs_given = false;
  double follow = -1;  // seconds between looks at a published directory's current version; < 0: not followed
};

[[noreturn]] void usage_error(const std::string& what) {
  std::cerr << "hstu-export-run: error: " << what << " (see hstu-export-run --help)\n";
  std::exit(2);
}

int64_t integer(const std::string& flag, const std::string& text, int64_t low) {
  try {
    size_t used = 0;
    long long value = std::stoll(text, &used);
    if (used == text.size() && value >= low) return value;
  } catch (const std::exception&) {
  }
  usage_error(flag + " needs " + (low >= 1 ? "a positive integer" : low == 0 ? "an integer of 0 or more" : "integers") +
              ", got '" + text + "'");
}

hstu_export::Graphs graphs_mode(const std::string& flag, const std::string& mode) {
  if (mode == "auto") return hstu_export::Graphs::kAuto;
  if (mode == "on") return hstu_export::Graphs::kOn;
  if (mode == "off") return hstu_export::Graphs::kOff;
  if (mode == "buckets") return hstu_export::Graphs::kBuckets;
  usage_error(flag + " is auto, on, off or buckets, got '" + mode + "'");
}

int positive(const std::string& flag, const std::string& text) {
  int64_t value = integer(flag, text, 1);
  if (value > 1'000'000'000) usage_error(flag + " is too large: " + text);
  return static_cast<int>(value);
}

// "auto" (0), or bytes: a number with an optional KiB/MiB/GiB (or K/M/G) suffix.
int64_t budget(const std::string& text, const std::string& option = "--kv-cache") {
  if (text == "auto" && option == "--kv-cache") return 0;
  static const std::pair<const char*, int> kUnits[] = {{"KiB", 10}, {"MiB", 20}, {"GiB", 30}, {"K", 10}, {"M", 20}, {"G", 30}};
  for (const auto& [unit, shift] : kUnits) {
    std::string suffix(unit);
    if (text.size() > suffix.size() && text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0) {
      int64_t value = integer(option, text.substr(0, text.size() - suffix.size()), 1);
      if (value > (int64_t{1} << (62 - shift))) usage_error(option + " " + text + " is too large");
      return value << shift;
    }
  }
  return integer(option, text, 1);
}

std::vector<int64_t> user_ids(const std::string& text) {
  std::vector<int64_t> out;
  size_t start = 0;
  while (start <= text.size()) {
    size_t end = text.find(',', start);
    if (end == std::string::npos) end = text.size();
    out.push_back(integer("--user-ids", text.substr(start, end - start), INT64_MIN));
    start = end + 1;
  }
  return out;
}

Args parse(int argc, char** argv) {
  Args args;
  std::vector<std::string> positional;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage_error(arg + " needs a value");
      return argv[++i];
    };
    if (arg == "-h" || arg == "--help") {
      std::cout << kUsage;
      std::exit(0);
    } else if (arg == "--out") {
      args.out = value();
    } else if (arg == "--op-library-dir") {
      args.options.op_library_dirs.push_back(value());
    } else if (arg == "--no-verify-checksums") {
      args.options.verify_checksums = false;
    } else if (arg == "--device") {
      std::string text = value();
      if (text.rfind("cuda:", 0) != 0) usage_error("--device needs cuda:N, got '" + text + "'");
      int64_t index = integer(arg, text.substr(5), 0);
      if (index > 1023) usage_error("--device cuda:" + std::to_string(index) + " is not a device index");
      args.options.device_index = static_cast<int>(index);
    } else if (arg == "--tables-device") {
      args.options.tables_device = value();
      if (args.options.tables_device != "cpu" && args.options.tables_device != "cuda") {
        usage_error("--tables-device needs cpu or cuda");
      }
    } else if (arg == "--repeat") {
      args.repeat = positive(arg, value());
    } else if (arg == "--warmup") {
      args.warmup = positive(arg, value());
    } else if (arg == "--threads") {
      args.threads = positive(arg, value());
    } else if (arg == "--latency-log") {
      args.latency_log = value();
    } else if (arg == "--phase-times") {
      args.phase_times = true;
    } else if (arg == "--follow") {
      std::string text = value();
      try {
        size_t used = 0;
        args.follow = std::stod(text, &used);
        if (used != text.size()) args.follow = -1;
      } catch (const std::exception&) {
        args.follow = -1;
      }
      if (!(args.follow >= 0 && args.follow <= 86400)) usage_error("--follow needs seconds from 0 to 86400, got '" + text + "'");
    } else if (arg == "--quiet" || arg == "-q") {
      args.quiet = true;
    } else if (arg == "--kv-cache") {
      args.kv = true;
      args.kv_options.budget_bytes = budget(value());
    } else if (arg == "--user-ids") {
      args.user_ids.push_back(user_ids(value()));
    } else if (arg == "--kv-graphs") {
      args.kv_options.graphs = graphs_mode(arg, value());
      args.kv_graphs_given = true;
    } else if (arg == "--graphs") {
      args.options.graphs = graphs_mode(arg, value());
      args.graphs_given = true;
    } else if (arg == "--graph-copy-limit") {
      args.options.graph_copy_limit = budget(value(), arg);
      args.graphs_given = true;
    } else if (arg == "--kv-graph-copy-limit") {
      args.kv_options.graph_copy_limit = budget(value(), arg);
      args.kv_graphs_given = true;
    } else if (arg == "--max-time-drift") {
      args.kv_options.max_time_drift = integer(arg, value(), 0);
    } else if (arg == "--kv-held-rows") {
      std::string mode = value();
      if (mode != "on" && mode != "off") usage_error("--kv-held-rows is on or off, got " + mode);
      args.kv_options.held_rows = mode == "on";
      args.kv_graphs_given = true;
    } else if (arg == "--kv-shape-buckets") {
      using Buckets = hstu_export::KVCacheOptions::ShapeBuckets;
      std::string mode = value();
      if (mode != "auto" && mode != "on" && mode != "off") usage_error("--kv-shape-buckets is auto, on or off, got " + mode);
      args.kv_options.shape_buckets = mode == "on" ? Buckets::kOn : mode == "off" ? Buckets::kOff : Buckets::kAuto;
      args.kv_graphs_given = true;
    } else if (!arg.empty() && arg[0] == '-') {
      usage_error("unknown option " + arg);
    } else {
      positional.push_back(arg);
    }
  }
  if (positional.size() < 2 || (positional.size() > 2 && !args.kv)) {
    usage_error(positional.size() < 2 ? "expected PACKAGE and REQUEST_DIR"
                                      : "expected PACKAGE and one REQUEST_DIR (several only with --kv-cache)");
  }
  if (!args.kv && (!args.user_ids.empty() || args.kv_options.max_time_drift != 0 || args.kv_graphs_given)) {
    usage_error("--user-ids, --max-time-drift, --kv-graphs, --kv-graph-copy-limit, --kv-held-rows and "
                "--kv-shape-buckets go with --kv-cache");
  }
  if (args.kv && args.graphs_given) {
    usage_error("--graphs and --graph-copy-limit serve without --kv-cache; the cache's are --kv-graphs and "
                "--kv-graph-copy-limit");
  }
  if (args.kv) args.options.graphs = hstu_export::Graphs::kOff;  // the cache's own graphs run its requests
  if (args.kv && args.follow >= 0) {
    usage_error("--follow serves without --kv-cache (a new version's weights would not match the cached K/V)");
  }
  if (args.phase_times && (args.repeat == 0 || args.threads != 1)) {
    usage_error("--phase-times goes with --repeat, on one thread (the device is synchronised between phases)");
  }
  args.package = positional[0];
  args.requests.assign(positional.begin() + 1, positional.end());
  if (args.kv && args.user_ids.size() != args.requests.size()) {
    usage_error("--kv-cache needs one --user-ids per REQUEST_DIR: got " + std::to_string(args.user_ids.size()) +
                " for " + std::to_string(args.requests.size()));
  }
  args.options.concurrency = static_cast<size_t>(args.threads);
  return args;
}

// The largest absolute difference between two runs' outputs (0: bit for bit; infinity: other names or shapes).
double difference(const hstu_export::NamedTensors& a, const hstu_export::NamedTensors& b) {
  if (a.size() != b.size()) return INFINITY;
  double most = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].first != b[i].first || a[i].second.sizes() != b[i].second.sizes()) return INFINITY;
    if (a[i].second.equal(b[i].second)) continue;
    at::Tensor gap = (a[i].second.to(at::kDouble) - b[i].second.to(at::kDouble)).abs();
    most = std::max(most, gap.numel() ? gap.max().item<double>() : 0.0);
    if (std::isnan(most)) return INFINITY;
  }
  return most;
}

void synchronize(const hstu_export::Package& package) {
  if (package.device().is_cuda()) torch::cuda::synchronize();
}

void print_outputs(const hstu_export::NamedTensors& outputs) {
  for (const auto& [name, tensor] : outputs) {
    at::Tensor head = tensor.detach().flatten().slice(0, 0, 4).to(at::kDouble).cpu();
    std::string values;
    for (int64_t i = 0; i < head.numel(); ++i) {
      char cell[32];
      std::snprintf(cell, sizeof cell, "%s%.4f", i ? ", " : "", head[i].item<double>());
      values += cell;
    }
    std::printf("  %-24s %-16s %-8s %s\n", name.c_str(), c10::str(tensor.sizes()).c_str(),
                c10::toString(tensor.scalar_type()), values.c_str());
  }
}

using Compare = std::function<double(size_t, const hstu_export::NamedTensors&)>;

// --warmup and --repeat over the requests, from --threads threads: latency per request, and the largest
// difference of any output from what it is compared with (`against(k, outputs)`: the first pass's outputs of
// request k, or its version's; `exact`: throw unless it is 0).
void repeat(const Args& args, const hstu_export::Package& package, size_t count,
            const std::function<hstu_export::NamedTensors(size_t, hstu_export::PhaseTimes*)>& run_one,
            const Compare& against, bool exact) {
  int runs = std::max(args.repeat, 1);
  std::vector<std::vector<std::vector<double>>> latencies(args.threads, std::vector<std::vector<double>>(count));
  std::vector<std::vector<hstu_export::PhaseTimes>> phases(count);  // --phase-times (one thread), by request
  std::vector<double> gaps(args.threads, 0.0);
  std::vector<std::string> failures(args.threads);
  // Each thread warms up on its own, comparing answers as its timed runs do: whatever runs for the first time
  // (CUDA kernels load on first use) does so before any run is timed.
  std::latch ready(args.threads + 1);
  std::vector<std::thread> workers;
  for (int t = 0; t < args.threads; ++t) {
    workers.emplace_back([&, t] {
      bool arrived = false;
      try {
        for (int w = 0; w < args.warmup; ++w) {
          for (size_t k = 0; k < count; ++k) {
            // Compared as the timed runs are (so that what the comparison loads first is loaded here).
            double gap = against(k, run_one(k, nullptr));
            if (exact && gap != 0) throw hstu_export::Error("a warm-up run gave different outputs");
          }
        }
        synchronize(package);
        arrived = true;
        ready.arrive_and_wait();
        for (int r = 0; r < runs; ++r) {
          for (size_t k = 0; k < count; ++k) {
            hstu_export::PhaseTimes times;
            auto begin = std::chrono::steady_clock::now();
            auto again = run_one(k, args.phase_times ? &times : nullptr);
            synchronize(package);
            latencies[t][k].push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - begin).count());
            if (args.phase_times) phases[k].push_back(times);
            gaps[t] = std::max(gaps[t], against(k, again));
            if (exact && gaps[t] != 0) throw hstu_export::Error("a repeated run gave different outputs");
          }
        }
      } catch (const std::exception& exc) {
        if (!arrived) ready.count_down();
        failures[t] = exc.what();
      }
    });
  }
  ready.arrive_and_wait();
  auto started = std::chrono::steady_clock::now();
  for (auto& worker : workers) worker.join();
  double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  for (int t = 0; t < args.threads; ++t) {
    if (!failures[t].empty()) throw hstu_export::Error("thread " + std::to_string(t) + ": " + failures[t]);
  }
  auto percentiles = [](std::vector<double> values) {
    std::sort(values.begin(), values.end());
    size_t p99 = std::min(values.size() - 1, static_cast<size_t>(0.99 * static_cast<double>(values.size())));
    return std::pair<double, double>(values[values.size() / 2], values[p99]);
  };
  std::vector<double> all;
  std::vector<std::vector<double>> each(count);  // by request
  for (const auto& thread : latencies) {
    for (size_t k = 0; k < count; ++k) {
      all.insert(all.end(), thread[k].begin(), thread[k].end());
      each[k].insert(each[k].end(), thread[k].begin(), thread[k].end());
    }
  }
  if (!args.latency_log.empty()) {
    std::ofstream log(args.latency_log);
    log << "thread pass request ms\n";
    for (int t = 0; t < args.threads; ++t) {
      for (size_t k = 0; k < count; ++k) {
        for (size_t r = 0; r < latencies[t][k].size(); ++r) log << t << ' ' << r << ' ' << k + 1 << ' ' << latencies[t][k][r] << '\n';
      }
    }
    if (!log) throw hstu_export::Error("cannot write the latency log " + args.latency_log);
  }
  auto [p50, p99] = percentiles(all);
  double gap = *std::max_element(gaps.begin(), gaps.end());
  if (args.quiet) return;
  std::printf("latency over %zu runs on %d thread(s): p50 %.3f ms, p99 %.3f ms, %.1f requests/s; ", all.size(),
              args.threads, p50, p99, static_cast<double>(all.size()) / wall);
  if (exact && args.follow >= 0) {
    std::printf("every output equal to its version's first bit for bit\n");
  } else if (exact) {
    std::printf("all outputs equal\n");
  } else if (gap == 0) {
    std::printf("outputs equal to the first pass's bit for bit\n");
  } else {
    std::printf("largest difference from the first pass: %.3g\n", gap);
  }
  for (size_t k = 0; count > 1 && k < count; ++k) {
    auto [one_p50, one_p99] = percentiles(each[k]);
    std::printf("  request %zu: p50 %.3f ms, p99 %.3f ms\n", k + 1, one_p50, one_p99);
  }
  for (size_t k = 0; args.phase_times && k < count; ++k) {
    auto median = [&](double hstu_export::PhaseTimes::*field) {
      std::vector<double> values;
      for (const auto& times : phases[k]) values.push_back(times.*field);
      return percentiles(values).first;
    };
    bool inside = std::any_of(phases[k].begin(), phases[k].end(), [](const auto& t) { return t.sparse_in_dense; });
    char sparse[96];
    if (inside) {
      std::snprintf(sparse, sizeof sparse, " (the sparse half runs in the dense half's graph)");
    } else {
      std::snprintf(sparse, sizeof sparse, " and the sparse half %.3f ms", median(&hstu_export::PhaseTimes::sparse_ms));
    }
    std::printf("  request %zu phases (device synchronised between them), p50: before the dense half %.3f ms, dense "
                "half %.3f ms, after it %.3f ms; the dense half's launch returned after %.3f ms; before the dense "
                "half, the request to the device %.3f ms%s\n",
                k + 1, median(&hstu_export::PhaseTimes::before_dense_ms), median(&hstu_export::PhaseTimes::dense_ms),
                median(&hstu_export::PhaseTimes::after_dense_ms), median(&hstu_export::PhaseTimes::dense_launch_ms),
                median(&hstu_export::PhaseTimes::to_device_ms), sparse);
  }
}

// "<kind>: N replays, N graphs captured, N run as they are", and captures that failed, graphs copying in.
std::string graphs_line(const std::string& kind, const hstu_export::GraphCounts& g) {
  char line[320];
  std::snprintf(line, sizeof line, "%s: %lld replays, %lld graphs captured, %lld run as they are", kind.c_str(),
                static_cast<long long>(g.replays), static_cast<long long>(g.captures), static_cast<long long>(g.eager));
  std::string out = line;
  if (g.refused > 0) {
    std::snprintf(line, sizeof line, " (%lld captures failed)", static_cast<long long>(g.refused));
    out += line;
  }
  if (g.copying > 0) {
    std::snprintf(line, sizeof line, " (%lld graphs copy the requests in themselves; %lld of %lld copies repointed)",
                  static_cast<long long>(g.copying), static_cast<long long>(g.repointed), static_cast<long long>(g.copies));
    out += line;
  }
  return out;
}

std::string stats_line(const hstu_export::CachedRanker& ranker) {
  hstu_export::KVCacheStats s = ranker.stats();
  char line[320];
  std::snprintf(line, sizeof line,
                "kv cache: %lld hits, %lld misses, %lld stale, %lld evictions, %lld bypassed; %lld users in "
                "%lld of %lld pages (%.1f MiB)",
                static_cast<long long>(s.hits), static_cast<long long>(s.misses), static_cast<long long>(s.stale),
                static_cast<long long>(s.evictions), static_cast<long long>(s.bypassed), static_cast<long long>(s.users),
                static_cast<long long>(s.pages_used), static_cast<long long>(s.pages),
                static_cast<double>(ranker.bytes()) / (1 << 20));
  std::string out = line;
  if (ranker.bucketed()) out += "; " + graphs_line(ranker.derived() ? "exact shapes" : "shape buckets", ranker.graph_counts());
  if (int64_t padded = ranker.padded_calls(); padded >= 0) out += "; a padding user in " + std::to_string(padded) + " calls";
  if (hstu_export::HeldRowCounts held = ranker.held_rows(); held.on) {
    out += "; held rows: " + std::to_string(held.taken) + " taken from the device, " + std::to_string(held.sent) + " sent";
  }
  return out;
}

// The version that gave a thread's last --follow answer (read by the comparison that follows it on that thread).
thread_local int64_t answered_by = 0;

int serve(const Args& args) {
  std::shared_ptr<hstu_export::PublishedPackage> published;
  std::shared_ptr<const hstu_export::Package> package;
  if (args.follow >= 0) {
    published = hstu_export::PublishedPackage::open(args.package, args.options, args.follow);
    package = published->package();
    if (!args.quiet) std::printf("serving version %lld of %s\n", static_cast<long long>(published->version()), args.package.c_str());
    std::fflush(stdout);
  } else {
    package = hstu_export::Package::open(args.package, args.options);
  }
  std::shared_ptr<hstu_export::CachedRanker> ranker;
  if (args.kv) ranker = hstu_export::CachedRanker::open(package, args.kv_options);
  std::vector<hstu_export::Tensors> requests;
  for (const auto& directory : args.requests) requests.push_back(hstu_export::load_tensor_dir(directory));
  std::mutex versions_mutex;
  std::map<int64_t, hstu_export::NamedTensors> version_answers;  // --follow: each version's first answer
  std::map<int64_t, int64_t> version_runs;
  auto run_one = [&](size_t k, hstu_export::PhaseTimes* times) {
    if (published) {
      hstu_export::NamedTensors out = published->run(requests[k], times, &answered_by);
      std::lock_guard<std::mutex> lock(versions_mutex);
      version_answers.try_emplace(answered_by, out);
      version_runs[answered_by] += 1;
      return out;
    }
    return ranker ? ranker->run(requests[k], args.user_ids[k], times) : package->run(requests[k], times);
  };
  std::vector<hstu_export::NamedTensors> outputs;
  Compare against = [&](size_t k, const hstu_export::NamedTensors& out) {
    if (!published) return difference(out, outputs[k]);
    std::lock_guard<std::mutex> lock(versions_mutex);
    return difference(out, version_answers.at(answered_by));
  };
  for (size_t k = 0; k < requests.size(); ++k) {
    int64_t batch_size = package->validate(requests[k]);
    outputs.push_back(run_one(k, nullptr));
    synchronize(*package);
    if (args.quiet) continue;
    if (requests.size() > 1) std::printf("request %zu (%s): ", k + 1, args.requests[k].c_str());
    const bool prechecked = !package->sparse_model().empty() && package->sparse_model() != "model";
    std::printf("%s: %s package on %s, batch of %lld users%s%s\n", args.package.c_str(), package->backend().c_str(),
                package->device().str().c_str(), static_cast<long long>(batch_size), ranker ? ", KV-cached" : "",
                prechecked ? ", sparse half prechecked on the host" : "");
    print_outputs(outputs[k]);
  }
  if (ranker && !args.quiet) std::printf("%s\n", stats_line(*ranker).c_str());
  if (args.repeat > 0 || args.threads > 1) {
    // Served again, cached answers may differ from the first pass's in the last bits (a prefill and a
    // hit sum in another order on the GPU); without a cache every run must be equal.
    repeat(args, *package, requests.size(), run_one, against, /*exact=*/!ranker);
    if (ranker && !args.quiet) std::printf("%s\n", stats_line(*ranker).c_str());
  }
  if (!ranker && !published && package->graphed() && !args.quiet) {
    std::printf("whole-request graphs, %s\n", graphs_line("exact shapes", package->graph_counts()).c_str());
  }
  if (published && !args.quiet) {
    std::string line = "versions served:";
    for (const auto& [version, runs] : version_runs) {
      line += (version == version_runs.begin()->first ? " " : ", ") + std::to_string(version) + " (" +
              std::to_string(runs) + " runs)";
    }
    std::printf("%s; %lld switch(es)\n", line.c_str(), static_cast<long long>(published->switches()));
    if (std::string error = published->last_error(); !error.empty()) std::printf("%s\n", error.c_str());
  }
  if (published && !args.out.empty()) {  // each version's first answer, to DIR/<version>
    outputs.clear();
    for (const auto& [version, answer] : version_answers) outputs.push_back(answer);
  }
  if (!args.out.empty()) {
    // Each directory is written whole or not at all (save_tensor_dir); with several, a failure also removes the
    // ones written before it when --out is this run's own.
    std::error_code ec;
    bool existed = std::filesystem::exists(args.out, ec);
    try {
      for (size_t k = 0; k < outputs.size(); ++k) {
        std::string directory = args.out;
        if (published) {
          directory = (std::filesystem::path(args.out) / std::to_string(std::next(version_answers.begin(), k)->first)).string();
        } else if (outputs.size() > 1) {
          directory = (std::filesystem::path(args.out) / std::to_string(k + 1)).string();
        }
        hstu_export::save_tensor_dir(outputs[k], directory);
      }
    } catch (...) {
      if (!existed && !ec) std::filesystem::remove_all(args.out, ec);
      throw;
    }
    if (!args.quiet && published) {
      std::printf("wrote the first answer of %zu version(s) to %s/<version>\n", outputs.size(), args.out.c_str());
    } else if (!args.quiet) {
      std::printf("wrote the outputs of %zu request(s) to %s\n", outputs.size(), args.out.c_str());
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args args = parse(argc, argv);
  try {
    return serve(args);
  } catch (const hstu_export::Error& exc) {
    std::cerr << "hstu-export-run: error: " << exc.what() << "\n";
    return 1;
  } catch (const std::exception& exc) {
    std::string text = exc.what();
    std::cerr << "hstu-export-run: internal error: " << text.substr(0, text.find('\n')) << "\n";
    return 1;
  }
}
