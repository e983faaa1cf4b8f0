#include "engine/host_topology.h"

#include <algorithm>
#include <map>

namespace herring::engine {

std::string HostTopology::Validate(int ranks) const {
  if (static_cast<int>(host_of.size()) != ranks || static_cast<int>(pid_of.size()) != ranks) {
    return "the host topology names " + std::to_string(host_of.size()) + " hosts and " +
           std::to_string(pid_of.size()) + " pids for " + std::to_string(ranks) + " ranks";
  }
  for (int r = 0; r < ranks; ++r) {
    if (host_of[r] < 0 || host_of[r] >= static_cast<int>(memory_shared.size())) {
      return "rank " + std::to_string(r) + " has host index " + std::to_string(host_of[r]) +
             " outside 0.." + std::to_string(memory_shared.size());
    }
    if (pid_of[r] <= 0) return "rank " + std::to_string(r) + " has no pid";
  }
  if (!board_shared.empty() && board_shared.size() != memory_shared.size()) {
    return "the host topology names " + std::to_string(board_shared.size()) +
           " hosts' boards for " + std::to_string(memory_shared.size()) + " hosts";
  }
  return "";
}

int HostTopology::IndexOnHost(int rank) const {
  int index = 0;
  for (int other = 0; other < rank; ++other) index += host_of[other] == host_of[rank];
  return index;
}

GroupPlan PlanGroup(const HostTopology& topology, const std::vector<int>& group, int rank) {
  GroupPlan plan;
  if (topology.empty()) return plan;
  // Members per host, hosts in index order, members in rank order (group is
  // sorted): the same on every member of the group.
  std::map<int, std::vector<int>> members;
  for (int r : group) members[topology.host_of[r]].push_back(r);
  plan.hosts = static_cast<int>(members.size());
  const size_t per_host = members.begin()->second.size();
  bool uniform = per_host > 1;
  for (const auto& [host, ranks] : members) {
    uniform = uniform && ranks.size() == per_host && topology.memory_shared[host];
  }
  if (!uniform) return plan;
  plan.hierarchical = true;
  plan.local = members[topology.host_of[rank]];
  plan.local_index = static_cast<int>(
      std::find(plan.local.begin(), plan.local.end(), rank) - plan.local.begin());
  for (const auto& [host, ranks] : members) plan.cross.push_back(ranks[plan.local_index]);
  plan.board = !topology.board_shared.empty() && topology.board_shared[topology.host_of[rank]];
  for (int r : plan.local) plan.board_index.push_back(topology.IndexOnHost(r));
  plan.group = group;
  for (const auto& [host, ranks] : members) plan.members.push_back(ranks);
  return plan;
}

}  // namespace herring::engine
