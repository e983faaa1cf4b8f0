"""pytest set-up: tests run against the installed herring_jax (see tests/run.sh)."""

import os

import pytest

# One CPU device per test process unless a test asks for more; the workers
# get their device count from the launcher.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# HERRING_LONG_TESTS=1 turns the soak and chaos tests into their long runs
# (docs/development.md), which take far longer than the 900 s pytest timeout that
# pyproject.toml gives every test.
LONG_TESTS = os.environ.get("HERRING_LONG_TESTS") == "1"

# Two tiers. The core tier (`bash tests/run.sh`, the README's test command)
# runs every feature's main tests on the layout that catches the most; the
# extended part holds the tools (bench, train-bench, the GPU kit's dry run,
# the latency tool), the long-haul runs (soak, chaos, resume after a kill),
# and the other layouts of tests whose main layout stays in the core tier. `bash tests/run.sh` runs everything else;
# `bash tests/run.sh -m extended` runs these, as .ci/run does after it, and
# `bash tests/run.sh -m ""` both.
EXTENDED = {"test_bench.py", "test_train_bench.py", "test_tools.py", "test_gpu_check.py",
            "test_soak.py", "test_chaos.py", "test_resume.py"}
EXTENDED_CASES = {
    # Moved out of the core tier when it reached 13.3 min (2026-11-27): each
    # feature keeps one main case there.
    "test_second_hour.py::test_the_first_stall_line_of_each_rank_names_both_call_sites"
    "[1-allreduce]",
    "test_second_hour.py::test_the_first_stall_line_of_each_rank_names_both_call_sites"
    "[1-reduce_scatter]",
    "test_fsdp_recipe.py::test_shard_map_fsdp_recipe_runs_with_herring_as_with_lax[2-2]",
    "test_nnx.py::test_the_nnx_example_matches_one_process[allreduce]",
    "test_restarts.py::test_a_process_that_does_not_stop_within_the_preemption_grace_exits_1_"
    "saying_so",
    "test_allreduce.py::test_every_dtype_op_and_size[4-1]",
    "test_compat.py::test_lax_compatibility[4-1]",
    "test_collectives.py::test_lax_compatibility_and_process_collectives[4-1]",
    "test_sharded.py::test_the_parameters_match_the_unsharded_chain_on_every_process[4-2]",
    "test_sparse_rows.py::test_sparse_rows_equal_the_dense_reduction_bitwise[2x2]",
    "test_sparse_rows.py::test_the_recommendation_example_ends_alike_with_sparse_rows",
    # The core tier keeps one layout of each of these: the one that catches the
    # most (several devices and several processes at once).
    "test_allreduce.py::test_every_dtype_op_and_size[4-2]",
    "test_compat.py::test_lax_compatibility[1-4]",
    "test_collectives.py::test_lax_compatibility_and_process_collectives[1-4]",
    "test_fsdp_recipe.py::test_shard_map_fsdp_recipe_runs_with_herring_as_with_lax[1-4]",
    "test_groupings.py::test_interleaved_groupings_match_lax[1-4]",
    "test_groupings.py::test_more_groups_than_wire_streams[1-130]",
    "test_host_stage.py::test_every_dtype_through_the_host_stage[2-2-1]",
    "test_identity.py::test_extra_launch_on_one_rank_fails_every_rank_and_the_first_names_both_runs[4]",
    "test_first_hour.py::test_shutdown_right_after_the_last_queued_step_finishes_them[2]",
    "test_optax.py::test_training_matches_lax_pmean_on_every_process[4-2]",
    "test_optax.py::test_fusion_round_trip[2-300-64]",
    "test_optax.py::test_fusion_round_trip[3-300-1048576]",
    "test_state.py::test_broadcast_and_batchnorm_state[3-1]",
    "test_sharded_checkpoint.py::test_a_checkpoint_resumes_on_another_number_of_processes"
    "[4-2-False-float32]",
    "test_fully_sharded.py::test_the_parameters_match_the_unsharded_chain_on_every_process[1-None]",
    "test_fully_sharded.py::test_the_parameters_match_the_unsharded_chain_on_every_process[3-None]",
    "test_fully_sharded.py::test_the_parameters_match_the_unsharded_chain_on_every_process[4-2]",
    # Moved when the core tier took 14.4 min on a fresh clone (2026-11-27):
    # guards whose feature keeps its main test in the core tier.
    "test_fuzz.py::test_header_fuzzer_finds_nothing",
    "test_identity.py::test_occurrence_counters_are_pruned_when_idle",
    "test_first_hour.py::test_a_batch_size_mismatch_is_reported_as_a_stall_naming_both_call_sites",
    "test_sharded.py::test_inside_shard_map_each_device_keeps_a_quarter",
    "test_leave.py::test_ranks_that_exit_right_after_their_last_reduction_fail_no_peer"
    "[host-stage]",
    "test_host_stage.py::test_every_dtype_through_the_host_stage[2-1-0]",
    # Moved when the core tier, two tests at a time, took 13 min on a fresh
    # clone and the sparse-rows and Accordion tests joined it (2026-11-28): the
    # demo (train and check) and the launcher-free recipe stay; the others
    # (learning examples, recipes under mpirun and srun, every parser refusing
    # prefixes of its flags) are user-facing, not wrong-result, guards.
    "test_examples.py::test_quickstart_learns",
    "test_examples.py::test_mnist_like_learns[herring]",
    "test_examples.py::test_pin_outside_the_launcher_is_a_clear_error",
    "test_examples.py::test_no_command_takes_a_prefix_of_a_flag_for_the_flag",
    "test_recipes.py::test_mpirun",
    "test_recipes.py::test_srun_environment",
    # The examples' other runs.
    "test_examples.py::test_lm_loss_falls_with_two_devices_per_process",
    "test_examples.py::test_mnist_like_learns[native]",
    "test_examples.py::test_pin_gives_each_process_its_own_core",
    # Every training mode's smoke run (about 20-40 s each); the core tier keeps
    # train_mnist_like's --local-steps, whose report once crashed.
    *(f"test_examples.py::test_every_training_mode_reports_and_finishes[{name}]"
      for name in ("mnist-streaming", "mnist-sharded-optimizer", "mnist-fully-sharded",
                   "mnist-powersgd", "mnist-topk", "mnist-compute-only", "lm-diloco-int8",
                   "lm-slowmo", "lm-localsgd-streaming-delay", "lm-fully-sharded-reshard",
                   "lm-native", "lm-any-batch", "lm-accordion")),
    # Flax NNX, all of it here (the example's allreduce_gradients run, about
    # 16 s, left the core tier with the cases at the top): every
    # transformation inside nnx.Optimizer and the NNX checkpoint recipes (2
    # processes, then a resume on 3) take 1.5-3 min.
    "test_nnx.py::test_herring_inside_nnx_optimizer_on_two_processes",
    "test_nnx.py::test_the_nnx_example_matches_one_process[sharded]",
    # Local SGD: the core tier keeps the 2-process run of every case (about
    # 30 s); 4 processes, shard_map and the train-bench run another 2.5 min.
    "test_local_sgd.py::test_the_presets_match_their_model_on_four_processes",
    "test_local_sgd.py::test_inside_shard_map_every_device_is_a_worker",
    "test_local_sgd.py::test_train_bench_runs_diloco_against_allreduce_and_compute",
    # Restarts of train_lm on 4 processes (several runs each, minutes); the
    # launcher's own restart tests stay in the core tier.
    "test_restarts.py::test_kills_under_max_restarts_end_with_the_uninterrupted_parameters",
    "test_restarts.py::test_a_process_failing_after_its_first_restart_is_left_out_and_the_job_"
    "finishes",
    "test_restarts.py::test_sigterm_to_one_rank_saves_every_rank_at_one_step_and_resumes_bitwise",
    "test_restarts.py::test_fully_sharded_resumes_bitwise_and_onto_fewer_processes",
    # Streaming DiLoCo's resume through train_lm (two runs, about a minute);
    # tests/test_streaming.py resumes after every step in the core tier.
    "test_restarts.py::test_streaming_diloco_resumes_from_a_checkpoint_with_a_fragment_in_flight",
    "test_restarts.py::test_local_sgd_resumes_on_fewer_processes",
    # A killed server-only process under --max-restarts: two train_lm runs
    # with a server (tests/test_servers.py kills one in the core tier); on
    # this host, and on simulated hosts (--netns), where the restart's ports
    # follow the first run's in the same namespaces.
    "test_restarts.py::test_a_killed_server_under_max_restarts_resumes_to_the_uninterrupted_"
    "parameters[local]",
    "test_restarts.py::test_a_killed_server_under_max_restarts_resumes_to_the_uninterrupted_"
    "parameters[netns]",
    # sharded_optimizer and fully_sharded through a server-only process: two
    # train_lm runs of 2 processes each (tests/test_servers.py sums through
    # servers bitwise in the core tier).
    "test_restarts.py::test_sharded_training_through_a_server_ends_bitwise_as_without_it"
    "[--sharded-optimizer]",
    "test_restarts.py::test_sharded_training_through_a_server_ends_bitwise_as_without_it"
    "[--fully-sharded]",
    # Moved when the core tier, two tests at a time, took 12.2 min on a quiet
    # machine (2026-11-28): fallbacks and guards whose feature keeps its main
    # test in the core tier (the first and last also run under the sanitizers).
    "test_engine.py::test_posts_beyond_the_providers_queues_wait_in_herrings_queue",
    "test_failures.py::test_a_process_stopped_longer_than_the_peer_timeout_is_heard_again_when_"
    "it_resumes",
    "test_host_stage.py::test_a_process_whose_memory_cannot_be_read_turns_its_host_to_the_"
    "transport",
    "test_host_stage.py::test_a_process_that_cannot_map_boards_turns_only_its_host_to_messages",
    "test_collectives.py::test_process_collectives_on_one_host_through_the_boards",
    # Moved when the core tier took 14.5 min on a fresh clone in CI (2026-11-29):
    # the servers' codecs and their 2 x 2 layouts (the servers' design asks
    # for them in the extended part; the core tier keeps 2 workers + a server
    # bitwise, a killed server, error feedback through a server, and the
    # one-block codec chunks that once lost data), and error feedback's
    # transport-only layout and sharded_optimizer on one host (the core tier
    # keeps one host x 2 with allreduce_gradients, where a never-made error
    # was added, and 2 x 2 with both).
    "test_servers.py::test_every_codec_through_the_servers_sums_bitwise_as_without_them",
    "test_servers.py::test_the_host_stage_sums_across_hosts_through_the_servers_bitwise_as_"
    "without_them",
    "test_servers.py::test_the_host_stage_sends_encoded_slices_through_the_servers_bitwise_as_"
    "without_them",
    "test_servers.py::test_the_host_stage_sends_encoded_blocks_through_the_servers_bitwise_as_"
    "without_them",
    "test_codecs.py::test_error_feedback_keeps_what_the_engine_encoding_lost[1x2-sharded]",
    "test_codecs.py::test_error_feedback_keeps_what_the_engine_encoding_lost[2x1-allreduce]",
    "test_codecs.py::test_error_feedback_keeps_what_the_engine_encoding_lost[2x1-sharded]",
    # Moved when the core tier took 17.3 min on a quiet AMD EPYC of 2 cores
    # and 18.5 min in CI's fresh clone (2026-11-30): every test here either
    # has a sibling case of the same test in the core tier (another layout,
    # chunk size, provider or failure point of the same code), or guards a
    # message or a property of a path whose results the core tier checks.
    *(f"test_engine.py::test_the_progress_thread_asks_for_a_short_time_slice[{p}]"
      for p in ("0", "250")),
    "test_engine.py::test_parts_cross_hosts_in_chunks_of_a_quarter_cut_alike_on_every_process"
    "[2-1048576-1]",
    "test_engine.py::test_stale_messages_are_dropped_and_the_sums_stay_exact[1]",
    "test_engine.py::test_strangers_before_the_contribution_leaves_cannot_change_an_in_place_sum"
    "[None]",
    "test_engine.py::test_idle_ranks_send_heartbeats_at_a_quarter_of_the_peer_limit",
    "test_device_double.py::test_reduce_scatter_and_all_gather_on_the_double_match_numpy_bitwise"
    "[2]",
    "test_device_double.py::test_cuda_handler_code_on_the_double_reduces_bitwise_like_numpy"
    "[2-program]",
    "test_device_double.py::test_a_failed_copy_of_a_gather_fails_every_rank_with_a_clear_error"
    "[host]",
    "test_device_double.py::test_a_peer_killed_while_its_copy_is_in_flight_fails_the_others_"
    "naming_it",
    "test_device_double.py::test_a_failed_copy_fails_its_rank_whose_abort_fails_the_other_at_once",
    *(f"test_host_stage.py::test_a_slow_reader_gets_exact_results_while_its_peers_shut_down_and_"
      f"exit[{p}]" for p in ("0-1", "3-1")),
    "test_host_stage.py::test_a_failed_call_withdraws_its_inputs_before_anyone_uses_a_slice_of_"
    "them[0-0]",
    "test_host_stage.py::test_host_stage_off_reduces_over_the_transport",
    "test_host_stage.py::test_on_one_host_the_boards_carry_every_step_and_messages_only_"
    "heartbeats",
    "test_identity.py::test_concurrent_and_inlined_reductions_are_exact[2-2]",
    "test_identity.py::test_launch_identity_matches_ranks_whose_executables_differ[2-2]",
    "test_second_hour.py::test_every_survivors_first_error_line_names_the_failed_rank_and_its_"
    "exception[3-1-user-sleep]",
    "test_second_hour.py::test_the_inner_transformation_is_checked_on_one_process_as_on_several"
    "[1]",
    "test_second_hour.py::test_gradient_transformations_name_themselves_and_the_leaf",
    "test_leave.py::test_exits_over_providers_that_do_not_order_messages_wait_for_nobody"
    "[udp;ofi_rxd]",
    "test_codecs.py::test_error_feedback_keeps_what_the_engine_encoding_lost[1x2-allreduce]",
    "test_codecs.py::test_error_feedback_of_processes_with_two_devices[1x2]",
    "test_errors.py::test_an_unavailable_or_misspelt_provider_is_a_herring_error_naming_the_"
    "others[tpc;ofi_rxm]",
    "test_errors.py::test_documented_errors_and_edge_cases[1]",
    "test_failures.py::test_a_host_stage_call_that_cannot_start_tells_the_others_at_once"
    "[no-staging]",
    "test_failures.py::test_peer_that_skips_a_reduction_is_reported_alive_and_idle",
    "test_failures.py::test_mismatched_codecs_fail_every_rank_naming_the_codec",
    "test_failures.py::test_dead_peer_is_named_within_the_timeout",
    "test_fast_exit.py::test_the_fast_exit_writes_the_failed_reductions_slice"
    "[timeline-pending-float32[3000]-ValueError: rank 1 gives up]",
    "test_weighted.py::test_weighted_means_match_the_numpy_model_on_two_processes_of_two_devices",
    "test_servers.py::test_workers_told_of_servers_that_never_come_say_how_to_start_them",
    "test_servers.py::test_workers_that_ask_for_different_codecs_fail_naming_both_through_a_"
    "server",
    "test_accordion.py::test_accordion_switches_alike_under_the_launch_identity",
    "test_first_hour.py::test_check_vma_true_is_refused_never_multiplied",
    "test_first_hour.py::test_broadcast_of_different_trees_names_the_leaf",
    "test_overlap.py::test_reductions_overlap_the_backward_pass[2]",
    "test_topk.py::test_topk_matches_the_numpy_model_on_every_worker[mesh-axis]",
    "test_powersgd.py::test_powersgd_factors_in_bf16_over_the_transport",
}
# The C++ unit tests under the sanitizers (their builds took 175 s of the core
# tier): the core tier runs them unsanitized, the extended part under
# ThreadSanitizer and under AddressSanitizer + UBSan, and .ci/sanitizers.sh
# runs the engine under both.
EXTENDED_PARAMS = {("test_cpp_units.py", "tsan"), ("test_cpp_units.py", "asan-ubsan")}


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "long_timeout(seconds): with HERRING_LONG_TESTS=1 this test's pytest "
        "timeout is `seconds` instead of the global one")
    config.addinivalue_line(
        "markers", "extended: the suite's extended part (conftest.EXTENDED), which "
        "`bash tests/run.sh` leaves to `bash tests/run.sh -m extended`")


