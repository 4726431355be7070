// hstu-export-run: open a package with the C++ runtime, run one request directory, print (and write) the
// outputs. Also a smoke test for serving: --repeat times it, --threads runs it from several threads at
// once and checks every thread got the same outputs bit for bit.
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "hstu_export/runtime.h"

namespace {

constexpr const char* kUsage =
    "usage: hstu-export-run PACKAGE REQUEST_DIR [--out DIR] [--op-library-dir DIR]... [--no-verify-checksums]\n"
    "                       [--repeat N] [--warmup N] [--threads N] [--quiet]\n"
    "\n"
    "Open an hstu-export package (aoti or torchscript) with the C++ runtime, validate the request in\n"
    "REQUEST_DIR (one <feature>.pt per feature: `hstu-export request PACKAGE --out DIR` writes one),\n"
    "run it and print the outputs.\n"
    "\n"
    "  --out DIR              write the outputs there, one <output>.pt each (torch.load reads them)\n"
    "  --op-library-dir DIR   where op libraries such as fbgemm_gpu_py.so are (repeatable; also\n"
    "                         $HSTU_EXPORT_OP_LIBRARY_PATH, ':'-separated, and the build's defaults)\n"
    "  --no-verify-checksums  skip the per-file sha256 check (manifest.sha256 is still checked)\n"
    "  --repeat N             run N more times and print the latency (median and p99, ms)\n"
    "  --warmup N             before those, N runs that are not timed (TorchScript optimises its graph on\n"
    "                         the first runs; compare warm latencies)\n"
    "  --threads N            run from N threads at once (with --repeat: N each); outputs must all be equal\n"
    "  --quiet                print nothing but errors\n";

struct Args {
  std::string package, request, out;
  hstu_export::Options options;
  int repeat = 0;
  int warmup = 0;
  int threads = 1;
  bool quiet = false;
};

[[noreturn]] void usage_error(const std::string& what) {
  std::cerr << "hstu-export-run: error: " << what << " (see hstu-export-run --help)\n";
  std::exit(2);
}

int positive(const std::string& flag, const std::string& text) {
  try {
    size_t used = 0;
    int value = std::stoi(text, &used);
    if (used == text.size() && value >= 1) return value;
  } catch (const std::exception&) {
  }
  usage_error(flag + " needs a positive integer, got '" + text + "'");
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
    } else if (arg == "--repeat") {
      args.repeat = positive(arg, value());
    } else if (arg == "--warmup") {
      args.warmup = positive(arg, value());
    } else if (arg == "--threads") {
      args.threads = positive(arg, value());
    } else if (arg == "--quiet" || arg == "-q") {
      args.quiet = true;
    } else if (!arg.empty() && arg[0] == '-') {
      usage_error("unknown option " + arg);
    } else {
      positional.push_back(arg);
    }
  }
  if (positional.size() != 2) usage_error("expected PACKAGE and REQUEST_DIR");
  args.package = positional[0];
  args.request = positional[1];
  args.options.concurrency = static_cast<size_t>(args.threads);
  return args;
}

bool same(const hstu_export::NamedTensors& a, const hstu_export::NamedTensors& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].first != b[i].first || !a[i].second.equal(b[i].second)) return false;
  }
  return true;
}

void synchronize(const hstu_export::Package& package) {
  if (package.device().is_cuda()) torch::cuda::synchronize();
}

}  // namespace

int main(int argc, char** argv) {
  Args args = parse(argc, argv);
  try {
    auto package = hstu_export::Package::open(args.package, args.options);
    hstu_export::Tensors request = hstu_export::load_tensor_dir(args.request);
    int64_t batch_size = package->validate(request);
    hstu_export::NamedTensors outputs = package->run(request);
    synchronize(*package);
    if (!args.quiet) {
      std::printf("%s: %s package on %s, batch of %lld users\n", args.package.c_str(), package->backend().c_str(),
                  package->device().str().c_str(), static_cast<long long>(batch_size));
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
    if (args.repeat > 0 || args.threads > 1) {
      int runs = std::max(args.repeat, 1);
      std::vector<std::vector<double>> latencies(args.threads);
      std::vector<std::string> failures(args.threads);
      std::vector<std::thread> workers;
      for (int w = 0; w < args.warmup; ++w) {
        if (!same(package->run(request), outputs)) throw hstu_export::Error("a warm-up run gave different outputs");
      }
      synchronize(*package);
      auto started = std::chrono::steady_clock::now();
      for (int t = 0; t < args.threads; ++t) {
        workers.emplace_back([&, t] {
          try {
            for (int r = 0; r < runs; ++r) {
              auto begin = std::chrono::steady_clock::now();
              auto again = package->run(request);
              synchronize(*package);
              latencies[t].push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - begin).count());
              if (!same(again, outputs)) throw hstu_export::Error("a repeated run gave different outputs");
            }
          } catch (const std::exception& exc) {
            failures[t] = exc.what();
          }
        });
      }
      for (auto& worker : workers) worker.join();
      double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
      for (int t = 0; t < args.threads; ++t) {
        if (!failures[t].empty()) throw hstu_export::Error("thread " + std::to_string(t) + ": " + failures[t]);
      }
      std::vector<double> all;
      for (const auto& each : latencies) all.insert(all.end(), each.begin(), each.end());
      std::sort(all.begin(), all.end());
      double p50 = all[all.size() / 2];
      double p99 = all[std::min(all.size() - 1, static_cast<size_t>(0.99 * static_cast<double>(all.size())))];
      if (!args.quiet) {
        std::printf("latency over %zu runs on %d thread(s): p50 %.3f ms, p99 %.3f ms, %.1f requests/s; "
                    "all outputs equal\n", all.size(), args.threads, p50, p99, static_cast<double>(all.size()) / wall);
      }
    }
    if (!args.out.empty()) {
      hstu_export::save_tensor_dir(outputs, args.out);
      if (!args.quiet) std::printf("wrote %zu outputs to %s\n", outputs.size(), args.out.c_str());
    }
  } catch (const hstu_export::Error& exc) {
    std::cerr << "hstu-export-run: error: " << exc.what() << "\n";
    return 1;
  } catch (const std::exception& exc) {
    std::string text = exc.what();
    std::cerr << "hstu-export-run: internal error: " << text.substr(0, text.find('\n')) << "\n";
    return 1;
  }
  return 0;
}
