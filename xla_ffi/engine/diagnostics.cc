// Diagnostic text: what a rank waits for and what its peers said they wait
// for, for error messages and heartbeats; the communicator's description and
// counters.
#include "engine/communicator.h"

#include <cstdint>
#include <cstdio>
#include <set>
#include <string>

#include "engine/batch.h"
#include "engine/cross_memory.h"

namespace herring::engine {

namespace {

std::string RankList(const std::set<int>& ranks) {
  std::string s;
  for (int r : ranks) s += (s.empty() ? "" : ", ") + std::to_string(r);
  return "[" + s + "]";
}

// 16 KiB, 1 MiB, 100 B: a byte count as people write it.
std::string SizeText(size_t bytes) {
  if (bytes >= (1u << 20) && bytes % (1u << 20) == 0) return std::to_string(bytes >> 20) + " MiB";
  if (bytes >= (1u << 10) && bytes % (1u << 10) == 0) return std::to_string(bytes >> 10) + " KiB";
  return std::to_string(bytes) + " B";
}

// A reduction that waits this long while every rank it waits for has waited
// kMismatchPeerWaitS, alive, in its call under another compiled program,
// fails (FailMismatchedPrograms); a little longer if a peer's call site
// (its kStall, sent after a second of waiting) has not come yet.
constexpr double kMismatchFailS = 4.0;
constexpr double kMismatchPeerWaitS = 2.0;
constexpr double kMismatchSiteGraceS = 3.0;

}  // namespace

void Communicator::FailMismatchedPrograms() {
  if (!last_heard_ || config_.heartbeat_s <= 0) return;  // nothing said where peers wait
  const int64_t now = NowNs();
  std::lock_guard<std::mutex> lock(active_mu_);
  for (Batch* batch : active_) {
    if (batch->Failed() || batch->jobs.empty() || !batch->started.load()) continue;
    const double waited = (now - batch->started_ns) * 1e-9;
    if (waited < kMismatchFailS) continue;
    const Job& job = *batch->jobs.front();
    // The launch identity and the async pair's tickets name calls without
    // programs: nothing to tell there.
    if (IsLaunchRun(job.id.run_id) || IsTicketRun(job.id.run_id)) continue;
    std::set<int> missing = MissingRanks(*batch);
    missing.erase(config_.rank);
    if (missing.empty() || !InOtherPrograms(job, missing, now)) continue;
    if (!SitesKnown(missing) && waited < kMismatchFailS + kMismatchSiteGraceS) continue;
    Fail(batch, "the ranks compiled different programs around this reduction, which can "
                "never complete: " + MissingReport(*batch) + Verdict(job, missing) +
                " Most often the inputs' shapes differ (a batch of another size on one rank, "
                "a smaller last batch); every rank fails now instead of after "
                "HERRING_TIMEOUT_S=" + std::to_string(static_cast<int64_t>(config_.timeout_s)) +
                " s.");
  }
}

bool Communicator::InOtherPrograms(const Job& job, const std::set<int>& ranks,
                                   int64_t now) const {
  std::lock_guard<std::mutex> lock(peer_wait_mu_);
  for (int rank : ranks) {
    const PeerWait& peer = peer_wait_[rank];
    const bool alive = (now - last_heard_[rank].load()) * 1e-9 <= 3 * config_.heartbeat_s + 1;
    const bool same_call = peer.key == job.req.key && peer.slot == job.id.slot &&
                           peer.instance == job.id.instance;
    // XLA's run ids of one executable are a base plus its launch count: a
    // near one is the same program launched a different number of times.
    const int64_t apart = static_cast<int32_t>(static_cast<uint32_t>(peer.run_id) -
                                               static_cast<uint32_t>(job.id.run_id));
    if (!alive || peer.what.empty() || !same_call || peer.seconds < kMismatchPeerWaitS ||
        IsLaunchRun(peer.run_id) || IsTicketRun(peer.run_id) ||
        (apart > -kNearRuns && apart < kNearRuns)) {
      return false;
    }
  }
  return true;
}

std::string Communicator::OldestWait(WireHeader* h) {
  std::lock_guard<std::mutex> lock(active_mu_);
  const Batch* oldest = nullptr;
  for (const Batch* batch : active_) {
    if (oldest == nullptr || batch->started_ns < oldest->started_ns) oldest = batch;
  }
  if (oldest == nullptr) return "";
  const Job& job = *oldest->jobs.front();
  const double seconds = (NowNs() - oldest->started_ns) * 1e-9;
  if (h != nullptr) {
    h->contributors = 1;
    h->dtype = static_cast<uint8_t>(job.req.dtype);
    h->op = static_cast<uint8_t>(job.req.op);
    h->codec = static_cast<uint8_t>(job.req.codec);
    h->total_elems = job.req.count;
    h->key = job.req.key;
    SetHeaderIdentity(h, job.id);
    h->chunk = static_cast<uint32_t>(std::min(seconds, 4e9));
  }
  return DescribeJob(job) + " for " + std::to_string(static_cast<int64_t>(seconds)) + " s";
}

std::string Communicator::PeerReport(const std::set<int>& ranks) const {
  if (!last_heard_ || config_.heartbeat_s <= 0) return "";
  const int64_t now = NowNs();
  std::string report;
  std::lock_guard<std::mutex> lock(peer_wait_mu_);
  for (int rank : ranks) {
    const double silent = (now - last_heard_[rank].load()) * 1e-9;
    std::string line = "rank " + std::to_string(rank);
    // A rank of this host whose process is gone is not "alive" because its
    // last heartbeat is recent (a SIGKILL leaves one a second old).
    const bool exited = !topology_.empty() &&
                        topology_.host_of[rank] == topology_.host_of[config_.rank] &&
                        ProcessExited(topology_.pid_of[rank]);
    if (exited) {
      line += "'s process has exited";
      // What it last said it waited in still tells which call it ran (two
      // ranks timing out together: the first exits before the second reports).
      const PeerWait& wait = peer_wait_[rank];
      if (!wait.what.empty()) {
        line += "; it last waited " + std::to_string(static_cast<int64_t>(wait.seconds)) +
                " s in " + (SiteMatches(wait) ? wait.site : wait.what);
      }
    } else if (silent > 3 * config_.heartbeat_s + 1) {
      line += " has sent nothing for " + std::to_string(static_cast<int64_t>(silent)) + " s";
    } else if (peer_wait_[rank].what.empty()) {
      line += " is alive and waits in no reduction";
    } else {
      // Its kStall adds the call site, if it is about what the heartbeat
      // says it waits in now.
      const PeerWait& wait = peer_wait_[rank];
      line += " is alive and has waited " + std::to_string(static_cast<int64_t>(wait.seconds)) +
              " s in " + (SiteMatches(wait) ? wait.site : wait.what);
    }
    report += (report.empty() ? "" : "; ") + line;
  }
  return report;
}

std::string Communicator::Verdict(const Job& job, const std::set<int>& missing) const {
  std::string verdict;
  std::lock_guard<std::mutex> lock(peer_wait_mu_);
  for (int rank : missing) {
    const PeerWait& peer = peer_wait_[rank];
    if (peer.what.empty() || peer.run_id == job.id.run_id) continue;
    const std::string who = " Rank " + std::to_string(rank);
    const bool same_call = peer.key == job.req.key && peer.slot == job.id.slot &&
                           peer.instance == job.id.instance;
    const bool launch_here = IsLaunchRun(job.id.run_id);
    if (launch_here != IsLaunchRun(peer.run_id)) {
      // (An async reduction's ticket is neither: only XLA-named calls here.)
      if (same_call && !IsTicketRun(job.id.run_id) && !IsTicketRun(peer.run_id)) {
        verdict += who + " names this call by the " + (launch_here ? "program" : "launch") +
                   " identity and this rank by the " + (launch_here ? "launch" : "program") +
                   " one: HERRING_IDENTITY must be the same on every rank.";
      }
      continue;
    }
    if (launch_here) {
      // The launch identity names instructions, not programs: only the same
      // call at another launch says something.
      if (same_call && LaunchInstruction(peer.run_id) == LaunchInstruction(job.id.run_id)) {
        verdict += who + " is at launch " + std::to_string(LaunchOf(peer.run_id)) +
                   " of this reduction, this rank at launch " +
                   std::to_string(LaunchOf(job.id.run_id)) +
                   ": the processes ran this program a different number of times.";
      }
      continue;
    }
    if (same_call) {
      // XLA's run ids of one executable are a base plus its launch count;
      // two executables' bases are far apart (a hash of each).
      const int64_t apart = static_cast<int32_t>(static_cast<uint32_t>(peer.run_id) -
                                                 static_cast<uint32_t>(job.id.run_id));
      if (apart > -kNearRuns && apart < kNearRuns) {
        verdict += who + " waits in this same call " + std::to_string(apart > 0 ? apart : -apart) +
                   " launch(es) " + (apart > 0 ? "ahead" : "behind") + ": the processes ran " +
                   "this program a different number of times.";
      } else {
        verdict += who + " waits in this same call under another run id: it runs a " +
                   "different compiled program. Either the processes' inputs or code differ " +
                   "outside the reductions (a batch of another size, say), or XLA compiled " +
                   "one program into a different executable on each process (XLA:CUDA's " +
                   "autotuning does); for the latter, HERRING_IDENTITY=launch names " +
                   "reductions without XLA's run ids.";
      }
      continue;
    }
    verdict += who + " runs a different compiled program: the processes' shapes or code " +
               "differ, or they run their reducing programs in a different order.";
  }
  return verdict;
}

bool Communicator::SiteMatches(const PeerWait& wait) {
  const size_t at = wait.what.find(" (key ");
  return at != std::string::npos && wait.site.find(wait.what.substr(at)) != std::string::npos;
}

std::set<int> Communicator::MissingRanks(const Batch& batch) {
  std::set<int> missing;
  if (!batch.started.load()) return missing;
  if (batch.host) {
    // The processes of the host whose message of the awaited step is due.
    const HostWait& w = *batch.host;
    const int step = w.waiting.load();
    for (int q = 0; step >= 0 && q < w.size(); ++q) {
      if (q != w.me && !w.Got(q, step)) missing.insert(w.local[q]);
    }
    return missing;
  }
  for (const auto& job : batch.jobs) {
    for (int p = 0; p < job->n; ++p) {
      if (p == job->me) continue;
      if (job->contribs_from[p].load() < job->ContributionsFrom(p) ||
          job->results_from[p].load() < job->ResultsFrom(p)) {
        missing.insert(batch.group[p]);
      }
    }
  }
  return missing;
}

std::string Communicator::MissingReport(const Batch& batch) const {
  std::set<int> missing;
  std::string what, detail;
  if (batch.host) {
    static constexpr const char* kWhat[HostWait::kSteps] = {
        "its inputs", "its slice of the result", "word that it read this rank's slice"};
    const HostWait& w = *batch.host;
    const int step = w.waiting.load();
    missing = MissingRanks(batch);
    if (missing.empty()) {
      // Every step was posted, yet reading a peer's slice can fail: once
      // that peer's process has exited (SIGKILL), "none is missing" would
      // contradict the error that names it.
      const std::string exited = ExitedHostPeers(w);
      if (!exited.empty()) {
        return "in the host stage of " + DescribeJob(*batch.jobs.front()) + ": " +
               exited.substr(2) + ".";
      }
      return "no process of this host is missing in the host stage of " +
             batch.jobs.front()->Describe() + ".";
    }
    const std::string peers = PeerReport(missing);
    return "waiting in the host stage for rank(s) " + RankList(missing) + " (" +
           std::string(kWhat[step]) + ") in " + DescribeJob(*batch.jobs.front()) +
           (batch.jobs.size() > 1 ? " and " + std::to_string(batch.jobs.size() - 1) + " more"
                                  : std::string()) +
           "." + (peers.empty() ? std::string() : " " + peers + ".");
  }
  for (const auto& job : batch.jobs) {
    if (!job->contribs_from || !job->results_from) continue;  // never started
    bool incomplete = false;
    for (int p = 0; p < job->n; ++p) {
      if (p == job->me) continue;
      const int rank = batch.group[p];
      const int contribs = job->contribs_from[p].load();
      const int results = job->results_from[p].load();
      const int want_contribs = job->ContributionsFrom(p);
      const int want_results = job->ResultsFrom(p);
      if (contribs < want_contribs || results < want_results) {
        missing.insert(rank);
        if (what.empty() || incomplete) {
          detail += std::string(detail.empty() ? "" : ", ") + "from rank " +
                    std::to_string(rank) + ": " + std::to_string(contribs) + "/" +
                    std::to_string(want_contribs) + " contribution and " +
                    std::to_string(results) + "/" + std::to_string(want_results) +
                    " result chunks";
        }
        incomplete = true;
      }
    }
    if (incomplete && what.empty()) what = DescribeJob(*job);
  }
  size_t remaining, inflight;
  {
    std::lock_guard<std::mutex> lock(const_cast<Batch&>(batch).mu);
    remaining = batch.remaining;
    inflight = batch.inflight;
  }
  const std::string counts = " (" + std::to_string(remaining) + " operations left, " +
                             std::to_string(inflight) + " in flight)";
  if (missing.empty()) {
    return "no data missing, but the reduction did not finish" + counts + ".";
  }
  const std::string peers = PeerReport(missing);
  return "waiting for rank(s) " + RankList(missing) + " in " + what + " (" + detail + ")" +
         counts + "." + (peers.empty() ? std::string() : " " + peers + ".");
}

std::string Communicator::Describe() const {
  char heartbeat[48] = "no heartbeats";
  if (connected_ && config_.heartbeat_s > 0) {
    std::snprintf(heartbeat, sizeof(heartbeat), "heartbeats every %g s", config_.heartbeat_s);
  }
  const size_t least = std::min(config_.min_chunk_bytes, config_.chunk_bytes);
  std::string chunks = "parts in chunks of " + SizeText(config_.chunk_bytes);
  if (least < config_.chunk_bytes) {
    chunks += ", across hosts of 1/" + std::to_string(kChunksPerPart) + " of the part down to " +
              SizeText(least);
  }
  return "rank " + std::to_string(config_.rank) + " of " + std::to_string(config_.size) +
         " over " + transport_->Describe() + ", " + heartbeat + ", " + chunks;
}

CommStats Communicator::Stats() const {
  CommStats stats;
  stats.reductions = reductions_.load();
  stats.bytes_reduced = bytes_reduced_.load();
  stats.messages_dropped = dropped_.load();
  stats.heartbeats_received = heartbeats_.load();
  stats.peers_declared_dead = declared_dead_.load();
  stats.heartbeats_sent = heartbeats_sent_.load();
  stats.leave_notices_sent = leave_notices_sent_.load();
  stats.wait_notices_sent = wait_notices_sent_.load();
  stats.failed_batches_kept = kept_batches_.load();
  stats.host_stage_calls = host_calls_.load();
  stats.host_bytes_read = host_bytes_read_.load();
  stats.host_direct_calls = host_direct_calls_.load();
  stats.served_jobs = served_jobs_.load();
  ServedCounts(&stats.served_chunks, &stats.served_bytes);
  {
    std::lock_guard<std::mutex> lock(active_mu_);
    stats.batches_in_flight = active_.size();
  }
  stats.transport = transport_->Stats();
  std::lock_guard<std::mutex> lock(occurrences_mu_);
  stats.occurrence_entries = occurrences_.size();
  return stats;
}

}  // namespace herring::engine