@pytest.hookimpl(tryfirst=True)  # before -k and -m deselect anything
def pytest_collection_modifyitems(config, items):
    # A listed case that names no test (a renamed test, a changed parameter
    # id) would silently stay in the core tier. (Checked where whole files
    # were collected: a run of chosen test ids collects only those.)
    if any("::" in str(arg) for arg in config.args):
        return _mark(config, items)
    collected = {f"{item.path.name}::{item.name}" for item in items}
    files = {item.path.name for item in items}
    stale = sorted(c for c in EXTENDED_CASES
                   if c.split("::")[0] in files and c.split("[")[0] in
                   {n.split("[")[0] for n in collected} and c not in collected)
    if stale:
        raise pytest.UsageError(f"tests/conftest.py EXTENDED_CASES names no test: {stale}")
    # LONGEST names a test function or one case of it.
    names = collected | {f"{item.path.name}::{item.originalname}" for item in items}
    stale = sorted(c for c in LONGEST if c.split("::")[0] in files and c not in names)
    if stale:
        raise pytest.UsageError(f"tests/conftest.py LONGEST names no test: {stale}")
    _mark(config, items)


def _mark(config, items):
    for item in items:
        params = getattr(item, "callspec", None)
        # (A parameter's own id may hold dashes: "asan-ubsan".)
        ids = set(params.id.split("-")) | {params.id} if params is not None else set()
        if (item.path.name in EXTENDED or f"{item.path.name}::{item.name}" in EXTENDED_CASES
                or any(item.path.name == f and p in ids for f, p in EXTENDED_PARAMS)):
            item.add_marker(pytest.mark.extended)
        _group_by_shared_fixture(item)
    _longest_first(items)
    if not LONG_TESTS:
        return
    for item in items:
        marker = item.get_closest_marker("long_timeout")
        if marker is not None:
            # First, so that it wins over any timeout marker the test has.
            item.add_marker(pytest.mark.timeout(marker.args[0]), append=False)


