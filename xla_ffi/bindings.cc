// nanobind module herring_jax._herring_ffi: the handler capsules and the
// communicator set-up that initialize() needs. Nothing else.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <unistd.h>

#include "engine/communicator.h"
#include "engine/cross_memory.h"
#include "engine/host_topology.h"
#include "engine/registry.h"
#include "engine/served.h"
#include "engine/wire.h"
#include "engine/timeline.h"
#include "device_double.h"
#include "handlers.h"

namespace nb = nanobind;

namespace herring {
namespace {

template <typename T>
nb::capsule EncapsulateFfiHandler(T* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

std::shared_ptr<engine::Communicator> Find(int64_t handle) {
  auto comm = engine::Registry::Get().Find(handle);
  if (!comm) throw std::runtime_error("unknown herring communicator handle");
  return comm;
}

std::vector<uint8_t> ToBytes(const nb::bytes& b) {
  const auto* p = static_cast<const uint8_t*>(b.data());
  return std::vector<uint8_t>(p, p + b.size());
}

// A handler bundle: the instantiate stage numbers the instruction, the
// execute stage reduces.
template <typename I, typename E>
nb::dict Bundle(I* instantiate, E* execute) {
  nb::dict stages;
  stages["instantiate"] = EncapsulateFfiHandler(instantiate);
  stages["execute"] = EncapsulateFfiHandler(execute);
  return stages;
}

// A word other processes of the host read to find out whether they can read
// this one's memory (initialize's probe); its value names this process.
uint64_t& ProbeWord() {
  static uint64_t word = 0x48524e4700000000ull ^ static_cast<uint64_t>(getpid());
  return word;
}

// The state type of a platform's handler, as jax.ffi.register_ffi_type takes it.
nb::dict StateType(bool cuda) {
  nb::dict type;
  type["type_id"] = nb::capsule(static_cast<void*>(InstructionStateTypeId(cuda)));
  type["type_info"] = nb::capsule(
      const_cast<void*>(static_cast<const void*>(InstructionStateTypeInfo(cuda))));
  return type;
}

}  // namespace

NB_MODULE(_herring_ffi, m) {
  // Bytes in front of every chunk on the wire (the eager limit is chunk + this).
  m.attr("WIRE_HEADER_BYTES") = sizeof(engine::WireHeader);

  m.def("registrations", []() {
    nb::dict d;
    d["herring_allreduce"] = Bundle(HerringAllReduceInstantiate, HerringAllReduce);
    d["herring_simulated_compute"] = EncapsulateFfiHandler(HerringSimulatedCompute);
    d["herring_join"] = EncapsulateFfiHandler(HerringJoin);
    d["herring_async_start"] = Bundle(HerringAllReduceInstantiate, HerringAsyncStart);
    d["herring_async_done"] = EncapsulateFfiHandler(HerringAsyncDone);
    d["herring_async_known"] = EncapsulateFfiHandler(HerringAsyncKnown);
    // Tests: XLA:CUDA's start/done on the CPU double (HERRING_TEST_DEVICE_DOUBLE).
    d["herring_double_allreduce_start"] =
        Bundle(HerringAllReduceInstantiate, HerringDoubleStart);
    d["herring_double_allreduce_done"] = EncapsulateFfiHandler(HerringDoubleDone);
    return d;
  });
  // Types to register (jax.ffi.register_ffi_type) before the handlers.
  m.def("type_registrations", []() {
    nb::dict d;
    d["herring_jax.instruction_state"] = StateType(false);
    return d;
  });

  // Handlers for XLA's CUDA platform; empty when built without a CUDA toolkit.
  m.def("cuda_registrations", []() {
    nb::dict d;
#ifdef HERRING_WITH_CUDA
    d["herring_allreduce_start"] =
        Bundle(HerringAllReduceInstantiateCuda, HerringAllReduceStartCuda);
    d["herring_allreduce_done"] = EncapsulateFfiHandler(HerringAllReduceDoneCuda);
#endif
    return d;
  });
  m.def("cuda_type_registrations", []() {
    nb::dict d;
#ifdef HERRING_WITH_CUDA
    d["herring_jax.instruction_state.cuda"] = StateType(true);
#endif
    return d;
  });

  m.def("set_local_devices", &SetLocalDevices, nb::arg("platform"), nb::arg("numbers"),
        "How the platform's handler numbers this process's devices, in jax's local order.");
  m.def("count_launches_for_test", &CountLaunchesForTest, nb::arg("calls"),
        "Tests: one instruction's launch counts under the launch identity for (run id, "
        "device) calls in order; 'error: ...' where a call fails.");
  m.def(
      "set_device_double_faults",
      [](const std::string& spec) {
        std::string error = DeviceDouble::Get().SetFaults(spec);
        if (!error.empty()) throw nb::value_error(error.c_str());
      },
      nb::arg("spec"),
      "Tests: the CPU double's fault hook (HERRING_TEST_DEVICE_FAULT; device_double.h).");
  m.def("device_double_stats", []() {
    DoubleStats s = DeviceDouble::Get().Stats();
    nb::dict d;
    d["copies_to_host"] = s.copies_to_host;
    d["copies_to_device"] = s.copies_to_device;
    d["bytes_to_host"] = s.bytes_to_host;
    d["bytes_to_device"] = s.bytes_to_device;
    d["events_reached"] = s.events_reached;
    d["waits_in_flight"] = s.waits_in_flight;
    d["delayed"] = s.delayed;
    d["failed"] = s.failed;
    return d;
  }, "Tests: what the CPU double did in this process so far.");
  m.def("set_launch_identity", &SetLaunchIdentity, nb::arg("platform"), nb::arg("launch"),
        "Whether the platform's reductions compiled from now on are named by launch numbers "
        "per instruction (True) or by XLA's run ids (False).");

  m.def(
      "create_communicator",
      [](int rank, int size, uint64_t token, const std::string& provider,
         const std::string& interface, bool force_mr, size_t chunk_bytes, int server_threads,
         double timeout_s, double heartbeat_s, double peer_timeout_s, size_t max_posted,
         bool test_stale_copies, int test_gather_delay_ms, bool test_early_strangers,
         int progress_slice_us, double stall_s, double done_grace_s,
         const std::string& test_fault, int test_read_delay_ms, int test_activate_delay_ms,
         int test_forge_as, size_t host_direct_bytes, size_t min_chunk_bytes, int workers,
         double server_share, size_t server_min_bytes) {
        engine::CommConfig config;
        config.rank = rank;
        config.size = size;
        config.token = token;
        config.chunk_bytes = chunk_bytes;
        config.min_chunk_bytes = min_chunk_bytes;
        config.server_threads = server_threads;
        config.timeout_s = timeout_s;
        config.heartbeat_s = heartbeat_s;
        config.peer_timeout_s = peer_timeout_s;
        config.stall_s = stall_s;
        config.done_grace_s = done_grace_s;
        config.transport.provider = provider;
        config.transport.interface = interface;
        config.transport.force_mr = force_mr;
        config.transport.max_posted = max_posted;
        config.transport.progress_slice_us = progress_slice_us;
        config.test_stale_copies = test_stale_copies;
        config.test_gather_delay_ms = test_gather_delay_ms;
        config.test_early_strangers = test_early_strangers;
        config.test_fault = test_fault;
        config.test_read_delay_ms = test_read_delay_ms;
        config.test_activate_delay_ms = test_activate_delay_ms;
        config.test_forge_as = test_forge_as;
        config.host_direct_bytes = host_direct_bytes;
        config.workers = workers;
        config.server_share = server_share;
        config.server_min_bytes = server_min_bytes;
        engine::Status status;
        std::unique_ptr<engine::Communicator> comm;
        {
          nb::gil_scoped_release release;
          comm = engine::Communicator::Create(config, &status);
        }
        if (!status.ok()) throw std::runtime_error(status.message());
        return engine::Registry::Get().Add(std::move(comm));
      },
      nb::arg("rank"), nb::arg("size"), nb::arg("token"), nb::arg("provider"),
      nb::arg("interface"), nb::arg("force_mr"), nb::arg("chunk_bytes"),
      nb::arg("server_threads"), nb::arg("timeout_s"), nb::arg("heartbeat_s"),
      nb::arg("peer_timeout_s"), nb::arg("max_posted") = 0,
      nb::arg("test_stale_copies") = false, nb::arg("test_gather_delay_ms") = 0,
      nb::arg("test_early_strangers") = false, nb::arg("progress_slice_us") = 0,
      nb::arg("stall_s") = 60.0, nb::arg("done_grace_s") = 300.0,
      nb::arg("test_fault") = "", nb::arg("test_read_delay_ms") = 0,
      nb::arg("test_activate_delay_ms") = 0, nb::arg("test_forge_as") = -1,
      nb::arg("host_direct_bytes") = 0, nb::arg("min_chunk_bytes") = 16 << 10,
      nb::arg("workers") = 0, nb::arg("server_share") = -1.0,
      nb::arg("server_min_bytes") = 0,
      "Opens the transport and starts the server threads; returns a handle.");

  m.def("address", [](int64_t handle) {
    std::vector<uint8_t> a = Find(handle)->Address();
    return nb::bytes(reinterpret_cast<const char*>(a.data()), a.size());
  });

  m.def("connect", [](int64_t handle, const std::vector<nb::bytes>& addrs) {
    std::vector<std::vector<uint8_t>> raw;
    for (const auto& a : addrs) raw.push_back(ToBytes(a));
    engine::Status s = Find(handle)->Connect(raw);
    if (!s.ok()) throw std::runtime_error(s.message());
  });

  m.def(
      "set_topology",
      [](int64_t handle, const std::vector<int>& host_of, const std::vector<int64_t>& pid_of,
         const std::vector<bool>& memory_shared, const std::vector<bool>& board_shared) {
        engine::HostTopology topology{host_of, pid_of, memory_shared, board_shared};
        engine::Status s = Find(handle)->SetTopology(topology);
        if (!s.ok()) throw std::runtime_error(s.message());
      },
      nb::arg("handle"), nb::arg("host_of"), nb::arg("pid_of"), nb::arg("memory_shared"),
      nb::arg("board_shared"),
      "Which ranks share a host (host index per rank), their pids, and per host whether "
      "its processes read each other's memory and map each other's host boards; before "
      "connect.");
  m.def(
      "board_fd",
      [](int64_t handle) {
        std::string error;
        const int fd = Find(handle)->BoardFd(&error);
        return nb::make_tuple(fd, error);
      },
      nb::arg("handle"),
      "(descriptor, error) of this process's host board, for the other processes of its "
      "host (descriptor -1 and the reason where it could not be created).");
  m.def(
      "attach_board",
      [](int64_t handle, int host_index, int64_t pid, int fd) {
        nb::gil_scoped_release release;
        return Find(handle)->AttachBoard(host_index, pid, fd);
      },
      nb::arg("handle"), nb::arg("host_index"), nb::arg("pid"), nb::arg("fd"),
      "Maps the host board of the process `pid` (its descriptor `fd`), the `host_index`-th "
      "process of this host; returns \"\" or why it could not.");

  m.def("server_share", &engine::ServerShare, nb::arg("workers"), nb::arg("servers"),
        nb::arg("requested") = -1.0,
        "The share of an all-reduce's buffer that `servers` server-only processes take among "
        "`workers` workers (or hosts): `requested` where it is in [0, 1], else the split the "
        "engine uses (engine/served.h).");
  m.def("block_share", &engine::BlockShare, nb::arg("workers"), nb::arg("servers"),
        nb::arg("requested") = -1.0,
        "The share of each block (a worker's part) of a reduce-scatter or all-gather that "
        "goes through `servers` server-only processes among `workers` workers (or hosts): "
        "`requested` where it is in [0, 1], else the engine's split (engine/served.h).");
  m.def("memory_probe", []() {
    return nb::make_tuple(reinterpret_cast<uint64_t>(&ProbeWord()), ProbeWord());
  }, "(address, value) of this process's probe word, for other processes to read.");
  m.def(
      "read_memory_probe",
      [](int64_t pid, uint64_t address) {
        uint64_t value = 0;
        engine::Status s;
        {
          nb::gil_scoped_release release;
          s = engine::ReadProcessMemory(pid, address, &value, sizeof(value));
        }
        if (!s.ok()) throw std::runtime_error(s.message());
        return value;
      },
      nb::arg("pid"), nb::arg("address"),
      "Reads another process's probe word (process_vm_readv); raises with the reason.");
  m.def("set_ptracer", &engine::SetPtracer, nb::arg("tracer"),
        "Under Yama's ptrace_scope 1: lets process `tracer` and its descendants (> 0), any "
        "process of this user (-1) or nobody (0) read this one's memory; \"\" or the error.");

  m.def("describe", [](int64_t handle) { return Find(handle)->Describe(); });

  m.def("stats", [](int64_t handle) {
    engine::CommStats s = Find(handle)->Stats();
    nb::dict d;
    d["reductions"] = s.reductions;
    d["bytes_reduced"] = s.bytes_reduced;
    d["messages_dropped"] = s.messages_dropped;
    d["heartbeats_received"] = s.heartbeats_received;
    d["peers_declared_dead"] = s.peers_declared_dead;
    d["occurrence_entries"] = s.occurrence_entries;
    d["heartbeats_sent"] = s.heartbeats_sent;
    d["leave_notices_sent"] = s.leave_notices_sent;
    d["wait_notices_sent"] = s.wait_notices_sent;
    d["failed_batches_kept"] = s.failed_batches_kept;
    d["host_stage_calls"] = s.host_stage_calls;
    d["host_bytes_read"] = s.host_bytes_read;
    d["host_direct_calls"] = s.host_direct_calls;
    d["batches_in_flight"] = s.batches_in_flight;
    d["served_jobs"] = s.served_jobs;
    d["served_chunks"] = s.served_chunks;
    d["served_bytes"] = s.served_bytes;
    d["posts_queued"] = s.transport.posts_queued;
    d["duplicate_completions"] = s.transport.duplicate_completions;
    d["queue_errors"] = s.transport.queue_errors;
    d["messages_sent"] = s.transport.sends;
    d["data_messages_sent"] = s.transport.data_sends;
    d["bytes_sent"] = s.transport.send_bytes;
    return d;
  });

  m.def("take_timeline", []() {
    nb::list out;
    for (const engine::TimelineEvent& e : engine::Timeline::Get().Take()) {
      nb::dict d;
      d["key"] = e.key;
      d["slot"] = e.slot;
      d["device"] = e.device;
      d["bytes"] = e.bytes;
      d["issued_ns"] = e.issued_ns;
      d["begun_ns"] = e.begun_ns;
      d["ended_ns"] = e.ended_ns;
      d["ok"] = e.ok;
      out.append(d);
    }
    return out;
  }, "The reductions recorded since the last call (CLOCK_MONOTONIC ns), oldest first.");

  m.def(
      "abort",
      [](int64_t handle, const std::string& why, double wait_s) {
        nb::gil_scoped_release release;
        Find(handle)->Abort(why, wait_s);
      },
      nb::arg("handle"), nb::arg("why"), nb::arg("wait_s"),
      "This process is failing: fails its reductions in flight and tells every other rank "
      "`why`, waiting up to wait_s seconds for the messages to leave.");
  m.def(
      "note_call_site",
      [](int64_t handle, uint64_t key, uint32_t slot, const std::string& site) {
        Find(handle)->NoteCallSite(key, slot, site);
      },
      nb::arg("handle"), nb::arg("key"), nb::arg("slot"), nb::arg("site"),
      "Where the reduction of `key` at `slot` was written, for stall reports and errors.");

  m.def(
      "serve",
      [](int64_t handle) {
        auto comm = Find(handle);
        engine::Status s;
        {
          nb::gil_scoped_release release;
          s = comm->Serve();
        }
        return s.ok() ? std::string() : s.message();
      },
      nb::arg("handle"),
      "A server-only process: sums the workers' parts until every worker has left "
      "(returns '') or the job failed (returns why).");

  m.def(
      "server_gone",
      [](int64_t handle, int rank, const std::string& how) {
        auto comm = Find(handle);
        nb::gil_scoped_release release;
        comm->ServerGone(rank, how);
      },
      nb::arg("handle"), nb::arg("rank"), nb::arg("how"),
      "Fails the job at once: server-only process `rank` is gone.");

  m.def("destroy", [](int64_t handle) {
    nb::gil_scoped_release release;
    // A step that started an async reduction and ended before its done: its
    // peers' matching reduction needs this process until it has ended.
    if (auto comm = engine::Registry::Get().Find(handle)) {
      const double timeout_s = comm->config().timeout_s + 10.0;
      comm.reset();
      std::vector<int64_t> dropped;
      if (size_t left = DrainAsync(handle, timeout_s, &dropped)) {
        std::fprintf(stderr, "herring_jax: shutdown gave up waiting for %zu async "
                     "reduction(s) still in flight after %.0f s\n", left, timeout_s);
      }
      // Never silently: a fragment local_sgd had in flight when training
      // stopped is not applied to the parameters this process ends with.
      if (!dropped.empty()) {
        std::string tickets;
        for (int64_t t : dropped) tickets += (tickets.empty() ? "" : ", ") + std::to_string(t);
        std::fprintf(stderr, "herring_jax: shutdown dropped the result of %zu reduction(s) "
                     "started across steps and never collected (ticket %s: the step count "
                     "of its start): a local_sgd fragment in flight when training stopped is "
                     "not in this process's final parameters. A checkpoint of the optimizer "
                     "state saved after that step holds what was sent, and a run resumed "
                     "from it applies the fragment\n", dropped.size(), tickets.c_str());
      }
    }
    engine::Registry::Get().Remove(handle);
  });
}

}  // namespace herring
