// dgserve-prefill-worker: chunked prefill with a prefix cache (PrefillService), shipping each
// prompt's KV to the denoise worker named in the request; exports /metrics.
#include <algorithm>
#include <cstdio>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/cli.h"
#include "common/logging.h"
#include "common/openmp_env.h"
#include "common/status_macros.h"
#include "engine/generation/generator.h"
#include "kvstore/gpu_transport.h"
#include "kvstore/transfer.h"
#include "kvstore/transport_selection.h"
#include "prefill_worker/prefill_engine.h"
#include "prefill_worker/prefill_metrics.h"
#include "prefill_worker/prefill_service.h"
#include "service/address_list.h"
#include "service/internal_auth.h"
#include "service/server.h"
#include "worker/backend_flags.h"
#include "worker/kv_metrics.h"
#include "worker/worker_model.h"

ABSL_FLAG(std::string, model, "", "checkpoint directory (HF layout)");
ABSL_FLAG(std::string, served_model_name, "", "model id (default: the directory's name)");
ABSL_FLAG(std::string, device, "cpu",
          "backend: cpu, or cuda (configured with -DDGSERVE_CUDA_BACKEND=ON, on a GPU machine; "
          "see --cuda_gemm_input; --cpu_gemm_input for the CPU)");
ABSL_FLAG(std::string, grpc_address, "127.0.0.1:0", "gRPC listen address (port 0: any free)");
ABSL_FLAG(std::string, metrics_address, "127.0.0.1:0", "Prometheus /metrics listen address");
ABSL_FLAG(std::string, ports_file, "", "write the bound ports here as JSON once serving");
ABSL_FLAG(int64_t, kv_cache_mib, 512, "memory of the KV block pool (and prefix cache), MiB");
ABSL_FLAG(int, kv_block_size, 16, "token positions per KV block");
ABSL_FLAG(int, chunk_tokens, 0,
          "prompt tokens per encoder pass of one request (0: the backend's, 512 on the CPU and "
          "8192 on a GPU)");
ABSL_FLAG(int, step_token_budget, 0,
          "prompt tokens of all requests per encoder step (0: the larger of 2048 and "
          "--chunk_tokens)");
ABSL_FLAG(int, max_queue, 256, "prompts queued or running at most");
ABSL_FLAG(std::string, kv_transport, "auto",
          "KV transport to the denoise workers: auto (per target, from what it reports in Stats: "
          "cuda_ipc on the same node and GPU, else nccl where both ends can, else tcp), tcp, "
          "cuda_ipc or nccl (refused at start when this build or machine cannot use it)");
ABSL_FLAG(int64_t, testing_cut_transfer_after_bytes, 0,
          "fault injection for tests: cut every KV transfer over tcp after this many payload "
          "bytes");
ABSL_FLAG(double, drain_grace_seconds, 30, "on SIGTERM: time given to running prefills");
ABSL_FLAG(std::string, denoise_workers, "",
          "required: comma-separated denoise worker addresses (host:port or dns:///name:port, "
          "as the gateway's): a request's kv_target must be one of them or an address they "
          "resolve to, else PERMISSION_DENIED");
ABSL_FLAG(int64_t, max_kv_lease_ms, 60000,
          "a request's lease_ms above this is clamped (it bounds each KV push's deadline)");
ABSL_FLAG(int64_t, kv_push_wait_ms, 30000,
          "how long a finished prompt's KV waits for room when the denoise worker's KV pool is "
          "full now (pushed again with a backoff; the request's deadline still ends it); 0: the "
          "request fails at once with RESOURCE_EXHAUSTED");
ABSL_FLAG(int, max_kv_pushes_per_target, 64,
          "KV pushes outstanding to one denoise worker at most; beyond: RESOURCE_EXHAUSTED");
ABSL_FLAG(std::string, health_address, "",
          "if set: a plaintext port serving only grpc.health.v1.Health (kubelet probes)");

