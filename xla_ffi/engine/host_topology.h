// Which processes share a host, and how a group of processes reduces given
// that: through memory inside each host first (host_stage.cc), then across
// hosts, or flat across all of them (data_path.cc).
#ifndef HERRING_ENGINE_HOST_TOPOLOGY_H_
#define HERRING_ENGINE_HOST_TOPOLOGY_H_

#include <cstdint>
#include <string>
#include <vector>

namespace herring::engine {

// Set once at initialize, the same on every process: initialize() gathers
// every rank's host identity (boot id and network namespace), pid, and
// whether its host's processes can read each other's memory.
struct HostTopology {
  // [rank] host index: hosts are numbered in the order of their lowest rank.
  std::vector<int> host_of;
  // [rank] process id, as the processes of its host see it.
  std::vector<int64_t> pid_of;
  // [host] its processes read each other's memory (process_vm_readv works
  // between every pair of them): only such hosts take the host stage.
  std::vector<bool> memory_shared;
  // [host] its processes map each other's host boards (host_board.h), so the
  // host stage's steps go through shared memory instead of the transport.
  // Empty: on no host.
  std::vector<bool> board_shared;

  bool empty() const { return host_of.empty(); }
  // `rank`'s place among the ranks of its host (rank order).
  int IndexOnHost(int rank) const;
  // Checks sizes and ranges against `ranks` processes; "" when valid.
  std::string Validate(int ranks) const;
};

// How one group (sorted ranks) reduces, the same on every member.
struct GroupPlan {
  // True: host stage, then the hosts' shares across hosts. False: every
  // process is its own server shard over the transport (one process per
  // host, hosts with different numbers of processes in the group, or a host
  // whose processes cannot read each other's memory).
  bool hierarchical = false;
  // Members on this process's host, by rank: the host stage's order.
  std::vector<int> local;
  int local_index = 0;  // this process's place in `local`
  int hosts = 1;        // hosts the group spans
  // One member per host, each with this process's local index, hosts in
  // order: the group of the stage across hosts (summed in this order).
  std::vector<int> cross;
  // The host stage's steps go through the host boards (host_board.h), not
  // transport messages: the same on every process of this host.
  bool board = false;
  // [local index] the process's index among all the processes of its host
  // (its board's place in the boards' ack tables).
  std::vector<int> board_index;
  // The group (sorted ranks), and its members per host (hosts in order, each
  // in rank order): where a reduce-scatter's or all-gather's parts are
  // (ReduceRequest::parts are in group order).
  std::vector<int> group;
  std::vector<std::vector<int>> members;
};

// The plan of `group` (sorted, containing `rank`). With an empty topology
// (never set) every group is flat.
GroupPlan PlanGroup(const HostTopology& topology, const std::vector<int>& group, int rank);

}  // namespace herring::engine

#endif  // HERRING_ENGINE_HOST_TOPOLOGY_H_
