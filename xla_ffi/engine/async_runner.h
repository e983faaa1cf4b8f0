// Threads of herring's own on which reductions wait, so that XLA's threads
// never do: the handler hands the blocking part of a reduction to Run() and
// returns at once with a future, and XLA goes on computing.
//
// One thread per task in flight: a reduction blocks until every process has
// contributed, and processes may start their reductions in different orders,
// so a fixed number of threads could deadlock (each process's threads all
// waiting for reductions the other has queued behind them). Idle threads are
// reused and leave after a while.
#ifndef HERRING_ENGINE_ASYNC_RUNNER_H_
#define HERRING_ENGINE_ASYNC_RUNNER_H_

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

namespace herring::engine {

class AsyncRunner {
 public:
  // The process's runner; never destroyed (tasks may outlive static teardown).
  static AsyncRunner& Get() {
    static auto* runner = new AsyncRunner();
    return *runner;
  }

  void Run(std::function<void()> task) {
    std::lock_guard<std::mutex> lock(mu_);
    tasks_.push_back(std::move(task));
    // Every queued task needs a thread of its own (see above): a waiting one
    // for each, else a new one. `idle_` counts the threads inside the wait
    // exactly, so a notified thread whose task another one took first (a
    // thread that had just finished its own) still counts as idle. (Counting
    // a notified thread out at once undercounted the idle ones after every
    // such steal: a new thread per reduction, hundreds a second, each living
    // kIdleExit.)
    if (tasks_.size() <= idle_) {
      cv_.notify_one();
      return;
    }
    ++started_;
    std::thread([this] { Loop(); }).detach();
  }

  // Threads started so far (tests).
  size_t ThreadsStarted() {
    std::lock_guard<std::mutex> lock(mu_);
    return started_;
  }

 private:
  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      while (!tasks_.empty()) {
        std::function<void()> task = std::move(tasks_.front());
        tasks_.pop_front();
        lock.unlock();
        task();
        // Destroyed here, outside the lock: what a task holds may take long to
        // let go of (the last reference to a communicator, whose destructor
        // waits for the host's other processes), or may call Run itself. Under
        // the lock it would hold up every XLA thread that hands over a task,
        // or deadlock.
        task = nullptr;
        lock.lock();
      }
      ++idle_;
      const bool woken = cv_.wait_for(lock, kIdleExit, [&] { return !tasks_.empty(); });
      --idle_;
      if (!woken) return;
    }
  }

  static constexpr std::chrono::seconds kIdleExit{30};
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  size_t idle_ = 0;     // threads inside the wait for a task
  size_t started_ = 0;  // threads started
};

}  // namespace herring::engine

#endif  // HERRING_ENGINE_ASYNC_RUNNER_H_
