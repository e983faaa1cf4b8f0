// Unit test of the leave protocol's counts (xla_ffi/engine/leave_ledger.h),
// run by tests/test_cpp_units.py under AddressSanitizer + UBSan and
// ThreadSanitizer: a data path's threads count while a leaver's notices
// arrive, and exactly one receipt is due once every message is in. The last
// line on success is
//   LEAVE_LEDGER_OK checks=<n>
#include "check.h"
#include "engine/leave_ledger.h"

#include <atomic>
#include <string>
#include <thread>
#include <vector>

using herring::engine::LeaveLedger;
using herring::test::Check;

int main() {
  LeaveLedger ledger;
  ledger.Reset(3);

  // A peer that has not left: nothing has arrived "all", nothing is due.
  Check(!ledger.Left(1) && !ledger.AllArrived(1), "a peer still here has not left");
  Check(!ledger.TakeReceiptDue(1), "no receipt before a kLeave");

  // Rank 1 leaves having sent 3 messages here; 2 are in: its last is on its
  // way (a provider that does not order messages), no receipt yet.
  ledger.Took(1);
  ledger.Took(1);
  ledger.PeerLeft(1, /*sent_here=*/3, /*took_from_here=*/0, /*now_ns=*/5);
  Check(ledger.Left(1) && ledger.left_ns(1) == 5, "kLeave recorded");
  Check(!ledger.AllArrived(1), "2 of 3 messages in: still arriving");
  Check(!ledger.TakeReceiptDue(1), "no receipt while a message is on its way");
  ledger.Took(1);
  Check(ledger.AllArrived(1), "3 of 3 in");
  Check(ledger.TakeReceiptDue(1), "the receipt is due once all are in");
  Check(!ledger.TakeReceiptDue(1) && ledger.ReceiptSent(1), "and only once");

  // This process sent rank 2 four messages: confirmed by a receipt that
  // counts them all, not by one that counts fewer.
  for (int i = 0; i < 4; ++i) ledger.Sent(2);
  Check(!ledger.Confirmed(2), "nothing confirmed yet");
  ledger.Receipt(2, 3);
  Check(!ledger.Confirmed(2), "a receipt of 3 of 4 does not confirm");
  ledger.Receipt(2, 4);
  Check(ledger.Confirmed(2), "a receipt of 4 of 4 confirms");

  // Or by the peer's own kLeave: its count of ours is final.
  ledger.Sent(0);
  ledger.Sent(0);
  ledger.PeerLeft(0, 0, 1, 7);
  Check(!ledger.Confirmed(0), "a kLeave that took 1 of 2 does not confirm");
  ledger.PeerLeft(0, 0, 2, 8);
  Check(ledger.Confirmed(0), "a kLeave that took 2 of 2 confirms");
  // A peer sent nothing is confirmed by any receipt.
  LeaveLedger quiet;
  quiet.Reset(2);
  Check(!quiet.Confirmed(1), "no word from the peer: not confirmed");
  quiet.Receipt(1, 0);
  Check(quiet.Confirmed(1), "a receipt of 0 confirms 0 sent");
  quiet.MarkGone(1);
  quiet.MarkReleased(1);
  Check(quiet.Gone(1) && quiet.Released(1), "gone and released are kept");

  // Concurrently: receive callbacks count while the kLeave arrives and the
  // watch thread polls for the receipt; exactly one receipt is taken, and
  // only once all 10000 messages are in.
  LeaveLedger race;
  race.Reset(2);
  constexpr int kMessages = 10000;
  std::atomic<int> receipts{0};
  std::atomic<bool> early{false};
  std::atomic<bool> done{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < 2; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < kMessages / 2; ++i) {
        race.Took(1);
        if (race.Left(1) && race.TakeReceiptDue(1)) {
          if (race.took(1) < kMessages) early = true;
          ++receipts;
        }
      }
    });
  }
  threads.emplace_back([&] {
    race.PeerLeft(1, kMessages, 0, 1);
    while (!done.load()) {
      if (race.TakeReceiptDue(1)) {
        if (race.took(1) < kMessages) early = true;
        ++receipts;
      }
    }
  });
  threads[0].join();
  threads[1].join();
  done = true;
  threads[2].join();
  if (race.TakeReceiptDue(1)) ++receipts;
  Check(receipts.load() == 1, "exactly one receipt, got " + std::to_string(receipts.load()));
  Check(!early.load(), "no receipt before every message was in");

  return herring::test::Finish("LEAVE_LEDGER");
}
