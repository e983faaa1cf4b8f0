// The CPU double of the device layer (xla_ffi/device_double.h) against what
// the handlers assume of a CUDA stream: copies run in enqueue order on the
// stream's own thread, after the call returned; an event is reached once the
// work before it ran; a failed copy's error sticks (events after it and every
// later call on the stream report it); synchronising waits for everything;
// the fault hook's numbering and bad specs.
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "check.h"
#include "device_double.h"

using herring::Device;
using herring::DeviceDouble;
using herring::DeviceStatus;
using herring::test::Check;

int main() {
  DeviceDouble& d = DeviceDouble::Get();

  // Order: copy 1 (delayed 300 ms) and copy 2 write the same bytes; copy 2
  // must land last, and neither before the calls returned. The streams are
  // held while the test looks, so that no copy can run (and race the reads)
  // however slow this machine is; the release comes once the wait below has
  // started, so the wait is one in flight.
  Check(d.SetFaults("delay:host:1:300").empty(), "a delay rule is accepted");
  d.HoldStreams(true);
  Device::Stream s = d.StreamFor(0);
  std::vector<char> a(1 << 16, 'a'), b(1 << 16, 'b'), out(1 << 16, '0');
  const uint64_t copied = d.Stats().copies_to_host;
  Check(d.CopyToHost(out.data(), a.data(), a.size(), s).ok(), "copy 1 enqueued");
  Check(d.CopyToHost(out.data(), b.data(), b.size() / 2, s).ok(), "copy 2 enqueued");
  Check(out[0] == '0' && d.Stats().copies_to_host == copied,
        "nothing copied when the calls returned");
  Device::Event e = nullptr;
  Check(d.CreateEvent(&e).ok() && e != nullptr, "an event");
  bool reached = true;
  Check(d.QueryEvent(e, &reached).ok() && reached, "an event never recorded is reached");
  Check(d.RecordEvent(e, s).ok(), "recorded");
  Check(d.QueryEvent(e, &reached).ok() && !reached, "not reached behind the waiting copies");
  const uint64_t waits = d.Stats().waits_in_flight;
  std::thread release([&] {
    while (d.Stats().waits_in_flight == waits) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    d.HoldStreams(false);
  });
  Check(d.WaitAndDestroy(0, e).ok(), "the work before the event ran without error");
  release.join();
  Check(d.Stats().waits_in_flight == waits + 1, "the wait is counted as one in flight");
  Check(out[0] == 'b' && out[out.size() / 2 - 1] == 'b' && out[out.size() / 2] == 'a',
        "copy 2 landed after copy 1");
  Check(d.Stats().delayed == 1, "the delay fired once");

  // Device-bound copies are numbered apart; an event after them; destroying
  // an event whose work is pending is allowed.
  Check(d.SetFaults("delay:device:2:100").empty(), "rules reset the numbering");
  std::vector<char> back(1 << 10, 0);
  for (int i = 0; i < 3; ++i) {
    Check(d.CopyToDevice(back.data(), b.data(), back.size(), s).ok(), "copy to the device");
  }
  Device::Event pending = nullptr;
  d.CreateEvent(&pending);
  d.RecordEvent(pending, s);
  d.DestroyEvent(pending);
  Check(d.SynchronizeStream(s).ok(), "synchronise waits for the delayed copy");
  Check(back[0] == 'b' && d.Stats().delayed == 2, "the second device copy was delayed");

  // A failed copy: the event after it reports it, and every later call on
  // that stream; another stream is untouched.
  Check(d.SetFaults("fail:host:2").empty(), "a fail rule is accepted");
  Device::Stream bad = d.StreamFor(7);
  std::vector<char> x(64, 'x'), y(64, 'y'), got(64, '0');
  Check(d.CopyToHost(got.data(), x.data(), 64, bad).ok(), "copy 1 enqueued");
  Check(d.CopyToHost(got.data(), y.data(), 64, bad).ok(), "copy 2 (to fail) enqueued");
  Device::Event after = nullptr;
  d.CreateEvent(&after);
  DeviceStatus recorded = d.RecordEvent(after, bad);
  DeviceStatus waited = recorded.ok() ? d.WaitAndDestroy(7, after) : recorded;
  if (!recorded.ok()) d.DestroyEvent(after);
  Check(!waited.ok() && waited.message().find("copy 2 to the host failed") != std::string::npos,
        "the failure reaches the event after it: " + waited.message());
  Check(got[0] == 'x', "the failed copy did not run");
  Check(!d.CopyToHost(got.data(), x.data(), 64, bad).ok(), "the error sticks to the stream");
  Check(!d.SynchronizeStream(bad).ok(), "synchronising reports it");
  Check(d.CopyToHost(got.data(), x.data(), 64, s).ok() && d.SynchronizeStream(s).ok(),
        "another stream is untouched");
  int device = -1;
  Check(d.StreamDevice(bad, &device).ok() && device == 7, "a stream knows its device");

  // Staging from the pool.
  size_t capacity = 0;
  void* staging = d.AcquireStaging(1000, &capacity);
  Check(staging != nullptr && capacity >= 1000, "staging memory");
  std::memset(staging, 1, 1000);
  d.ReleaseStaging(staging, capacity);

  for (const char* spec : {"delay:host:1", "fail:gpu:1", "kill:host:0", "stall:host:1",
                           "fail:host:1:5", "delay:host:x:5"}) {
    Check(d.SetFaults(spec).find("KIND:WAY:N") != std::string::npos,
          std::string("refused: ") + spec);
  }
  Check(d.SetFaults("").empty(), "no rules");
  return herring::test::Finish("DEVICE_DOUBLE");
}
