// The host backend's physical budget, shared by every process of one host "device"
// through a small POSIX shared-memory segment (see docs/native.md, "Shared host budget").
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

namespace kvc {

struct BudgetSegment;  // the layout in /dev/shm (host_budget.cpp)

class HostBudget {
 public:
  // Opens (creating if needed) the segment `name` and takes a slot for this process; refuses,
  // never touching it, a file of that name that is not a budget segment of this version.
  // limit > 0 becomes the budget; 0 keeps the segment's budget (physical RAM when new).
  static std::shared_ptr<HostBudget> open(const std::string& name, size_t limit);
  // KVCACHED_HOST_SHM_NAME, else "kvcached_host_<uid>_<device>".
  static std::string default_name(int device);
  // Removes the segment's name (processes that have it open keep using it); false if there is
  // none. Throws, removing nothing, if the file of that name is not a budget segment.
  static bool unlink(const std::string& name);

  ~HostBudget();
  HostBudget(const HostBudget&) = delete;
  HostBudget& operator=(const HostBudget&) = delete;

  // Counts `size` bytes against the budget for this process; OutOfMemory when all
  // live processes together would exceed it. `what` names the caller in the message.
  void reserve(size_t size, const char* what);
  void give_back(size_t size) noexcept;
  void set_budget(size_t bytes);
  // (budget - bytes used by every live process, budget); dead processes' slots are freed.
  std::pair<size_t, size_t> info();
  size_t used_by_this_process();
  const std::string& name() const { return name_; }

 private:
  HostBudget(std::string name, int fd, BudgetSegment* seg);
  struct Lock;
  void ensure_process_locked();  // after fork(): own descriptor, own slot
  size_t sum_locked(bool reclaim);
  int claim_slot_locked();
  void own_slot_locked();  // (re)claims this process's slot if it has none

  std::string name_;
  int fd_;
  BudgetSegment* seg_;
  int pid_ = 0;
  int slot_ = -1;
  size_t mine_ = 0;  // bytes this process holds (the slot's copy can be rewritten from it)
  std::mutex mu_;  // flock() does not exclude threads sharing one descriptor
};

}  // namespace kvc
