// dgserve-denoise-worker: receives prompt KV (KvTransferService), runs the canvas denoising
// loops of many requests with continuous batching (DenoiseService), exports /metrics.
#include <cstdio>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "common/cli.h"
#include "common/logging.h"
#include "common/openmp_env.h"
#include "denoise_worker/denoise_engine.h"
#include "denoise_worker/denoise_metrics.h"
#include "denoise_worker/denoise_service.h"
#include "kvstore/gpu_transport.h"
#include "kvstore/transfer.h"
#include "kvstore/transfer_service.h"
#include "kvstore/transport_selection.h"
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
ABSL_FLAG(int64_t, kv_cache_mib, 512, "memory of the KV block pool, MiB");
ABSL_FLAG(int, kv_block_size, 16, "token positions per KV block");
ABSL_FLAG(int, max_batch_canvases, 16, "canvases in one batched decoder pass at most");
ABSL_FLAG(int, max_queue, 256, "requests waiting for KV or a batch slot at most");
ABSL_FLAG(double, drain_grace_seconds, 30, "on SIGTERM: time given to running requests");
ABSL_FLAG(int64_t, max_kv_lease_ms, 60000,
          "a KV transfer's lease_ms above this is clamped: the time its blocks may stay pinned "
          "while it arrives, then while its KV waits to be claimed");
ABSL_FLAG(int, max_kv_transfers_per_peer, 64,
          "KV transfer streams open at once from one peer address; beyond: RESOURCE_EXHAUSTED");
ABSL_FLAG(std::string, health_address, "",
          "if set: a plaintext port serving only grpc.health.v1.Health (kubelet probes)");

