// The runner that herring's reductions wait on (engine/async_runner.h): a
// task is destroyed outside the runner's lock. What a task captures can take
// long to let go of (the CUDA start's task held the last reference to a
// communicator, whose destructor waits for the host's other processes) or
// hand the runner more work; under the lock the first held up every XLA
// thread handing over a task (Run), the second deadlocked.
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "../cpp/check.h"
#include "engine/async_runner.h"

namespace herring::engine {
namespace {

using test::Check;

// A one-shot flag with a bounded wait.
class Latch {
 public:
  void Set() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      set_ = true;
    }
    cv_.notify_all();
  }
  bool WaitFor(std::chrono::seconds limit) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, limit, [&] { return set_; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool set_ = false;
};

// Runs `on_destroy` when the last copy of the task that holds it goes away.
struct OnDestroy {
  std::function<void()> on_destroy;
  ~OnDestroy() { on_destroy(); }
};

// A task whose capture hands the runner a new task while it is destroyed.
void DestructorHandsOverWork() {
  auto done = std::make_shared<Latch>();
  auto released = std::make_shared<Latch>();
  {
    auto hold = std::make_shared<OnDestroy>();
    hold->on_destroy = [done] { AsyncRunner::Get().Run([done] { done->Set(); }); };
    // The task ends only once this thread has let go: the runner then holds
    // the last reference.
    AsyncRunner::Get().Run([hold, released] { released->WaitFor(std::chrono::seconds(20)); });
  }
  released->Set();
  Check(done->WaitFor(std::chrono::seconds(20)),
        "a task handed over while another task was destroyed never ran (the runner "
        "destroyed the first under its lock)");
}

// A task whose capture takes long to let go of (here: until another thread
// has handed over a task and it ran): the hand-over must not wait for it.
void SlowDestructorDoesNotHoldUpRun() {
  auto handed = std::make_shared<Latch>();
  auto destroying = std::make_shared<Latch>();
  auto released = std::make_shared<Latch>();
  {
    auto hold = std::make_shared<OnDestroy>();
    hold->on_destroy = [handed, destroying] {
      destroying->Set();
      Check(handed->WaitFor(std::chrono::seconds(20)),
            "a task handed over while another was being destroyed waited for it");
    };
    AsyncRunner::Get().Run([hold, released] { released->WaitFor(std::chrono::seconds(20)); });
  }
  released->Set();
  Check(destroying->WaitFor(std::chrono::seconds(20)), "the task was never destroyed");
  // As an XLA thread would, from outside the runner.
  AsyncRunner::Get().Run([handed] { handed->Set(); });
  Check(handed->WaitFor(std::chrono::seconds(30)), "the handed-over task never ran");
}

// Tasks that each block until all of them have started (as reductions wait
// for each other across processes) all run: one thread per task in flight.
void BlockingTasksEachGetAThread() {
  constexpr int kTasks = 16;
  auto mu = std::make_shared<std::mutex>();
  auto cv = std::make_shared<std::condition_variable>();
  auto started = std::make_shared<int>(0);
  auto finished = std::make_shared<int>(0);
  for (int i = 0; i < kTasks; ++i) {
    AsyncRunner::Get().Run([mu, cv, started, finished] {
      std::unique_lock<std::mutex> lock(*mu);
      ++*started;
      cv->notify_all();
      if (cv->wait_for(lock, std::chrono::seconds(20), [&] { return *started == kTasks; })) {
        ++*finished;
        cv->notify_all();
      }
    });
  }
  std::unique_lock<std::mutex> lock(*mu);
  Check(cv->wait_for(lock, std::chrono::seconds(30), [&] { return *finished == kTasks; }),
        "tasks that wait for each other did not all run at once (too few threads)");
}

// One task at a time, each handed over once the previous one has ended (a
// training loop's reductions): the idle threads take them, however the
// hand-overs and wake-ups interleave. The runner once counted a notified
// thread as busy even when another thread took its task first, and started a
// new thread for most tasks: hundreds a second, each living kIdleExit.
void SequentialTasksReuseThreads() {
  const size_t before = AsyncRunner::Get().ThreadsStarted();
  for (int i = 0; i < 5000; ++i) {
    auto done = std::make_shared<Latch>();
    AsyncRunner::Get().Run([done] { done->Set(); });
    // Two at once now and then: a thread that finishes its task takes the
    // one an idle thread was woken for.
    if (i % 7 == 0) AsyncRunner::Get().Run([] {});
    Check(done->WaitFor(std::chrono::seconds(20)), "a task never ran");
  }
  const size_t started = AsyncRunner::Get().ThreadsStarted() - before;
  if (started > 4) {
    std::fprintf(stderr, "5000 tasks, at most two at a time, started %zu threads\n", started);
  }
  Check(started <= 4, "the runner started a thread for tasks that idle threads could take");
}

}  // namespace
}  // namespace herring::engine

int main() {
  // A deadlock must fail the test, not hang it.
  std::thread([] {
    std::this_thread::sleep_for(std::chrono::seconds(90));
    std::fprintf(stderr, "ASYNC_RUNNER_FAILED: timed out (a deadlock in the runner)\n");
    std::_Exit(1);
  }).detach();
  herring::engine::DestructorHandsOverWork();
  herring::engine::SlowDestructorDoesNotHoldUpRun();
  herring::engine::BlockingTasksEachGetAThread();
  herring::engine::SequentialTasksReuseThreads();
  return herring::test::Finish("ASYNC_RUNNER");
}
