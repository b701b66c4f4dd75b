// dgserve-server: the single-process mode (design §1) — gateway, prefill worker and denoise
// worker in one process, the prompt KV moving through the in-process transport. For a laptop and
// for tests; the multi-process cluster (tools/cluster.sh) is what the README demo starts.

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "denoise_worker/denoise_engine.h"
#include "denoise_worker/denoise_metrics.h"
#include "denoise_worker/denoise_service.h"
#include "engine/model/random_checkpoint.h"
#include "engine/tokenizer/tokenizer.h"
#include "gateway/gateway.h"
#include "gateway/gateway_metrics.h"
#include "gateway/grpc_service.h"
#include "gateway/http_server.h"
#include "gateway/worker_pool.h"
#include "kvstore/transfer.h"
#include "kvstore/transfer_service.h"
#include "prefill_worker/prefill_engine.h"
#include "prefill_worker/prefill_metrics.h"
#include "prefill_worker/prefill_service.h"
#include "service/internal_auth.h"
#include "service/server.h"
#include "worker/backend_flags.h"
#include "worker/kv_metrics.h"
#include "worker/worker_model.h"

ABSL_FLAG(std::string, model, "", "checkpoint directory (HF layout, with tokenizer.json)");
ABSL_FLAG(std::string, served_model_name, "", "model id (default: the directory's name)");
ABSL_FLAG(std::string, device, "cpu",
          "backend of both roles, as the workers' --device: cpu, or cuda (configured with "
          "-DDGSERVE_CUDA_BACKEND=ON, on a GPU machine: device 0; each role's backend holds its "
          "own copy of the weights and its own K/V pool, --cuda_kv_pool_gb each, else "
          "--cuda_memory_utilization each: give 0.45 or less; see "
          "--cuda_gemm_input; --cpu_gemm_input for the CPU)");
ABSL_FLAG(std::string, grpc_address, "127.0.0.1:0", "public gRPC listen address");
ABSL_FLAG(std::string, http_address, "127.0.0.1:0", "OpenAI HTTP listen address");
ABSL_FLAG(std::string, metrics_address, "127.0.0.1:0", "Prometheus /metrics (all three roles)");
ABSL_FLAG(std::string, ports_file, "", "write the bound ports here as JSON once serving");
ABSL_FLAG(int64_t, kv_cache_mib, 512, "memory of each role's KV block pool, MiB");
ABSL_FLAG(int, max_batch_canvases, 16, "canvases in one batched decoder pass at most");
ABSL_FLAG(int, max_concurrent_requests, 64,
          "requests running at once (gRPC and HTTP); beyond: queued, then 429 / RESOURCE_EXHAUSTED");
ABSL_FLAG(int, max_queued_requests, 0, "requests waiting for a slot; beyond: 429 at once");
ABSL_FLAG(int64_t, max_prompt_tokens, dgserve::kDefaultMaxPromptTokens,
          "prompt tokens per request at most (after the chat template); 0: only the model's "
          "context limit");
ABSL_FLAG(double, drain_grace_seconds, 30, "on SIGTERM: time given to running requests");

