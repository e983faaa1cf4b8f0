#include "engine/cross_memory.h"

#include <sys/prctl.h>
#include <sys/uio.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

namespace herring::engine {

bool ProcessExited(int64_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return true;
  // "pid (comm) state ...": comm may hold spaces and parentheses, the state
  // follows the last ')'.
  const size_t close = line.rfind(')');
  if (close == std::string::npos || close + 2 >= line.size()) return false;
  const char state = line[close + 2];
  if (state == 'Z' || state == 'X') return true;
  // Killed and still tearing its threads down: its memory is already gone
  // (process_vm_readv says ESRCH) while the state is not yet 'Z'. The 23rd
  // field, vsize, is then 0.
  std::istringstream fields(line.substr(close + 2));
  std::string field;
  for (int i = 0; i <= 20 && (fields >> field); ++i) {
  }
  return !fields.fail() && field == "0";
}

Status ReadProcessMemory(int64_t pid, uint64_t remote, void* local, size_t len) {
  size_t done = 0;
  while (done < len) {
    struct iovec to = {static_cast<char*>(local) + done, len - done};
    struct iovec from = {reinterpret_cast<void*>(remote + done), len - done};
    const ssize_t got = process_vm_readv(static_cast<pid_t>(pid), &to, 1, &from, 1, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      const int err = got < 0 ? errno : EFAULT;
      return Status::Error("reading " + std::to_string(len) + " bytes of process " +
                           std::to_string(pid) + "'s memory failed after " +
                           std::to_string(done) + ": " + std::strerror(err) +
                           (err == ESRCH ? " (the process has exited)" : ""));
    }
    done += static_cast<size_t>(got);  // partial: the rest lies on a later page
  }
  return Status::Ok();
}

std::string SetPtracer(int64_t tracer) {
#ifdef PR_SET_PTRACER
  const unsigned long arg = tracer == kPtracerAny ? PR_SET_PTRACER_ANY
                                                  : static_cast<unsigned long>(tracer);
  if (prctl(PR_SET_PTRACER, arg, 0, 0, 0) != 0) {
    return std::string("prctl(PR_SET_PTRACER, ") + std::to_string(tracer) +
           ") failed: " + std::strerror(errno);
  }
  return "";
#else
  return "this build's kernel headers have no PR_SET_PTRACER";
#endif
}

}  // namespace herring::engine
