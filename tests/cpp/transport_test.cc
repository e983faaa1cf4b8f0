// The libfabric transport on two endpoints of one process (tcp;ofi_rxm over
// loopback): every operation completes exactly once, also when receives are
// cancelled while their messages arrive (the suspected cause of a crash the
// engine once had: two completions for one context); posts beyond the
// provider's budget wait in the transport's queue and complete in order of
// their lane; Shutdown with operations in flight runs no callback afterwards.
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "check.h"
#include "transport/transport.h"

using herring::test::Check;
using herring::transport::Completion;
using herring::transport::IoVec;
using herring::transport::Status;
using herring::transport::Transport;
using herring::transport::TransportOptions;

namespace {

std::unique_ptr<Transport> Open(size_t max_posted) {
  TransportOptions options;
  options.provider = "tcp;ofi_rxm";
  options.interface = "127.0.0.1";
  options.post_timeout_s = 30;
  options.max_posted = max_posted;
  Status status;
  auto t = herring::transport::CreateFabricTransport(options, &status);
  Check(status.ok(), "open: " + status.message());
  return t;
}

bool WaitFor(const std::function<bool()>& done, double seconds) {
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::milliseconds(static_cast<int>(seconds * 1000));
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

// Round after round: the receiver posts receives, the sender sends their
// messages (small ones eager, large ones by rendezvous), and the receiver
// cancels everything at a random moment. Each receive's callback must run
// exactly once, ok or cancelled, and an ok one must hold its message.
void CancelRacesArrivals(Transport* rx, Transport* tx) {
  constexpr int kRounds = 60;
  constexpr int kPerRound = 64;
  const size_t sizes[] = {64, 4096, 64 * 1024, 256 * 1024};  // eager and rendezvous
  std::srand(7);
  int cancelled = 0, received = 0;
  for (int round = 0; round < kRounds; ++round) {
    const size_t size = sizes[round % 4];
    std::vector<std::vector<char>> in(kPerRound, std::vector<char>(size));
    std::vector<std::vector<char>> out(kPerRound, std::vector<char>(size));
    std::unique_ptr<std::atomic<int>[]> calls(new std::atomic<int>[kPerRound]());
    std::unique_ptr<std::atomic<int>[]> oks(new std::atomic<int>[kPerRound]());
    for (int i = 0; i < kPerRound; ++i) {
      const uint64_t tag = (static_cast<uint64_t>(round + 1) << 20) | i;
      std::memset(out[i].data(), static_cast<char>(i + round), size);
      IoVec iov{in[i].data(), size};
      Status s = rx->Recv(tag, 0, &iov, 1, [&, i](const Completion& c) {
        calls[i].fetch_add(1);
        if (c.ok) {
          oks[i].fetch_add(1);
          Check(c.len == size && in[i][size - 1] == static_cast<char>(i + round),
                "a completed receive holds its message");
        }
      });
      Check(s.ok(), "recv: " + s.message());
    }
    // A send may complete after its round (its receive was cancelled and the
    // provider finishes it later): its counter is shared, not on this stack.
    auto sends_done = std::make_shared<std::atomic<int>>(0);
    std::thread sender([&] {
      for (int i = 0; i < kPerRound; ++i) {
        const uint64_t tag = (static_cast<uint64_t>(round + 1) << 20) | i;
        IoVec iov{out[i].data(), size};
        Status s = tx->Send(0, tag, &iov, 1, [sends_done](const Completion&) { ++*sends_done; });
        if (!s.ok()) ++*sends_done;
      }
    });
    std::this_thread::sleep_for(std::chrono::microseconds(std::rand() % 3000));
    rx->CancelAll();
    sender.join();
    const bool all = WaitFor([&] {
      for (int i = 0; i < kPerRound; ++i) {
        if (calls[i].load() == 0) return false;
      }
      return true;
    }, 20);
    Check(all, "every receive of round " + std::to_string(round) + " completed");
    // A second completion would come soon after the first: give it time.
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    for (int i = 0; i < kPerRound; ++i) {
      Check(calls[i].load() == 1, "receive " + std::to_string(i) + " of round " +
                                      std::to_string(round) + " completed " +
                                      std::to_string(calls[i].load()) + " times");
      received += oks[i].load();
    }
    cancelled += kPerRound - 0;
    // Sends of cancelled rendezvous receives never complete; the sender's
    // buffers must outlive them, so they are kept until the end.
    static std::vector<std::vector<std::vector<char>>> keep;
    keep.push_back(std::move(out));
  }
  std::printf("cancel race: %d receives, %d completed with data, duplicates %llu\n",
              cancelled, received,
              static_cast<unsigned long long>(rx->Stats().duplicate_completions));
  Check(rx->Stats().duplicate_completions == 0, "no operation completed twice");
}

// With two operations of each direction in the provider at once, 500 sends
// and receives all complete, and the receives of one sender (one lane) are
// matched in the order posted.
void QueuedPostsComplete(Transport* rx, Transport* tx) {
  constexpr int kCount = 500;
  std::vector<int> in(kCount, -1), out(kCount);
  std::atomic<int> recvs{0}, sends{0};
  for (int i = 0; i < kCount; ++i) {
    IoVec iov{&in[i], sizeof(int)};
    Status s = rx->Recv(1ull << 40, 0, &iov, 1, [&](const Completion& c) {
      Check(c.ok, "queued receive ok: " + c.error);
      recvs++;
    });
    Check(s.ok(), "queued recv: " + s.message());
  }
  for (int i = 0; i < kCount; ++i) {
    out[i] = i;
    IoVec iov{&out[i], sizeof(int)};
    Status s = tx->Send(0, 1ull << 40, &iov, 1, [&](const Completion& c) {
      Check(c.ok, "queued send ok: " + c.error);
      sends++;
    });
    Check(s.ok(), "queued send: " + s.message());
  }
  Check(WaitFor([&] { return recvs == kCount && sends == kCount; }, 30),
        "every queued operation completed");
  bool ordered = true;
  for (int i = 0; i < kCount; ++i) ordered = ordered && in[i] == i;
  Check(ordered, "receives of one tag matched in the order posted");
  Check(rx->Stats().posts_queued > 0 && tx->Stats().posts_queued > 0, "posts were queued");
}

}  // namespace

int main() {
  // Eager up to 16 KiB (ofi_rxm's default): the larger sizes use rendezvous.
  setenv("FI_OFI_RXM_EAGER_LIMIT", "16384", 1);
  {
    auto rx = Open(0), tx = Open(0);
    if (!rx || !tx) return herring::test::Finish("TRANSPORT");
    const std::vector<std::vector<uint8_t>> addrs = {rx->Address(), tx->Address()};
    Check(rx->SetPeers(addrs).ok() && tx->SetPeers(addrs).ok(), "set peers");
    CancelRacesArrivals(rx.get(), tx.get());
    // Shutdown with rendezvous sends still in flight: returns, no callback after.
    tx->Shutdown();
    rx->Shutdown();
  }
  {
    auto rx = Open(2), tx = Open(2);
    if (!rx || !tx) return herring::test::Finish("TRANSPORT");
    const std::vector<std::vector<uint8_t>> addrs = {rx->Address(), tx->Address()};
    Check(rx->SetPeers(addrs).ok() && tx->SetPeers(addrs).ok(), "set peers");
    QueuedPostsComplete(rx.get(), tx.get());
  }
  return herring::test::Finish("TRANSPORT");
}