namespace dgserve {

using MakeChannelFn = std::function<std::shared_ptr<grpc::Channel>(
    const std::string& target, const grpc::ChannelArguments& args)>;

// Refuses an explicit --kv_transport cuda_ipc or nccl that this process cannot take part in
// (checked before the model loads, so a wrong flag fails at once).
absl::Status CheckExplicitKvTransport(kv::KvTransportMode mode, const kv::KvPeerInfo& local,
                                      const std::string& device) {
  if (mode == kv::KvTransportMode::kAuto || mode == kv::KvTransportMode::kTcp) {
    return absl::OkStatus();
  }
  const std::string name = kv::KvTransportModeName(mode);
  if (std::find(local.transports.begin(), local.transports.end(), name) ==
      local.transports.end()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--kv_transport ", name, ": this process cannot use it with --device ", device,
        " (it reports ", kv::DescribeKvPeer(local),
        "; cuda_ipc and nccl need the CUDA build with NCCL and --device cuda on a GPU)"));
  }
  return absl::OkStatus();
}

// The routing KV transport of `mode`: TCP always (with the fault-injection hook), and the GPU
// transports this process reports. In auto mode a GPU transport that cannot be made is left
// out (logged); in an explicit GPU mode that refuses the start.
absl::StatusOr<std::unique_ptr<kv::RoutingKvTransport>> MakeKvTransport(
    kv::KvTransportMode mode, const kv::KvPeerInfo& local, const MakeChannelFn& make_channel,
    int cuda_device) {
  kv::TcpTransportOptions topts;
  topts.cut_after_bytes = absl::GetFlag(FLAGS_testing_cut_transfer_after_bytes);
  topts.max_outstanding_per_target = absl::GetFlag(FLAGS_max_kv_pushes_per_target);
  topts.make_channel = make_channel;
  kv::GpuTransportOptions gopts;
  gopts.make_channel = make_channel;
  gopts.cuda_device = cuda_device;
  gopts.max_outstanding_per_target = topts.max_outstanding_per_target;
  auto reports = [&local](const std::string& t) {
    return std::find(local.transports.begin(), local.transports.end(), t) !=
           local.transports.end();
  };
  std::unique_ptr<kv::KvTransport> gpu[2];
  const std::pair<kv::KvTransportMode, std::string> kinds[2] = {
      {kv::KvTransportMode::kCudaIpc, "cuda_ipc"}, {kv::KvTransportMode::kNccl, "nccl"}};
  for (int i = 0; i < 2; ++i) {
    const bool wanted = mode == kinds[i].first;
    if (mode != kv::KvTransportMode::kAuto && !wanted) continue;
    if (!reports(kinds[i].second)) continue;
    absl::StatusOr<std::unique_ptr<kv::KvTransport>> t =
        i == 0 ? kv::CreateCudaIpcTransport(gopts) : kv::CreateNcclTransport(gopts);
    if (t.ok()) {
      gpu[i] = *std::move(t);
    } else if (wanted) {
      return absl::FailedPreconditionError(absl::StrCat(
          "--kv_transport ", kinds[i].second, ": ", t.status().message()));
    } else {
      DGSERVE_LOG_WARNING("--kv_transport auto: %s is left out: %s", kinds[i].second,
                          t.status().message());
    }
  }
  kv::RoutingKvTransportOptions ropts;
  ropts.mode = mode;
  ropts.local = local;
  ropts.lookup = kv::StatsKvPeerLookup(make_channel);
  return std::make_unique<kv::RoutingKvTransport>(std::move(ropts), kv::CreateTcpTransport(topts),
                                                  std::move(gpu[0]), std::move(gpu[1]));
}

