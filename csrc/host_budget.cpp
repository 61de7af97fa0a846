// Layout of the segment: a header (budget) and one slot per process (pid, its start
// time and pid namespace, bytes it holds). Every access is under flock() on the
// segment, which the kernel drops when a process dies, so no crash leaves it locked.
// A slot whose process is gone (kill(pid, 0) says ESRCH, or the pid now belongs to a
// process started at another time) is freed when the budget would otherwise be short.
//
// The name may belong to someone else's file: it is opened without following a symlink,
// and used (or removed by unlink) only if it is a regular file of the segment's size with
// its magic. A new segment is written under a temporary name and link()ed into place, so
// an existing file is never replaced and no process ever sees a half-made segment.
#include "host_budget.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <sstream>

#include "errors.h"

namespace kvc {

constexpr uint64_t kMagic = 0x314755424356564bULL;  // "KVVCBUG1"
constexpr uint32_t kVersion = 1;
constexpr int kSlots = 256;

struct BudgetSlot {
  int32_t pid;
  uint32_t pad;
  uint64_t start_time;  // /proc/<pid>/stat field 22, 0 if unknown
  uint64_t pid_ns;      // inode of /proc/self/ns/pid, 0 if unknown
  uint64_t used;
};

struct BudgetSegment {
  uint64_t magic;
  uint32_t version;
  uint32_t num_slots;
  uint64_t budget;
  BudgetSlot slots[kSlots];
};

namespace {

std::string sys_error(const std::string& call, int err) {
  return call + " failed: " + std::strerror(err) + " (" + std::to_string(err) + ")";
}

uint64_t start_time_of(int pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string s((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  size_t close = s.rfind(')');  // the command name may hold spaces and parentheses
  if (close == std::string::npos) return 0;
  std::istringstream in(s.substr(close + 1));
  std::string field;
  // fields after the name start at 3 (state); start time is field 22
  for (int i = 3; i <= 22; ++i) {
    if (!(in >> field)) return 0;
  }
  return std::strtoull(field.c_str(), nullptr, 10);
}

uint64_t own_pid_ns() {
  struct stat st;
  if (stat("/proc/self/ns/pid", &st) != 0) return 0;
  return static_cast<uint64_t>(st.st_ino);
}

size_t physical_ram() {
  return static_cast<size_t>(sysconf(_SC_PHYS_PAGES)) * static_cast<size_t>(sysconf(_SC_PAGESIZE));
}

bool slot_alive(const BudgetSlot& s, uint64_t ns) {
  if (s.pid_ns != ns) return true;  // another pid namespace: its pids mean nothing here
  if (kill(s.pid, 0) != 0 && errno == ESRCH) return false;
  uint64_t st = start_time_of(s.pid);
  return !(st && s.start_time && st != s.start_time);  // same pid, another process
}

constexpr const char* kShmDir = "/dev/shm";

// "/name" for a name that can only mean /dev/shm/name (one leading '/' is the POSIX shm form).
std::string check_name(const std::string& raw) {
  std::string n = raw;
  if (!n.empty() && n[0] == '/') n.erase(0, 1);
  bool ok = !n.empty() && n.size() <= 200;
  for (char c : n) ok = ok && (std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' || c == '.');
  if (!ok || n == "." || n.find("..") != std::string::npos) {
    throw_value("host budget segment name '" + raw + "' is not valid; use 1-200 characters from A-Z a-z 0-9 _ - . "
                "without '..' (a file name in /dev/shm, not a path) (KVCACHED_HOST_SHM_NAME).");
  }
  return "/" + n;
}

[[noreturn]] void throw_foreign(const std::string& path, const std::string& why) {
  throw_state(path + " " + why + "; kvcached does not write or remove files it did not make: set "
              "KVCACHED_HOST_SHM_NAME to another name, or remove the file if nothing uses it.");
}

// The descriptor of the regular file at path, or -1 if there is none.
int open_existing(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDWR | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    int err = errno;
    if (err == ENOENT) return -1;
    if (err == ELOOP) throw_foreign(path, "is a symbolic link, not a kvcached host budget segment");
    if (err == EISDIR) throw_foreign(path, "is a directory, not a kvcached host budget segment");
    throw Error(ErrKind::Driver, sys_error("open(" + path + ")", err) +
                                     "; the host backend shares its budget through /dev/shm: check that /dev/shm is "
                                     "mounted and writable, or set KVCACHED_HOST_SHM_NAME to a segment you own.");
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw_foreign(path, "is not a regular file, so not a kvcached host budget segment");
  }
  return fd;
}

// Size and magic of the file behind fd (flock held); throws, naming what is wrong, if it is
// not a budget segment. With `layout`, another version's segment is refused too.
void check_segment(int fd, const std::string& path, bool layout) {
  struct stat st;
  if (fstat(fd, &st) != 0) throw Error(ErrKind::Driver, sys_error("fstat(" + path + ")", errno));
  if (static_cast<size_t>(st.st_size) != sizeof(BudgetSegment)) {
    throw_foreign(path, "has " + std::to_string(st.st_size) + " B, not the " + std::to_string(sizeof(BudgetSegment)) +
                            " B of this kvcached version's host budget segment");
  }
  BudgetSegment head;
  size_t head_bytes = offsetof(BudgetSegment, slots);
  if (pread(fd, &head, head_bytes, 0) != static_cast<ssize_t>(head_bytes) || head.magic != kMagic) {
    throw_foreign(path, "is not a kvcached host budget segment (no KVVCBUG1 magic)");
  }
  if (layout && (head.version != kVersion || head.num_slots != kSlots)) {
    throw_foreign(path, "is a host budget segment of another layout (another kvcached version?), not the one "
                        "this kvcached reads");
  }
}

// Makes a fresh segment at path; false if a file took the name first.
bool create_segment(const std::string& path) {
  static std::atomic<uint64_t> counter{0};
  auto seg = std::make_unique<BudgetSegment>();
  std::memset(seg.get(), 0, sizeof(BudgetSegment));
  seg->magic = kMagic;
  seg->version = kVersion;
  seg->num_slots = kSlots;
  seg->budget = physical_ram();
  std::string dir = kShmDir;
  std::string base = path.substr(dir.size() + 1);
  for (int attempt = 0;; ++attempt) {
    uint64_t salt = static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) ^
                    (counter.fetch_add(1) << 40);
    std::string tmp = dir + "/." + base + "." + std::to_string(getpid()) + "." + std::to_string(salt);
    int fd = ::open(tmp.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0) {
      if (errno == EEXIST && attempt < 8) continue;
      throw Error(ErrKind::Driver, sys_error("open(" + tmp + ")", errno) +
                                       "; the host backend shares its budget through /dev/shm: check that /dev/shm "
                                       "is mounted and writable.");
    }
    const char* p = reinterpret_cast<const char*>(seg.get());
    size_t done = 0;
    int err = 0;
    while (done < sizeof(BudgetSegment)) {
      ssize_t w = pwrite(fd, p + done, sizeof(BudgetSegment) - done, static_cast<off_t>(done));
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) {
        err = w < 0 ? errno : EIO;
        break;
      }
      done += static_cast<size_t>(w);
    }
    int rc = err ? -1 : ::link(tmp.c_str(), path.c_str());
    if (!err && rc != 0) err = errno;
    ::unlink(tmp.c_str());
    ::close(fd);
    if (rc == 0) return true;
    if (err == EEXIST) return false;
    throw Error(ErrKind::Driver, sys_error("creating " + path, err));
  }
}

std::mutex g_registry_mu;
std::map<std::string, std::weak_ptr<HostBudget>> g_registry;  // one slot per process and segment

}  // namespace

struct HostBudget::Lock {
  HostBudget& b;
  explicit Lock(HostBudget& budget) : b(budget) {
    b.mu_.lock();
    try {
      b.ensure_process_locked();
      while (flock(b.fd_, LOCK_EX) != 0) {
        if (errno != EINTR) throw Error(ErrKind::Driver, sys_error("flock(" + b.name_ + ")", errno));
      }
      try {
        b.own_slot_locked();
      } catch (...) {
        flock(b.fd_, LOCK_UN);
        throw;
      }
    } catch (...) {
      b.mu_.unlock();
      throw;
    }
  }
  ~Lock() {
    flock(b.fd_, LOCK_UN);
    b.mu_.unlock();
  }
};

std::string HostBudget::default_name(int device) {
  const char* env = std::getenv("KVCACHED_HOST_SHM_NAME");
  if (env && *env) return env;
  return "kvcached_host_" + std::to_string(getuid()) + "_" + std::to_string(device);
}

bool HostBudget::unlink(const std::string& name) {
  std::string path = kShmDir + check_name(name);
  int fd = open_existing(path);
  if (fd < 0) return false;
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  check_segment(fd, path, false);  // first unlocked: never wait on the lock of someone else's file
  while (flock(fd, LOCK_EX) != 0) {
    if (errno != EINTR) throw Error(ErrKind::Driver, sys_error("flock(" + path + ")", errno));
  }
  check_segment(fd, path, false);  // a segment of another version is still ours to remove
  // Remove the name only while it still names the file just checked.
  struct stat now, mine;
  if (lstat(path.c_str(), &now) != 0 || fstat(fd, &mine) != 0) return false;
  if (now.st_dev != mine.st_dev || now.st_ino != mine.st_ino) return false;
  return ::unlink(path.c_str()) == 0;
}

std::shared_ptr<HostBudget> HostBudget::open(const std::string& raw_name, size_t limit) {
  std::string name = check_name(raw_name);
  std::lock_guard<std::mutex> reg(g_registry_mu);
  auto it = g_registry.find(name);
  if (it != g_registry.end()) {
    if (auto b = it->second.lock()) {
      if (limit) b->set_budget(limit);
      return b;
    }
    g_registry.erase(it);
  }
  std::string path = kShmDir + name;
  int fd = -1;
  // The file may vanish between a failed create and the open (another process unlinked it).
  for (int attempt = 0; fd < 0; ++attempt) {
    fd = open_existing(path);
    if (fd >= 0) break;
    if (attempt == 8) throw Error(ErrKind::Driver, path + " kept disappearing while it was being opened; retry.");
    create_segment(path);
  }
  auto fail = [&](const std::string& msg, ErrKind kind = ErrKind::Driver) {
    flock(fd, LOCK_UN);
    ::close(fd);
    throw Error(kind, msg);
  };
  try {
    check_segment(fd, path, true);  // first unlocked: never wait on the lock of someone else's file
  } catch (const Error& e) {
    fail(e.what(), e.kind);
  }
  while (flock(fd, LOCK_EX) != 0) {
    if (errno != EINTR) fail(sys_error("flock(" + name + ")", errno));
  }
  try {
    check_segment(fd, path, true);
  } catch (const Error& e) {
    fail(e.what(), e.kind);
  }
  void* p = mmap(nullptr, sizeof(BudgetSegment), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) fail(sys_error("mmap(" + name + ")", errno));
  auto* seg = static_cast<BudgetSegment*>(p);
  flock(fd, LOCK_UN);
  std::shared_ptr<HostBudget> b(new HostBudget(name, fd, seg));
  {
    Lock lk(*b);  // claims this process's slot
    if (limit) seg->budget = limit;
  }
  g_registry[name] = b;
  return b;
}

HostBudget::HostBudget(std::string name, int fd, BudgetSegment* seg) : name_(std::move(name)), fd_(fd), seg_(seg) {}

HostBudget::~HostBudget() {
  try {
    Lock lk(*this);
    BudgetSlot& s = seg_->slots[slot_];
    if (s.pid == pid_) std::memset(&s, 0, sizeof(s));
  } catch (const std::exception& e) {
    log_warning(std::string("host budget: ") + e.what());
  }
  munmap(seg_, sizeof(BudgetSegment));
  ::close(fd_);
}

void HostBudget::ensure_process_locked() {
  int pid = static_cast<int>(getpid());
  if (pid == pid_) return;
  if (pid_ != 0) {
    // A forked child shares the parent's open file description, and with it the flock:
    // open the segment again so the two processes exclude each other.
    int fd = ::open(("/proc/self/fd/" + std::to_string(fd_)).c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) throw Error(ErrKind::Driver, sys_error("reopening " + name_ + " after fork", errno));
    ::close(fd_);
    fd_ = fd;
  }
  pid_ = pid;
  slot_ = -1;
  mine_ = 0;
}

int HostBudget::claim_slot_locked() {
  for (int pass = 0; pass < 2; ++pass) {
    for (int i = 0; i < kSlots; ++i) {
      BudgetSlot& s = seg_->slots[i];
      if (s.pid != 0) continue;
      s.pid = pid_;
      s.start_time = start_time_of(pid_);
      s.pid_ns = own_pid_ns();
      s.used = mine_;
      return i;
    }
    sum_locked(true);  // frees the slots of dead processes
  }
  throw Error(ErrKind::Driver, "host budget segment /dev/shm" + name_ + ": all " + std::to_string(kSlots) +
                                   " process slots are taken by live processes; stop some, or give this process "
                                   "its own KVCACHED_HOST_SHM_NAME.");
}

size_t HostBudget::sum_locked(bool reclaim) {
  uint64_t ns = reclaim ? own_pid_ns() : 0;
  size_t total = 0;
  for (int i = 0; i < kSlots; ++i) {
    BudgetSlot& s = seg_->slots[i];
    if (s.pid == 0) continue;
    if (reclaim && i != slot_ && !slot_alive(s, ns)) {
      std::memset(&s, 0, sizeof(s));
      continue;
    }
    total += s.used;
  }
  return total;
}

void HostBudget::own_slot_locked() {
  if (slot_ >= 0 && seg_->slots[slot_].pid == pid_) return;
  slot_ = claim_slot_locked();
}

void HostBudget::reserve(size_t size, const char* what) {
  Lock lk(*this);
  size_t budget = seg_->budget;
  size_t total = sum_locked(false);
  if (total + size > budget) total = sum_locked(true);
  if (total + size > budget) {
    int procs = 0;
    for (const auto& s : seg_->slots) procs += s.pid != 0 && s.used > 0;
    throw Error(ErrKind::OutOfMemory,
                std::string(what) + " failed: out of memory: " + std::to_string(size) + " B requested, " +
                    std::to_string(total) + " B of the " + std::to_string(budget) + " B host budget in use by " +
                    std::to_string(procs) + " process(es), " + std::to_string(mine_) +
                    " B by this one (budget shared through /dev/shm" + name_ +
                    "); free pages here or in the other processes, or raise host_limit_bytes / "
                    "KVCACHED_HOST_MEM_LIMIT_MB");
  }
  mine_ += size;
  seg_->slots[slot_].used = mine_;
}

void HostBudget::give_back(size_t size) noexcept {
  try {
    Lock lk(*this);
    mine_ -= std::min(mine_, size);
    seg_->slots[slot_].used = mine_;
  } catch (const std::exception& e) {
    log_warning(std::string("host budget: ") + e.what());
  }
}

void HostBudget::set_budget(size_t bytes) {
  Lock lk(*this);
  seg_->budget = bytes ? bytes : physical_ram();
}

std::pair<size_t, size_t> HostBudget::info() {
  Lock lk(*this);
  size_t budget = seg_->budget;
  size_t used = sum_locked(true);
  return {used > budget ? 0 : budget - used, budget};
}

size_t HostBudget::used_by_this_process() {
  Lock lk(*this);
  return mine_;
}

}  // namespace kvc
