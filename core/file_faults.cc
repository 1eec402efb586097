#include "core/file_faults.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <sys/inotify.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <thread>
#include <unistd.h>
#include <vector>

#include "absl/strings/str_cat.h"

namespace accel {
namespace {

// Registered mappings. The handler reads them without a lock (it may not
// take one), so each slot publishes its path before its range and clears its
// range first; paths are interned and never freed, so a path the handler
// read stays valid.
constexpr int kSlots = 1 << 16;
struct Slot {
  std::atomic<uintptr_t> begin{0};
  std::atomic<uintptr_t> end{0};
  std::atomic<const char*> path{nullptr};
};
Slot g_slots[kSlots];
std::mutex g_registry_mu;
int g_next_free = 0;
std::vector<int> g_free_slots;

const char* Intern(const std::string& path) {
  static std::set<std::string>* paths = new std::set<std::string>();
  return paths->insert(path).first->c_str();
}

// The first fault: 0 none, 1 being written, 2 recorded.
std::atomic<int> g_fault_state{0};
char g_fault[4096];
std::atomic<int64_t> g_sigbus_mended{0};

// Appends `s` to the buffer at `*at` (async-signal-safe).
void Append(char* buffer, size_t capacity, size_t* at, const char* s) {
  while (*s != '\0' && *at + 1 < capacity) buffer[(*at)++] = *s++;
  buffer[*at] = '\0';
}

void Record(const char* a, const char* b, const char* c) {
  int expected = 0;
  if (!g_fault_state.compare_exchange_strong(expected, 1)) return;
  size_t at = 0;
  Append(g_fault, sizeof(g_fault), &at, a);
  Append(g_fault, sizeof(g_fault), &at, b);
  Append(g_fault, sizeof(g_fault), &at, c);
  g_fault_state.store(2, std::memory_order_release);
}

struct sigaction g_previous;

void OnSigbus(int signal, siginfo_t* info, void* context) {
  const auto address = reinterpret_cast<uintptr_t>(info->si_addr);
  for (int i = 0; i < kSlots; ++i) {
    const uintptr_t begin = g_slots[i].begin.load(std::memory_order_acquire);
    if (begin == 0 || address < begin || address >= g_slots[i].end.load()) continue;
    const char* path = g_slots[i].path.load();
    const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
    void* at = reinterpret_cast<void*>(address / page * page);
    // A zero page where the file's page was: the read completes, and the
    // recorded fault makes the step that read it fail.
    if (::mmap(at, page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) ==
        MAP_FAILED) {
      break;
    }
    g_sigbus_mended.fetch_add(1);
    Record("SIGBUS reading the mapping of ", path != nullptr ? path : "a weights file",
           ": the file was truncated or rewritten while in use");
    static const char kPrefix[] = "accel: SIGBUS reading the mapping of ";
    (void)!::write(STDERR_FILENO, kPrefix, sizeof(kPrefix) - 1);
    if (path != nullptr) (void)!::write(STDERR_FILENO, path, std::strlen(path));
    static const char kSuffix[] =
        ": the file changed on disk while in use; this process's weights can no longer be "
        "trusted\n";
    (void)!::write(STDERR_FILENO, kSuffix, sizeof(kSuffix) - 1);
    return;
  }
  // Not ours: what would have happened without us.
  if ((g_previous.sa_flags & SA_SIGINFO) != 0 && g_previous.sa_sigaction != nullptr) {
    g_previous.sa_sigaction(signal, info, context);
    return;
  }
  if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN &&
      g_previous.sa_handler != nullptr) {
    g_previous.sa_handler(signal);
    return;
  }
  ::signal(SIGBUS, SIG_DFL);  // the faulting instruction runs again and dies of it
}

// ---- Changes in place (inotify) ----

struct Watched {
  dev_t dev;
  ino_t ino;
  std::string path;
};
std::mutex g_watch_mu;
std::map<uint64_t, Watched> g_watched;   // by watch id
std::map<std::string, int> g_folder_wd;  // folders watched, by path
std::map<int, std::string> g_folder_of_wd;
uint64_t g_next_watch = 1;
int g_inotify = -1;  // >= 0 once the watcher runs

std::string FolderOf(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

// Under g_watch_mu, with the watcher running.
void WatchFolder(const std::string& folder) {
  if (g_inotify < 0 || g_folder_wd.count(folder) > 0) return;
  const int wd = ::inotify_add_watch(g_inotify, folder.c_str(), IN_MODIFY);
  if (wd < 0) return;  // best effort: the SIGBUS handler still stands
  g_folder_wd[folder] = wd;
  g_folder_of_wd[wd] = folder;
}

void WatchLoop(int fd) {
  alignas(struct inotify_event) char buffer[64 * 1024];
  while (true) {
    const ssize_t n = ::read(fd, buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    for (ssize_t at = 0; at < n;) {
      const auto* event = reinterpret_cast<const struct inotify_event*>(buffer + at);
      at += static_cast<ssize_t>(sizeof(struct inotify_event) + event->len);
      if (event->len == 0 || (event->mask & IN_MODIFY) == 0) continue;
      std::string path;
      {
        std::lock_guard<std::mutex> lock(g_watch_mu);
        auto folder = g_folder_of_wd.find(event->wd);
        if (folder == g_folder_of_wd.end()) continue;
        path = folder->second + "/" + event->name;
      }
      // The name may now be another file (a replacement renamed over it):
      // only the inode this process holds counts.
      struct stat st {};
      if (::stat(path.c_str(), &st) != 0) continue;
      std::lock_guard<std::mutex> lock(g_watch_mu);
      for (const auto& [id, w] : g_watched) {
        if (w.dev == st.st_dev && w.ino == st.st_ino) {
          const std::string what = absl::StrCat(
              w.path, " was modified in place while in use (a write or truncation on disk)");
          RecordModelFileFault(what);
          break;
        }
      }
    }
  }
}

}  // namespace

WeightsFileWatch::WeightsFileWatch(int fd, const std::string& path) {
  struct stat st {};
  if (fd < 0 || ::fstat(fd, &st) != 0) return;
  std::lock_guard<std::mutex> lock(g_watch_mu);
  id_ = g_next_watch++;
  g_watched[id_] = Watched{st.st_dev, st.st_ino, path};
  WatchFolder(FolderOf(path));
}

WeightsFileWatch::~WeightsFileWatch() {
  if (id_ == 0) return;
  std::lock_guard<std::mutex> lock(g_watch_mu);
  g_watched.erase(id_);
}

WeightsFileWatch::WeightsFileWatch(WeightsFileWatch&& other) noexcept : id_(other.id_) {
  other.id_ = 0;
}

WeightsFileWatch& WeightsFileWatch::operator=(WeightsFileWatch&& other) noexcept {
  if (this != &other) {
    WeightsFileWatch gone(std::move(*this));
    id_ = other.id_;
    other.id_ = 0;
  }
  return *this;
}

void StartWeightsFileWatcher() {
  static std::once_flag once;
  std::call_once(once, [] {
    const int fd = ::inotify_init1(IN_CLOEXEC);
    if (fd < 0) return;
    {
      std::lock_guard<std::mutex> lock(g_watch_mu);
      g_inotify = fd;
      for (const auto& [id, w] : g_watched) WatchFolder(FolderOf(w.path));
    }
    std::thread(WatchLoop, fd).detach();  // for the life of the process
  });
}

MappedFileRegistration::MappedFileRegistration(const void* addr, size_t size,
                                               const std::string& path) {
  if (addr == nullptr || size == 0) return;
  std::lock_guard<std::mutex> lock(g_registry_mu);
  int slot = -1;
  if (!g_free_slots.empty()) {
    slot = g_free_slots.back();
    g_free_slots.pop_back();
  } else if (g_next_free < kSlots) {
    slot = g_next_free++;
  }
  if (slot < 0) return;  // full: the mapping is served, its faults are not mended
  g_slots[slot].path.store(Intern(path));
  g_slots[slot].end.store(reinterpret_cast<uintptr_t>(addr) + size);
  g_slots[slot].begin.store(reinterpret_cast<uintptr_t>(addr), std::memory_order_release);
  slot_ = slot;
}

MappedFileRegistration::~MappedFileRegistration() {
  if (slot_ < 0) return;
  std::lock_guard<std::mutex> lock(g_registry_mu);
  g_slots[slot_].begin.store(0);
  g_slots[slot_].end.store(0);
  g_free_slots.push_back(slot_);
}

MappedFileRegistration::MappedFileRegistration(MappedFileRegistration&& other) noexcept
    : slot_(other.slot_) {
  other.slot_ = -1;
}

MappedFileRegistration& MappedFileRegistration::operator=(MappedFileRegistration&& other) noexcept {
  if (this != &other) {
    MappedFileRegistration gone(std::move(*this));
    slot_ = other.slot_;
    other.slot_ = -1;
  }
  return *this;
}

void InstallMappedFileFaultHandler() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction action {};
    action.sa_sigaction = OnSigbus;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_SIGINFO;
    ::sigaction(SIGBUS, &action, &g_previous);
  });
}

void RecordModelFileFault(absl::string_view description) {
  char text[2048];
  const size_t n = std::min(description.size(), sizeof(text) - 1);
  std::memcpy(text, description.data(), n);
  text[n] = '\0';
  Record(text, "", "");
}

std::optional<std::string> ModelFileFault() {
  if (g_fault_state.load(std::memory_order_acquire) != 2) return std::nullopt;
  return std::string(g_fault);
}

int64_t MappedFileFaultCount() { return g_sigbus_mended.load(); }

void ResetModelFileFaultForTesting() {
  g_fault_state.store(0);
  g_sigbus_mended.store(0);
}

}  // namespace accel
