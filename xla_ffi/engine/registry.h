// Process-wide table of communicators. Python holds an integer handle and
// passes it to the custom call as an attribute; handlers look it up here.
#ifndef HERRING_ENGINE_REGISTRY_H_
#define HERRING_ENGINE_REGISTRY_H_

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>

#include "engine/communicator.h"

namespace herring::engine {

class Registry {
 public:
  static Registry& Get() {
    static Registry* registry = new Registry();  // never destroyed: handlers may run late
    return *registry;
  }
  int64_t Add(std::shared_ptr<Communicator> comm) {
    std::lock_guard<std::mutex> lock(mu_);
    int64_t handle = next_++;
    comms_[handle] = std::move(comm);
    return handle;
  }
  std::shared_ptr<Communicator> Find(int64_t handle) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = comms_.find(handle);
    return it == comms_.end() ? nullptr : it->second;
  }
  // The communicator is destroyed once the last in-flight call lets go:
  // here, outside the lock, when none is in flight (its destructor may wait
  // for the host's other processes, see Communicator::DrainLingering).
  bool Remove(int64_t handle) {
    std::shared_ptr<Communicator> removed;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = comms_.find(handle);
      if (it == comms_.end()) return false;
      removed = std::move(it->second);
      comms_.erase(it);
    }
    return true;
  }

 private:
  std::mutex mu_;
  std::map<int64_t, std::shared_ptr<Communicator>> comms_;
  int64_t next_ = 1;
};

}  // namespace herring::engine

#endif  // HERRING_ENGINE_REGISTRY_H_
