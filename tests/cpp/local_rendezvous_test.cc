// Unit test of the in-process meeting point of the local devices
// (xla_ffi/engine/local_rendezvous.h), run by tests/test_cpp_units.py under
// ThreadSanitizer and under AddressSanitizer + UBSan. Each check prints what
// failed and the test exits non-zero; the last line on success is
//   LOCAL_RENDEZVOUS_OK checks=<n>
#include "check.h"
#include "engine/local_rendezvous.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

using herring::engine::LocalArrival;
using herring::engine::LocalRendezvous;
using herring::engine::MeetingKey;
using herring::engine::Status;

namespace {

using herring::test::Check;

// Each device contributes one float; the work sums them into every output.
struct Device {
  float in = 0;
  float out = -1;
  LocalArrival Arrival() { return LocalArrival{{&in}, {&out}}; }
};

Status SumWork(const std::vector<LocalArrival>& all) {
  float sum = 0;
  for (const LocalArrival& a : all) sum += *static_cast<const float*>(a.in[0]);
  for (const LocalArrival& a : all) *static_cast<float*>(a.out[0]) = sum;
  return Status::Ok();
}

// N devices meet `rounds` times on one key, each from its own thread.
void Meet(LocalRendezvous& rv, const MeetingKey& key, int n, int rounds, float base,
          std::vector<std::string>* errors) {
  std::vector<std::thread> threads;
  for (int d = 0; d < n; ++d) {
    threads.emplace_back([&, d] {
      for (int r = 0; r < rounds; ++r) {
        Device dev;
        dev.in = base + d + 100.0f * r;
        Status s = rv.Arrive(key, d, n, dev.Arrival(), 10.0, SumWork);
        float want = 0;
        for (int e = 0; e < n; ++e) want += base + e + 100.0f * r;
        if (!s.ok() || dev.out != want) {
          errors->push_back("device " + std::to_string(d) + " round " + std::to_string(r) +
                            ": " + (s.ok() ? "wrong sum" : s.message()));
        }
      }
    });
  }
  for (auto& t : threads) t.join();
}

// The crash of issue 14: two computations group the same 4 devices
// differently (two groups of 2, then one of 4) with the same site-free
// description. Keyed by run and instruction, both complete, in either order, and
// interleaved with each other.
void TestDifferentGroupings() {
  LocalRendezvous rv;
  std::vector<std::string> errors;
  for (int run = 1; run <= 6; ++run) {
    std::thread a([&] { Meet(rv, {run, 1, "0:0,"}, 2, 1, 1, &errors); });
    std::thread b([&] { Meet(rv, {run, 1, "1:0,"}, 2, 1, 5, &errors); });
    std::thread c([&] { Meet(rv, {run + 1000, 2, "0:0,"}, 4, 1, 9, &errors); });
    a.join();
    b.join();
    c.join();
  }
  for (const auto& e : errors) Check(false, "different groupings: " + e);
  Check(rv.PendingForTesting() == 0, "different groupings: state left behind");
}

// One call site in a loop: several calls per device in one run.
void TestLoopInOneRun() {
  LocalRendezvous rv;
  std::vector<std::string> errors;
  Meet(rv, {7, 3, "0:0,"}, 3, 50, 2, &errors);
  for (const auto& e : errors) Check(false, "loop: " + e);
  Check(rv.PendingForTesting() == 0, "loop: state left behind");
}

// Two executions of the same computation at once (dispatched without
// waiting): different run ids never pair.
void TestConcurrentRuns() {
  LocalRendezvous rv;
  std::vector<std::string> errors;
  std::vector<std::thread> runs;
  for (int run = 0; run < 8; ++run) {
    runs.emplace_back([&, run] { Meet(rv, {100 + run, 4, "0:0,"}, 4, 5, run * 10.0f, &errors); });
  }
  for (auto& t : runs) t.join();
  for (const auto& e : errors) Check(false, "concurrent runs: " + e);
  Check(rv.PendingForTesting() == 0, "concurrent runs: state left behind");
}

// A device that times out withdraws its buffers; the one that comes late gets
// an error, the work never runs, and nothing writes the timed-out buffers.
void TestTimeoutWithdraws() {
  LocalRendezvous rv;
  std::atomic<int> work_runs{0};
  auto work = [&](const std::vector<LocalArrival>& all) {
    ++work_runs;
    return SumWork(all);
  };
  MeetingKey key{42, 9, "0:0,"};
  Device early;
  early.in = 1;
  Status s0 = rv.Arrive(key, 0, 2, early.Arrival(), 0.05, work);
  Check(!s0.ok() && s0.message().find("timed out") != std::string::npos,
        "timeout: the waiting device must time out, got: " + s0.message());
  Device late;
  late.in = 2;
  Status s1 = rv.Arrive(key, 1, 2, late.Arrival(), 0.05, work);
  Check(!s1.ok() && s1.message().find("gave up") != std::string::npos,
        "timeout: the late device must be told, got: " + s1.message());
  Check(work_runs == 0, "timeout: the work ran on a withdrawn buffer");
  Check(early.out == -1 && late.out == -1, "timeout: an output was written");
  Check(rv.PendingForTesting() == 0, "timeout: state left behind");
  // The same instruction in the next run works again.
  std::vector<std::string> errors;
  Meet(rv, {43, 9, "0:0,"}, 2, 2, 0, &errors);
  for (const auto& e : errors) Check(false, "after timeout: " + e);
  Check(rv.PendingForTesting() == 0, "after timeout: state left behind");
}

// Several devices wait; one times out first: the others are released with an
// error at once (not after their own timeout) and the last never does work.
void TestAbandonReleasesWaiters() {
  LocalRendezvous rv;
  MeetingKey key{50, 1, "0:0,"};
  std::atomic<int> work_runs{0};
  auto work = [&](const std::vector<LocalArrival>& all) {
    ++work_runs;
    return SumWork(all);
  };
  Device a, b, c;
  Status sa, sb;
  std::thread ta([&] { sa = rv.Arrive(key, 0, 3, a.Arrival(), 0.05, work); });
  std::thread tb([&] { sb = rv.Arrive(key, 1, 3, b.Arrival(), 30.0, work); });
  ta.join();
  tb.join();  // returns long before its 30 s: released by a's abandonment
  Status sc = rv.Arrive(key, 2, 3, c.Arrival(), 30.0, work);
  Check(!sa.ok() && !sb.ok() && !sc.ok(), "abandon: every participant must fail");
  Check(work_runs == 0, "abandon: the work ran");
  Check(a.out == -1 && b.out == -1 && c.out == -1, "abandon: an output was written");
  Check(rv.PendingForTesting() == 0, "abandon: state left behind");
}

void TestBadArguments() {
  LocalRendezvous rv;
  Device d;
  Check(!rv.Arrive({1, 1, "g"}, 2, 2, d.Arrival(), 0.01, SumWork).ok(), "position out of range");
  Check(!rv.Arrive({1, 1, "g"}, -1, 2, d.Arrival(), 0.01, SumWork).ok(), "negative position");
  Check(rv.PendingForTesting() == 0, "bad arguments: state left behind");
}

}  // namespace

int main() {
  TestDifferentGroupings();
  TestLoopInOneRun();
  TestConcurrentRuns();
  TestTimeoutWithdraws();
  TestAbandonReleasesWaiters();
  TestBadArguments();
  return herring::test::Finish("LOCAL_RENDEZVOUS");
}
