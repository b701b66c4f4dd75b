// What every dgserve service process shares: a gRPC server with the standard health service and
// server reflection, a Prometheus /metrics endpoint on its own port, a ports file for tests and
// scripts, and SIGTERM/SIGINT handling.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "prometheus/exposer.h"
#include "prometheus/registry.h"
#include "service/unparsable_request.h"

namespace dgserve {

struct ServerOptions {
  std::string grpc_address = "127.0.0.1:0";     // host:port; port 0 = chosen by the kernel
  std::string metrics_address = "127.0.0.1:0";  // Prometheus /metrics; empty = no exporter
  std::string ports_file;  // if set: JSON {"grpc": P, "metrics": P, ...} written once serving
  int max_message_bytes = 64 << 20;
  // Largest message the server accepts (gRPC refuses a larger one with RESOURCE_EXHAUSTED
  // before allocating it); 0: max_message_bytes. The gateway's public port uses --max_body_bytes.
  int max_receive_message_bytes = 0;
  // Credentials of the gRPC port (InternalAuth::ServerCredentials() on a worker, the API-key
  // check on the gateway's public port); null: plaintext without any check (tests only).
  std::shared_ptr<grpc::ServerCredentials> credentials;
  // If set: a second, plaintext port serving only grpc.health.v1.Health (for kubelet probes,
  // which cannot present a client certificate); every other method there is UNAUTHENTICATED.
  std::string health_address;
  // Told of each call whose request message could not be parsed (a string field that is not
  // UTF-8, a garbled message); the call ends INVALID_ARGUMENT (service/unparsable_request.h).
  UnparsableRequestCallback on_unparsable_request;
};

class ServiceRunner {
 public:
  explicit ServiceRunner(ServerOptions options);
  ~ServiceRunner();

  prometheus::Registry& registry() { return *registry_; }
  // Blocks SIGTERM/SIGINT in this thread (call first thing in main, before any thread starts)
  // and starts a thread that records them; WaitForSignal() returns on the first.
  static void BlockTerminationSignals();

  // Starts the metrics exposer and the gRPC server with `services` (plus grpc.health.v1 and
  // reflection). `service_names` are the full names of the services (e.g.
  // v1::GenerationService::service_full_name()): grpc.health.v1 answers for each of them, as
  // for "" (the whole server); any other name is NOT_FOUND. UNAVAILABLE naming the address when
  // a port cannot be bound.
  absl::Status Start(const std::vector<grpc::Service*>& services,
                     const std::vector<std::string>& service_names = {});
  int grpc_port() const { return grpc_port_; }
  int metrics_port() const { return metrics_port_; }
  int health_port() const { return health_port_; }  // 0 without a health_address
  grpc::Server* server() { return server_.get(); }
  // Sets the health status of the whole server ("" service) and of every served service name
  // to SERVING or NOT_SERVING.
  void SetServing(bool serving);
  // Writes the ports file (if configured) with `extra` fields added (e.g. {"http": 8080}).
  absl::Status WritePortsFile(const std::vector<std::pair<std::string, int>>& extra = {});
  // Blocks until SIGTERM or SIGINT arrives (BlockTerminationSignals must have been called).
  static int WaitForSignal();
  // Stops the gRPC server, letting in-flight calls finish until `grace` has passed.
  void Shutdown(absl::Duration grace);

 private:
  ServerOptions options_;
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  std::unique_ptr<grpc::Server> server_;
  std::vector<std::string> service_names_;
  int grpc_port_ = 0;
  int metrics_port_ = 0;
  int health_port_ = 0;
};

// Calls `fn` every `period` on its own thread (first call at once) until destroyed; the
// destructor stops and joins it. For gauges sampled from state (KV pool, worker health).
class PeriodicTask {
 public:
  PeriodicTask(absl::Duration period, std::function<void()> fn);
  ~PeriodicTask();
  PeriodicTask(const PeriodicTask&) = delete;
  PeriodicTask& operator=(const PeriodicTask&) = delete;

 private:
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

// "host:port" → (host, port) for the listeners (civetweb, the HTTP server); INVALID_ARGUMENT when
// malformed.
absl::StatusOr<std::pair<std::string, int>> SplitHostPort(const std::string& address);

// The main() of a service binary: OpenMP passive wait policy, SIGTERM/SIGINT blocked for
// WaitForSignal, --help listing the flags of `flags_file`, flags parsed (a stray argument exits
// 2), then `run`; an error is printed and exits 1.
int ServiceMain(int argc, char** argv, const char* usage, const char* flags_file,
                absl::Status (*run)());

// The served model's id: `flag` if set, else the last component of `dir`.
std::string ServedModelId(const std::string& dir, const std::string& flag);

}  // namespace dgserve