absl::Status Run() {
  const std::string dir = absl::GetFlag(FLAGS_model);
  if (dir.empty()) return absl::InvalidArgumentError("--model is required");
  // Checked before the model loads.
  DGSERVE_ASSIGN_OR_RETURN(const std::vector<std::string> denoise_targets,
                           ParseTargets("--denoise_workers", absl::GetFlag(FLAGS_denoise_workers)));
  if (denoise_targets.empty()) {
    return absl::InvalidArgumentError(
        "--denoise_workers is required: the denoise workers a kv_target may name");
  }
  PrefillEngineOptions eopts;
  // 0 for either: chosen once the backend exists (its prefill_chunk_tokens).
  eopts.chunk_tokens = absl::GetFlag(FLAGS_chunk_tokens);
  eopts.step_token_budget = absl::GetFlag(FLAGS_step_token_budget);
  eopts.max_queue = absl::GetFlag(FLAGS_max_queue);
  if (eopts.chunk_tokens < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--chunk_tokens ", eopts.chunk_tokens,
                                                   ": must be ≥ 0 (0: the backend's default)"));
  }
  if (eopts.step_token_budget < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--step_token_budget ", eopts.step_token_budget,
                     ": must be ≥ 0 (0: the larger of 2048 and --chunk_tokens)"));
  }
  if (eopts.chunk_tokens > 0 && eopts.step_token_budget > 0 &&
      eopts.step_token_budget < eopts.chunk_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("--step_token_budget ", eopts.step_token_budget,
                                                   " is below --chunk_tokens ",
                                                   eopts.chunk_tokens));
  }
  if (eopts.max_queue < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_queue ", eopts.max_queue, ": must be ≥ 1"));
  }
  absl::StatusOr<kv::KvTransportMode> mode =
      kv::ParseKvTransportMode(absl::GetFlag(FLAGS_kv_transport));
  if (!mode.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--kv_transport: ", mode.status().message()));
  }
  // This process's GPU is that of --device cuda (device 0); with --device cpu it has none.
  const std::string device = absl::GetFlag(FLAGS_device);
  const kv::KvPeerInfo local = kv::LocalKvPeerInfo(device == "cuda" ? 0 : -1);
  if (absl::Status s = CheckExplicitKvTransport(*mode, local, device); !s.ok()) return s;
  const std::string model_id = ServedModelId(dir, absl::GetFlag(FLAGS_served_model_name));
  absl::StatusOr<BackendSelection> backend = BackendSelectionFromFlags(absl::GetFlag(FLAGS_device));
  if (!backend.ok()) return backend.status();
  absl::StatusOr<WorkerModel> model =
      LoadWorkerModel(dir, model_id, *backend, absl::GetFlag(FLAGS_kv_cache_mib),
                      absl::GetFlag(FLAGS_kv_block_size));
  if (!model.ok()) return model.status();
  if (eopts.chunk_tokens == 0) eopts.chunk_tokens = model->backend->prefill_chunk_tokens();
  if (eopts.step_token_budget == 0) {
    eopts.step_token_budget = std::max(2048, eopts.chunk_tokens);
  } else if (eopts.step_token_budget < eopts.chunk_tokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--step_token_budget ", eopts.step_token_budget, " is below --chunk_tokens ",
        eopts.chunk_tokens, " (the backend's default; pass --chunk_tokens to choose it)"));
  }
  DGSERVE_LOG_INFO("prefill: --chunk_tokens %d, --step_token_budget %d", eopts.chunk_tokens,
                   eopts.step_token_budget);
  {
    const kv::PoolStats st = model->pool->stats();
    const int chunk_blocks = model->pool->layout().BlocksFor(eopts.chunk_tokens);
    for (int k = 0; k < kv::kNumKinds; ++k) {
      if (model->pool->layout().layers[k] > 0 && st.total[k] < chunk_blocks) {
        DGSERVE_LOG_WARNING(
            "the KV pool (--kv_cache_mib %lld) holds %lld blocks of a layer kind, less than one "
            "--chunk_tokens chunk needs (%d): longer prompts are refused",
            static_cast<long long>(absl::GetFlag(FLAGS_kv_cache_mib)),
            static_cast<long long>(st.total[k]), chunk_blocks);
        break;
      }
    }
  }

  eopts.max_lease_ms = absl::GetFlag(FLAGS_max_kv_lease_ms);
  if (eopts.max_lease_ms < 1 || absl::GetFlag(FLAGS_max_kv_pushes_per_target) < 1) {
    return absl::InvalidArgumentError("--max_kv_lease_ms and --max_kv_pushes_per_target ≥ 1");
  }
  eopts.default_lease_ms = std::min(eopts.default_lease_ms, eopts.max_lease_ms);
  eopts.kv_push_wait_ms = absl::GetFlag(FLAGS_kv_push_wait_ms);
  if (eopts.kv_push_wait_ms < 0) {
    return absl::InvalidArgumentError("--kv_push_wait_ms must be >= 0 (0: no wait)");
  }
  TargetAllowList allowed(denoise_targets);
  eopts.check_kv_target = [&allowed](const std::string& t) { return allowed.Check(t); };
  absl::StatusOr<std::shared_ptr<const InternalAuth>> auth = InternalAuthFromFlags();
  if (!auth.ok()) return auth.status();

  ServerOptions opts;
  opts.grpc_address = absl::GetFlag(FLAGS_grpc_address);
  opts.metrics_address = absl::GetFlag(FLAGS_metrics_address);
  opts.ports_file = absl::GetFlag(FLAGS_ports_file);
  opts.credentials = (*auth)->ServerCredentials();
  opts.health_address = absl::GetFlag(FLAGS_health_address);
  ServiceRunner runner(opts);
  PrefillMetrics metrics(runner.registry());
  KvMetrics kv_metrics(runner.registry(), "prefill", /*prefix_cache=*/true);
  auto make_channel = [auth = *auth](const std::string& target,
                                     const grpc::ChannelArguments& args) {
    return auth->MakeChannel(target, args);
  };
  absl::StatusOr<std::unique_ptr<kv::RoutingKvTransport>> transport =
      MakeKvTransport(*mode, local, make_channel, device == "cuda" ? 0 : -1);
  if (!transport.ok()) return transport.status();
  DGSERVE_LOG_INFO("--kv_transport %s; this process: %s; usable here: %s",
                   kv::KvTransportModeName(*mode), kv::DescribeKvPeer(local),
                   absl::StrJoin((*transport)->available(), ","));
  PrefillEngine engine(model->backend.get(), model->pool.get(), *std::move(transport), eopts,
                       &metrics, &kv_metrics);
  PrefillServiceImpl service(&engine, model->pool.get(), model_id);
  if (absl::Status s = runner.Start({&service}, {v1::PrefillService::service_full_name()}); !s.ok()) return s;

  PeriodicTask gauges(absl::Milliseconds(250), [&] {
    kv_metrics.Update(model->pool->stats());
    kv_metrics.UpdateDevice(*model->backend);  // --device cuda only
  });
  if (absl::Status s = runner.WritePortsFile(); !s.ok()) return s;
  DGSERVE_LOG_INFO("prefill worker serving %s: gRPC port %d, metrics port %d", model_id,
                   runner.grpc_port(), runner.metrics_port());
  const int sig = ServiceRunner::WaitForSignal();
  DGSERVE_LOG_INFO("signal %d: draining", sig);
  engine.SetDraining(true);
  runner.Shutdown(absl::Seconds(absl::GetFlag(FLAGS_drain_grace_seconds)));
  return absl::OkStatus();
}

}  // namespace dgserve

int main(int argc, char** argv) {
  return dgserve::ServiceMain(argc, argv,
                              "dgserve-prefill-worker --model DIR [--grpc_address HOST:PORT] ...",
                              "prefill_worker/main.cc", dgserve::Run);
}