# The extended part's longest tests, seconds of each in a run of the part
# with -n 2 on a loaded 2-core machine (2026-11-29). pytest-xdist hands tests
# out in collection order, so one of these collected last kept a worker busy
# while the other had nothing left: about 25 s of idle tail on average, 50 s
# one run in ten (a simulation of --dist loadgroup over those durations,
# each varied by 30%); started first, under 5 s. (A name here that names no
# test stops the run, as a stale EXTENDED_CASES entry does. Their cases in the
# core tier start first there too.)
LONGEST = {
    # (Apart: two of the CPU hog's tests side by side would load the machine
    # twice as much as each was written for.)
    "test_leave.py::test_many_exits_under_load_fail_no_peer[transport]": 206,
    "test_leave.py::test_many_exits_under_load_fail_no_peer[host-stage]": 84,
    "test_restarts.py::test_kills_under_max_restarts_end_with_the_uninterrupted_parameters": 120,
    "test_restarts.py::test_fully_sharded_resumes_bitwise_and_onto_fewer_processes": 158,
    "test_local_sgd.py::test_train_bench_runs_diloco_against_allreduce_and_compute": 131,
    "test_train_bench.py::test_train_bench_fully_sharded_columns": 123,
    "test_restarts.py::test_a_process_failing_after_its_first_restart_is_left_out_and_the_job_"
    "finishes": 122,
    "test_nnx.py::test_herring_inside_nnx_optimizer_on_two_processes": 121,
    "test_train_bench.py::test_train_bench_with_servers_sends_less_and_trains_the_same": 120,
    "test_fully_sharded.py::test_the_parameters_match_the_unsharded_chain_on_every_process": 119,
    "test_resume.py::test_killed_run_resumes_to_the_same_parameters": 119,
    "test_collectives.py::test_lax_compatibility_and_process_collectives": 111,
    "test_restarts.py::test_streaming_diloco_resumes_from_a_checkpoint_with_a_fragment_in_"
    "flight": 109,
    "test_gpu_check.py::test_dry_run_passes_every_step_on_cpu": 250,  # with its restart step
    "test_restarts.py::test_local_sgd_resumes_on_fewer_processes": 102,
    "test_restarts.py::test_a_killed_server_under_max_restarts_resumes_to_the_uninterrupted_"
    "parameters": 100,
    "test_train_bench.py::test_train_bench_smoke": 93,
    "test_train_bench.py::test_train_bench_codecs_over_seeds": 86,
    "test_compat.py::test_lax_compatibility": 82,
    "test_sharded.py::test_the_parameters_match_the_unsharded_chain_on_every_process": 79,
    "test_restarts.py::test_sigterm_to_one_rank_saves_every_rank_at_one_step_and_resumes_"
    "bitwise": 73,
    "test_allreduce.py::test_every_dtype_op_and_size": 70,
}


def _longest_first(items):
    # Only in an xdist worker (every worker sorts alike, as xdist requires):
    # a plain run keeps the file order. Tests that share a module-scoped
    # fixture stay where they are: moved apart, pytest would set the fixture
    # (a multi-process job) up again.
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return

    def seconds(item):
        if any(m.name == "xdist_group" for m in item.iter_markers()):
            return 0
        return LONGEST.get(f"{item.path.name}::{item.name}",
                           LONGEST.get(f"{item.path.name}::{item.originalname}", 0))
    items.sort(key=seconds, reverse=True)  # stable: the rest keep their order


def _group_by_shared_fixture(item):
    # A module-scoped fixture (one multi-process job whose results
    # several tests read) runs once per xdist worker that gets one of its
    # tests: the tests that share it go to one worker (`--dist loadgroup`,
    # tests/run.sh), or the job runs twice (30 s of the core tier each).
    for name in item.fixturenames:
        defs = item._fixtureinfo.name2fixturedefs.get(name)
        if defs and defs[-1].scope == "module":
            item.add_marker(pytest.mark.xdist_group(f"{defs[-1].baseid}::{name}"))
            return