namespace dgserve {

absl::Status Run() {
  const std::string dir = absl::GetFlag(FLAGS_model);
  if (dir.empty()) return absl::InvalidArgumentError("--model is required");
  if (absl::GetFlag(FLAGS_max_batch_canvases) < 1 || absl::GetFlag(FLAGS_max_queue) < 0) {
    return absl::InvalidArgumentError("--max_batch_canvases must be ≥ 1 and --max_queue ≥ 0");
  }
  const std::string model_id = ServedModelId(dir, absl::GetFlag(FLAGS_served_model_name));
  absl::StatusOr<BackendSelection> backend = BackendSelectionFromFlags(absl::GetFlag(FLAGS_device));
  if (!backend.ok()) return backend.status();
  absl::StatusOr<WorkerModel> model =
      LoadWorkerModel(dir, model_id, *backend, absl::GetFlag(FLAGS_kv_cache_mib),
                      absl::GetFlag(FLAGS_kv_block_size));
  if (!model.ok()) return model.status();
  const ModelConfig& config = model->checkpoint->config;

  const int64_t max_lease_ms = absl::GetFlag(FLAGS_max_kv_lease_ms);
  if (max_lease_ms < 1 || absl::GetFlag(FLAGS_max_kv_transfers_per_peer) < 1) {
    return absl::InvalidArgumentError("--max_kv_lease_ms and --max_kv_transfers_per_peer ≥ 1");
  }
  absl::StatusOr<std::shared_ptr<const InternalAuth>> auth = InternalAuthFromFlags();
  if (!auth.ok()) return auth.status();

  ServerOptions opts;
  opts.grpc_address = absl::GetFlag(FLAGS_grpc_address);
  opts.metrics_address = absl::GetFlag(FLAGS_metrics_address);
  opts.ports_file = absl::GetFlag(FLAGS_ports_file);
  opts.credentials = (*auth)->ServerCredentials();
  opts.health_address = absl::GetFlag(FLAGS_health_address);
  ServiceRunner runner(opts);
  DenoiseMetrics metrics(runner.registry());
  KvMetrics kv_metrics(runner.registry(), "denoise", /*prefix_cache=*/false);

  kv::KvReceiver receiver(model->pool.get(), config.max_position_embeddings, max_lease_ms);
  DenoiseEngineOptions eopts;
  eopts.max_batch_canvases = absl::GetFlag(FLAGS_max_batch_canvases);
  eopts.max_queue = absl::GetFlag(FLAGS_max_queue);
  eopts.max_kv_wait_ms = max_lease_ms;  // a Denoise call's kv_wait_ms is clamped to it
  eopts.model_id = model_id;
  // The gateway reads the same directory's tokenizer.json; with it the worker ends a sample at
  // a stop sequence itself (see DenoiseEngineOptions::tokenizer).
  if (absl::StatusOr<Tokenizer> t = Tokenizer::Load(dir + "/tokenizer.json"); t.ok()) {
    eopts.tokenizer = *std::move(t);
  } else {
    DGSERVE_LOG_WARNING("no tokenizer (%s): stop sequences end samples by cancellation only",
                        t.status().message());
  }
  DenoiseEngine engine(model->backend.get(), model->pool.get(), &receiver, eopts, &metrics);
  // What Stats reports for the prefill workers' --kv_transport auto: the node (env NODE_NAME,
  // else the host name), the GPU of --device cuda (device 0; cpu: none), the transports.
  const bool cuda = absl::GetFlag(FLAGS_device) == "cuda";
  kv::KvPeerInfo peer_info = kv::LocalKvPeerInfo(cuda ? 0 : -1);
  // With a GPU: the receiving half of the NCCL and CUDA IPC transports (their staging memory on
  // device 0). Where it cannot be made (a build without them, no usable device), only TCP is
  // offered.
  std::shared_ptr<kv::GpuReceiveEndpoint> gpu_endpoint;
  if (cuda && peer_info.transports.size() > 1) {
    kv::GpuTransportOptions gopts;
    gopts.cuda_device = 0;
    absl::StatusOr<std::shared_ptr<kv::GpuReceiveEndpoint>> ep =
        kv::CreateGpuReceiveEndpoint(gopts);
    if (ep.ok()) {
      gpu_endpoint = *std::move(ep);
    } else {
      DGSERVE_LOG_WARNING("GPU KV transports off: %s", ep.status().ToString());
    }
  }
  if (gpu_endpoint == nullptr) peer_info.transports = {"tcp"};
  DGSERVE_LOG_INFO("KV transports: %s", kv::DescribeKvPeer(peer_info));
  DenoiseServiceImpl denoise(&engine, model->pool.get(), &receiver, model_id,
                             eopts.max_batch_canvases, peer_info);
  kv::KvTransferServiceOptions topts;
  topts.max_transfers_per_peer = absl::GetFlag(FLAGS_max_kv_transfers_per_peer);
  // A stream outlives its lease by a little at most (the lease starts when its header is read).
  topts.max_stream_time = absl::Milliseconds(max_lease_ms) + absl::Seconds(5);
  topts.gpu = gpu_endpoint;
  kv::KvTransferServiceImpl transfer(&receiver, topts);
  if (absl::Status s = runner.Start({&denoise, &transfer}, {v1::DenoiseService::service_full_name(),
                                                      v1::KvTransferService::service_full_name()}); !s.ok()) return s;

  PeriodicTask gauges(absl::Milliseconds(250), [&] {
    kv_metrics.Update(model->pool->stats());
    kv_metrics.UpdateDevice(*model->backend);  // --device cuda only
    // Inline blocks came over the PushBlocks stream (TCP); the others over NCCL or CUDA IPC.
    for (const auto& [path, bytes] : receiver.received_bytes_by_path()) {
      kv_metrics.UpdateReceived(path == v1::KV_DATA_NCCL       ? "nccl"
                                : path == v1::KV_DATA_CUDA_IPC ? "cuda_ipc"
                                                               : "tcp",
                                bytes);
    }
  });
  if (absl::Status s = runner.WritePortsFile(); !s.ok()) return s;
  DGSERVE_LOG_INFO("denoise worker serving %s: gRPC port %d, metrics port %d", model_id,
                   runner.grpc_port(), runner.metrics_port());
  const int sig = ServiceRunner::WaitForSignal();
  DGSERVE_LOG_INFO("signal %d: draining", sig);
  engine.SetDraining(true);
  runner.SetServing(false);
  runner.Shutdown(absl::Seconds(absl::GetFlag(FLAGS_drain_grace_seconds)));
  return absl::OkStatus();
}

}  // namespace dgserve

int main(int argc, char** argv) {
  return dgserve::ServiceMain(argc, argv,
                              "dgserve-denoise-worker --model DIR [--grpc_address HOST:PORT] ...",
                              "denoise_worker/main.cc", dgserve::Run);
}