namespace dgserve {
namespace {

absl::Status Run() {
  const std::string dir = absl::GetFlag(FLAGS_model);
  if (dir.empty()) return absl::InvalidArgumentError("--model is required");
  const std::string model_id = ServedModelId(dir, absl::GetFlag(FLAGS_served_model_name));
  const int64_t mib = absl::GetFlag(FLAGS_kv_cache_mib);
  // Both roles run on the backend of --device (with --cpu_gemm_input or --cuda_gemm_input), as
  // the workers do; the in-process transport moves the KV between them either way.
  absl::StatusOr<BackendSelection> backend = BackendSelectionFromFlags(absl::GetFlag(FLAGS_device));
  if (!backend.ok()) return backend.status();
  // The weights once; a backend and a pool per role (each engine thread owns its backend).
  absl::StatusOr<WorkerModel> denoise_model = LoadWorkerModel(dir, model_id, *backend, mib, 16);
  if (!denoise_model.ok()) return denoise_model.status();
  WorkerModel prefill_role;
  absl::StatusOr<std::unique_ptr<ModelBackend>> prefill_backend = CreateBackend(
      *backend, denoise_model->checkpoint->config, denoise_model->checkpoint->weights);
  if (!prefill_backend.ok()) return prefill_backend.status();
  prefill_role.backend = *std::move(prefill_backend);
  absl::StatusOr<std::unique_ptr<kv::BlockPool>> prefill_pool_or =
      CreateKvPool(denoise_model->checkpoint->config, model_id, mib, 16);
  if (!prefill_pool_or.ok()) return prefill_pool_or.status();
  prefill_role.pool = *std::move(prefill_pool_or);
  WorkerModel* prefill_model = &prefill_role;
  absl::StatusOr<Tokenizer> tokenizer = Tokenizer::Load(dir + "/tokenizer.json");
  if (!tokenizer.ok()) return tokenizer.status();
  const ModelConfig& config = denoise_model->checkpoint->config;
  if (tokenizer->vocab_size() < config.vocab_size) {
    return absl::FailedPreconditionError(absl::StrCat(dir, "/tokenizer.json is not this model's"));
  }

  // The workers' gRPC server (loopback, any port); it also exports every role's metrics.
  // Its calls carry a token made for this process (no other process can call the workers).
  const std::shared_ptr<const InternalAuth> internal = InternalAuth::WithRandomToken();
  ServerOptions wopts;
  wopts.grpc_address = "127.0.0.1:0";
  wopts.credentials = internal->ServerCredentials();
  wopts.metrics_address = absl::GetFlag(FLAGS_metrics_address);
  ServiceRunner workers(wopts);
  prometheus::Registry& registry = workers.registry();
  DenoiseMetrics denoise_metrics(registry);
  PrefillMetrics prefill_metrics(registry);
  KvMetrics prefill_kv(registry, "prefill", /*prefix_cache=*/true),
      denoise_kv(registry, "denoise", /*prefix_cache=*/false);
  kv::KvReceiver receiver(denoise_model->pool.get(), config.max_position_embeddings);
  DenoiseEngineOptions dopts;
  dopts.max_batch_canvases = absl::GetFlag(FLAGS_max_batch_canvases);
  dopts.model_id = model_id;
  dopts.tokenizer = *tokenizer;  // stop sequences end samples on the denoise engine itself
  DenoiseEngine denoise(denoise_model->backend.get(), denoise_model->pool.get(), &receiver, dopts,
                        &denoise_metrics);
  DenoiseServiceImpl denoise_service(&denoise, denoise_model->pool.get(), &receiver, model_id,
                                     dopts.max_batch_canvases);
  kv::KvTransferServiceImpl transfer_service(&receiver);
  PrefillEngine prefill(prefill_model->backend.get(), prefill_model->pool.get(),
                        kv::CreateInProcessTransport(), PrefillEngineOptions{}, &prefill_metrics,
                        &prefill_kv);
  PrefillServiceImpl prefill_service(&prefill, prefill_model->pool.get(), model_id);
  if (absl::Status s = workers.Start({&denoise_service, &transfer_service, &prefill_service},
                                       {v1::DenoiseService::service_full_name(),
                                        v1::KvTransferService::service_full_name(),
                                        v1::PrefillService::service_full_name()});
      !s.ok()) {
    return s;
  }
  // The gateway names the denoise worker by this address; the in-process transport delivers
  // KV sent there straight into the receiver.
  const std::string worker_address = absl::StrCat("127.0.0.1:", workers.grpc_port());
  kv::RegisterInProcessReceiver(worker_address, &receiver);

  ServerOptions gopts_server;
  gopts_server.grpc_address = absl::GetFlag(FLAGS_grpc_address);
  gopts_server.metrics_address = "";
  gopts_server.ports_file = absl::GetFlag(FLAGS_ports_file);
  ServiceRunner front(gopts_server);
  GatewayMetrics gateway_metrics(registry);
  const ChannelFactory dial = [internal](const std::string& target,
                                         const grpc::ChannelArguments& args) {
    return internal->MakeChannel(target, args);
  };
  WorkerPool prefill_pool("prefill", {worker_address}, model_id, dial);
  WorkerPool denoise_pool("denoise", {worker_address}, model_id, dial);
  prefill_pool.Start();
  denoise_pool.Start();
  GatewayOptions gopts;
  gopts.model_id = model_id;
  gopts.max_concurrent_requests = std::max(1, absl::GetFlag(FLAGS_max_concurrent_requests));
  gopts.max_queued_requests = std::max(0, absl::GetFlag(FLAGS_max_queued_requests));
  gopts.max_prompt_tokens = std::max<int64_t>(0, absl::GetFlag(FLAGS_max_prompt_tokens));
  Gateway gateway(config, denoise_model->checkpoint->generation, *std::move(tokenizer), gopts,
                  &prefill_pool, &denoise_pool, &gateway_metrics);
  GenerationServiceImpl generation(&gateway, absl::Minutes(10));
  if (absl::Status s = front.Start({&generation}, {v1::GenerationService::service_full_name()}); !s.ok()) return s;
  absl::StatusOr<std::pair<std::string, int>> http_addr =
      SplitHostPort(absl::GetFlag(FLAGS_http_address));
  if (!http_addr.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--http_address: ", http_addr.status().message()));
  }
  HttpServerOptions hopts;
  hopts.host = http_addr->first;
  hopts.port = http_addr->second;
  OpenAiHttpServer http(&gateway, hopts, &registry);
  absl::StatusOr<int> http_port = http.Start();
  if (!http_port.ok()) return http_port.status();

  PeriodicTask gauges(absl::Milliseconds(250), [&] {
    prefill_kv.Update(prefill_model->pool->stats());
    denoise_kv.Update(denoise_model->pool->stats());
    prefill_kv.UpdateDevice(*prefill_model->backend);  // --device cuda only
    denoise_kv.UpdateDevice(*denoise_model->backend);
    denoise_kv.UpdateReceived("inprocess", receiver.received_bytes());
    gateway.UpdateWorkerGauges();
  });
  if (absl::Status s = front.WritePortsFile({{"http", *http_port},
                                             {"metrics", workers.metrics_port()},
                                             {"worker_grpc", workers.grpc_port()}});
      !s.ok()) {
    return s;
  }
  DGSERVE_LOG_INFO("dgserve-server serving %s: gRPC port %d, HTTP port %d, metrics port %d",
                   model_id, front.grpc_port(), *http_port, workers.metrics_port());
  const int sig = ServiceRunner::WaitForSignal();
  DGSERVE_LOG_INFO("signal %d: draining", sig);
  http.SetDraining(true);
  gateway.Drain(absl::Seconds(absl::GetFlag(FLAGS_drain_grace_seconds)));
  http.Stop();
  front.Shutdown(absl::Seconds(1));
  workers.Shutdown(absl::Seconds(1));
  kv::UnregisterInProcessReceiver(worker_address);
  return absl::OkStatus();
}

}  // namespace
}  // namespace dgserve

int main(int argc, char** argv) {
  return dgserve::ServiceMain(argc, argv,
                              "dgserve-server --model DIR [--grpc_address HOST:PORT] "
                              "[--http_address HOST:PORT] [--device cpu|cuda]: all roles in one "
                              "process",
                              "tools/server_main.cc", dgserve::Run);
}
