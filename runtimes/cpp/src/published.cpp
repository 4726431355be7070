// PublishedPackage: a directory hstu-export publish writes, served while `current` moves (runtime.h). The C++
// counterpart of hstu_export/serving/published.py's PublishedPredictor.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <mutex>
#include <thread>
#include <tuple>

#include "package_impl.h"

namespace hstu_export {

namespace {

bool same_features(const std::vector<Feature>& a, const std::vector<Feature>& b) {
  auto key = [](const Feature& f) {
    return std::tie(f.name, f.dtype, f.kind, f.jagged_by, f.same_as, f.min_value, f.max_value, f.trailing);
  };
  return std::equal(a.begin(), a.end(), b.begin(), b.end(),
                    [&](const Feature& x, const Feature& y) { return key(x) == key(y); });
}

// What keeps `next` from taking `served`'s requests and answering them alike ("" when nothing).
std::string differences(const Package& next, const Package& served) {
  std::string out;
  auto add = [&](bool differ, const char* what) {
    if (differ) out += (out.empty() ? "" : " and ") + std::string(what);
  };
  add(!same_features(next.features(), served.features()), "input features");
  add(next.max_batch_size() != served.max_batch_size(), "maximum batch size");
  add(next.output_names() != served.output_names(), "output names");
  add(next.device() != served.device(), "device");
  return out;
}

}  // namespace

struct PublishedPackage::Impl {
  std::string root;
  Options options;
  std::chrono::duration<double> check_every;

  mutable std::mutex mutex;
  std::shared_ptr<const Package> served;
  int64_t version = 0;
  std::chrono::steady_clock::time_point checked;
  std::optional<int64_t> loading;   // the version a thread is opening
  std::optional<int64_t> given_up;  // a version not served (last_error), until current names another
  std::string last_error;
  int64_t switches = 0;
  std::thread loader;
  std::condition_variable loaded;

  // Looks at current, `mutex` held; starts opening a version it names that is not served yet.
  void look() {
    checked = std::chrono::steady_clock::now();
    if (loading) return;
    std::optional<int64_t> latest;
    try {
      latest = detail::published_version(root);
    } catch (const Error& exc) {
      last_error = exc.what();
      return;
    }
    if (!latest) {
      last_error = root + " holds no published version any more (no 'current' link)";
      return;
    }
    if (*latest == version || latest == given_up) return;
    if (loader.joinable()) loader.join();  // the thread of an earlier switch, done (loading is unset)
    loading = latest;
    loader = std::thread([this, next = *latest] { open_version(next); });
  }

  void open_version(int64_t next) {
    std::shared_ptr<const Package> package;
    std::string error;
    try {
      package = Package::open((std::filesystem::path(root) / std::to_string(next)).string(), options);
    } catch (const std::exception& exc) {  // a damaged or removed version, or one this runtime cannot open
      error = "version " + std::to_string(next) + " of " + root + " is not served: " + detail::error_text(exc);
    }
    std::lock_guard<std::mutex> lock(mutex);
    if (std::string differ = package ? differences(*package, *served) : ""; !differ.empty()) {
      const char* verb = differ.find(" and ") == std::string::npos ? " differs" : " differ";
      error = "version " + std::to_string(next) + " of " + root + " is not served: its " + differ + verb +
              " from version " + std::to_string(version) + "'s; serve it from a new process";
    }
    if (error.empty()) {
      served = std::move(package);
      version = next;
      switches += 1;
      given_up.reset();
      last_error.clear();
    } else {
      given_up = next;
      last_error = error;
    }
    loading.reset();
    loaded.notify_all();
  }
};

PublishedPackage::PublishedPackage(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

PublishedPackage::~PublishedPackage() {
  if (impl_->loader.joinable()) impl_->loader.join();
}

std::shared_ptr<PublishedPackage> PublishedPackage::open(const std::string& root, const Options& options,
                                                         double check_seconds) {
  std::optional<int64_t> version = detail::published_version(root);
  if (!version) {
    throw PackageError(root + " holds no published versions (no 'current' link); publish a package with "
                       "`hstu-export publish PKG --to " + root + "`, or open a package directly");
  }
  if (!(check_seconds >= 0)) throw Error("check_seconds must be 0 or more");
  auto impl = std::make_unique<Impl>();
  impl->root = root;
  impl->options = options;
  impl->check_every = std::chrono::duration<double>(check_seconds);
  impl->served = Package::open((std::filesystem::path(root) / std::to_string(*version)).string(), options);
  impl->version = *version;
  impl->checked = std::chrono::steady_clock::now();
  return std::shared_ptr<PublishedPackage>(new PublishedPackage(std::move(impl)));
}

NamedTensors PublishedPackage::run(const Tensors& request, PhaseTimes* times, int64_t* version) {
  std::shared_ptr<const Package> package;
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    if (std::chrono::steady_clock::now() - impl_->checked >= impl_->check_every) impl_->look();
    package = impl_->served;
    if (version) *version = impl_->version;
  }
  return package->run(request, times);  // the version it began on, even if another is served meanwhile
}

int64_t PublishedPackage::refresh() {
  std::unique_lock<std::mutex> lock(impl_->mutex);
  impl_->look();
  impl_->loaded.wait(lock, [&] { return !impl_->loading; });
  return impl_->version;
}

std::shared_ptr<const Package> PublishedPackage::package() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->served;
}

int64_t PublishedPackage::version() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->version;
}

int64_t PublishedPackage::switches() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->switches;
}

std::string PublishedPackage::last_error() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->last_error;
}

const std::string& PublishedPackage::root() const { return impl_->root; }

}  // namespace hstu_export
